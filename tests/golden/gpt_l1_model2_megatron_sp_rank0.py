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
    reduce_scatter = torch.ops.autoshard.reduce_scatter.default(add, 'model', 0, 2)
    grad_all_reduce = torch.ops.autoshard.grad_all_reduce.default(blocks_0_ln1_weight, ['model']);  blocks_0_ln1_weight = None
    grad_all_reduce_1 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_ln1_bias, ['model']);  blocks_0_ln1_bias = None
    layer_norm = torch.ops.aten.layer_norm.default(reduce_scatter, [64], grad_all_reduce, grad_all_reduce_1, 1e-05, False);  reduce_scatter = grad_all_reduce = grad_all_reduce_1 = None
    all_gather_sync = torch.ops.autoshard.all_gather_sync.default(layer_norm, 'model', 0, 2, ['model']);  layer_norm = None
    linear = torch.ops.aten.linear.default(all_gather_sync, blocks_0_attn_q_weight, blocks_0_attn_q_bias);  blocks_0_attn_q_weight = blocks_0_attn_q_bias = None
    view = torch.ops.aten.view.default(linear, [4, 16, 2, 16]);  linear = None
    transpose = torch.ops.aten.transpose.int(view, 1, 2);  view = None
    linear_1 = torch.ops.aten.linear.default(all_gather_sync, blocks_0_attn_k_weight, blocks_0_attn_k_bias);  blocks_0_attn_k_weight = blocks_0_attn_k_bias = None
    view_1 = torch.ops.aten.view.default(linear_1, [4, 16, 2, 16]);  linear_1 = None
    transpose_1 = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
    linear_2 = torch.ops.aten.linear.default(all_gather_sync, blocks_0_attn_v_weight, blocks_0_attn_v_bias);  all_gather_sync = blocks_0_attn_v_weight = blocks_0_attn_v_bias = None
    view_2 = torch.ops.aten.view.default(linear_2, [4, 16, 2, 16]);  linear_2 = None
    transpose_2 = torch.ops.aten.transpose.int(view_2, 1, 2);  view_2 = None
    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(transpose, transpose_1, transpose_2, None, 0.0, True);  transpose = transpose_1 = transpose_2 = None
    transpose_3 = torch.ops.aten.transpose.int(scaled_dot_product_attention, 1, 2);  scaled_dot_product_attention = None
    reshape = torch.ops.aten.reshape.default(transpose_3, [4, 16, 32]);  transpose_3 = None
    bias_once = autoshard_runtime_ops_bias_once(blocks_0_attn_out_bias, True);  blocks_0_attn_out_bias = None
    linear_3 = torch.ops.aten.linear.default(reshape, blocks_0_attn_out_weight, bias_once);  reshape = blocks_0_attn_out_weight = bias_once = None
    add_1 = torch.ops.aten.add.Tensor(add, linear_3);  add = linear_3 = None
    reduce_scatter_1 = torch.ops.autoshard.reduce_scatter.default(add_1, 'model', 0, 2)
    grad_all_reduce_3 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_ln2_weight, ['model']);  blocks_0_ln2_weight = None
    grad_all_reduce_4 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_ln2_bias, ['model']);  blocks_0_ln2_bias = None
    layer_norm_1 = torch.ops.aten.layer_norm.default(reduce_scatter_1, [64], grad_all_reduce_3, grad_all_reduce_4, 1e-05, False);  reduce_scatter_1 = grad_all_reduce_3 = grad_all_reduce_4 = None
    all_gather_sync_1 = torch.ops.autoshard.all_gather_sync.default(layer_norm_1, 'model', 0, 2, ['model']);  layer_norm_1 = None
    linear_4 = torch.ops.aten.linear.default(all_gather_sync_1, blocks_0_mlp_0_weight, blocks_0_mlp_0_bias);  all_gather_sync_1 = blocks_0_mlp_0_weight = blocks_0_mlp_0_bias = None
    gelu = torch.ops.aten.gelu.default(linear_4);  linear_4 = None
    bias_once_1 = autoshard_runtime_ops_bias_once(blocks_0_mlp_2_bias, True);  blocks_0_mlp_2_bias = None
    linear_5 = torch.ops.aten.linear.default(gelu, blocks_0_mlp_2_weight, bias_once_1);  gelu = blocks_0_mlp_2_weight = bias_once_1 = None
    add_2 = torch.ops.aten.add.Tensor(add_1, linear_5);  add_1 = linear_5 = None
    reduce_scatter_2 = torch.ops.autoshard.reduce_scatter.default(add_2, 'model', 0, 2);  add_2 = None
    grad_all_reduce_6 = torch.ops.autoshard.grad_all_reduce.default(ln_f_weight, ['model']);  ln_f_weight = None
    grad_all_reduce_7 = torch.ops.autoshard.grad_all_reduce.default(ln_f_bias, ['model']);  ln_f_bias = None
    layer_norm_2 = torch.ops.aten.layer_norm.default(reduce_scatter_2, [64], grad_all_reduce_6, grad_all_reduce_7, 1e-05, False);  reduce_scatter_2 = grad_all_reduce_6 = grad_all_reduce_7 = None
    all_gather_sync_2 = torch.ops.autoshard.all_gather_sync.default(layer_norm_2, 'model', 0, 2, ['model']);  layer_norm_2 = None
    linear_6 = torch.ops.aten.linear.default(all_gather_sync_2, wte_weight);  all_gather_sync_2 = wte_weight = None
    view_3 = torch.ops.aten.view.default(linear_6, [64, 64]);  linear_6 = None
    local_slice = torch.ops.autoshard.local_slice.default(labels, 'model', 0, 2);  labels = None
    view_4 = torch.ops.aten.view.default(local_slice, [32]);  local_slice = None
    all_gather_3 = torch.ops.autoshard.all_gather.default(view_4, 'model', 0, 2);  view_4 = None
    vocab_parallel_cross_entropy = torch.ops.autoshard.vocab_parallel_cross_entropy.default(view_3, all_gather_3, -100, 1, 'model', 2, []);  view_3 = all_gather_3 = None
    getitem = vocab_parallel_cross_entropy[0];  vocab_parallel_cross_entropy = None
    all_reduce = torch.ops.autoshard.all_reduce.default(getitem, 'model');  getitem = None
    return pytree.tree_unflatten((all_reduce,), self._out_spec)
