def forward(self, ids, labels):
    ids, labels, = fx_pytree.tree_flatten_spec(([ids, labels], {}), self._in_spec)
    wpe_weight = self.wpe.weight
    rank_device = wpe_weight.device
    blocks_0_ln1_weight = getattr(self.blocks, "0").ln1.weight
    blocks_0_ln1_bias = getattr(self.blocks, "0").ln1.bias
    blocks_0_attn_q_weight = getattr(self.blocks, "0").attn.q.weight
    blocks_0_attn_q_bias = getattr(self.blocks, "0").attn.q.bias
    blocks_0_attn_k_weight = getattr(self.blocks, "0").attn.k.weight
    blocks_0_attn_k_bias = getattr(self.blocks, "0").attn.k.bias
    blocks_0_attn_v_weight = getattr(self.blocks, "0").attn.v.weight
    blocks_0_attn_v_bias = getattr(self.blocks, "0").attn.v.bias
    blocks_0_attn_out_weight = getattr(self.blocks, "0").attn.out.weight
    blocks_0_attn_out_bias = getattr(self.blocks, "0").attn.out.bias
    blocks_0_ln2_weight = getattr(self.blocks, "0").ln2.weight
    blocks_0_ln2_bias = getattr(self.blocks, "0").ln2.bias
    blocks_0_mlp_0_weight = getattr(getattr(self.blocks, "0").mlp, "0").weight
    blocks_0_mlp_0_bias = getattr(getattr(self.blocks, "0").mlp, "0").bias
    blocks_0_mlp_2_weight = getattr(getattr(self.blocks, "0").mlp, "2").weight
    blocks_0_mlp_2_bias = getattr(getattr(self.blocks, "0").mlp, "2").bias
    ln_f_weight = self.ln_f.weight
    ln_f_bias = self.ln_f.bias
    wte_weight = self.wte.weight
    arange = torch.ops.aten.arange.default(16, device = rank_device, pin_memory = False);  rank_device = None
    masked_embedding = autoshard_runtime_ops_masked_embedding(wte_weight, ids, 0, -1);  ids = None
    masked_embedding_1 = autoshard_runtime_ops_masked_embedding(wpe_weight, arange, 0, -1);  wpe_weight = arange = None
    add = torch.ops.aten.add.Tensor(masked_embedding, masked_embedding_1);  masked_embedding = masked_embedding_1 = None
    all_reduce = torch.ops.autoshard.all_reduce.default(add, 'model')
    bias_once = autoshard_runtime_ops_bias_once(blocks_0_attn_out_bias, True);  blocks_0_attn_out_bias = None
    bias_once_1 = autoshard_runtime_ops_bias_once(blocks_0_mlp_2_bias, True);  blocks_0_mlp_2_bias = None
    recompute_blocks_0 = self.recompute_blocks_0
    checkpoint = autoshard_runtime_recompute_checkpoint(recompute_blocks_0, all_reduce, blocks_0_ln1_weight, blocks_0_ln1_bias, blocks_0_attn_q_weight, blocks_0_attn_k_weight, blocks_0_attn_v_weight, blocks_0_attn_q_bias, blocks_0_attn_k_bias, blocks_0_attn_v_bias, blocks_0_attn_out_weight, bias_once, add, blocks_0_ln2_weight, blocks_0_ln2_bias, blocks_0_mlp_0_weight, blocks_0_mlp_0_bias, blocks_0_mlp_2_weight, bias_once_1);  recompute_blocks_0 = all_reduce = blocks_0_ln1_weight = blocks_0_ln1_bias = blocks_0_attn_q_weight = blocks_0_attn_k_weight = blocks_0_attn_v_weight = blocks_0_attn_q_bias = blocks_0_attn_k_bias = blocks_0_attn_v_bias = blocks_0_attn_out_weight = bias_once = add = blocks_0_ln2_weight = blocks_0_ln2_bias = blocks_0_mlp_0_weight = blocks_0_mlp_0_bias = blocks_0_mlp_2_weight = bias_once_1 = None
    getitem_6 = checkpoint[0];  checkpoint = None
    all_reduce_2 = torch.ops.autoshard.all_reduce.default(getitem_6, 'model');  getitem_6 = None
    layer_norm_2 = torch.ops.aten.layer_norm.default(all_reduce_2, [64], ln_f_weight, ln_f_bias, 1e-05, False);  all_reduce_2 = ln_f_weight = ln_f_bias = None
    linears_grad_all_reduce_2 = torch.ops.autoshard.linears_grad_all_reduce.default(layer_norm_2, ['model'], [wte_weight], [], [False]);  layer_norm_2 = wte_weight = None
    getitem_5 = linears_grad_all_reduce_2[0];  linears_grad_all_reduce_2 = None
    view_3 = torch.ops.aten.view.default(getitem_5, [64, 64]);  getitem_5 = None
    view_4 = torch.ops.aten.view.default(labels, [64]);  labels = None
    vocab_parallel_cross_entropy = torch.ops.autoshard.vocab_parallel_cross_entropy.default(view_3, view_4, -100, 1, 'model', 2, []);  view_3 = view_4 = None
    getitem = vocab_parallel_cross_entropy[0];  vocab_parallel_cross_entropy = None
    all_reduce_3 = torch.ops.autoshard.all_reduce.default(getitem, 'model');  getitem = None
    return pytree.tree_unflatten((all_reduce_3,), self._out_spec)
