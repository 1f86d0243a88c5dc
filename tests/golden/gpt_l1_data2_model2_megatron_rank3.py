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
    grad_all_reduce = torch.ops.autoshard.grad_all_reduce.default(wte_weight, ['data']);  wte_weight = None
    masked_embedding = autoshard_runtime_ops_masked_embedding(grad_all_reduce, ids, 64, -1);  ids = None
    masked_embedding_1 = autoshard_runtime_ops_masked_embedding(wpe_weight, arange, 8, -1);  wpe_weight = arange = None
    grad_all_reduce_1 = torch.ops.autoshard.grad_all_reduce.default(masked_embedding_1, ['data']);  masked_embedding_1 = None
    add = torch.ops.aten.add.Tensor(masked_embedding, grad_all_reduce_1);  masked_embedding = grad_all_reduce_1 = None
    all_reduce = torch.ops.autoshard.all_reduce.default(add, 'model')
    grad_all_reduce_2 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_ln1_weight, ['data']);  blocks_0_ln1_weight = None
    grad_all_reduce_3 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_ln1_bias, ['data']);  blocks_0_ln1_bias = None
    layer_norm = torch.ops.aten.layer_norm.default(all_reduce, [64], grad_all_reduce_2, grad_all_reduce_3, 1e-05, False);  all_reduce = grad_all_reduce_2 = grad_all_reduce_3 = None
    grad_all_reduce_5 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_attn_q_weight, ['data']);  blocks_0_attn_q_weight = None
    grad_all_reduce_6 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_attn_q_bias, ['data']);  blocks_0_attn_q_bias = None
    grad_all_reduce_7 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_attn_k_weight, ['data']);  blocks_0_attn_k_weight = None
    grad_all_reduce_8 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_attn_k_bias, ['data']);  blocks_0_attn_k_bias = None
    grad_all_reduce_9 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_attn_v_weight, ['data']);  blocks_0_attn_v_weight = None
    grad_all_reduce_10 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_attn_v_bias, ['data']);  blocks_0_attn_v_bias = None
    linears_grad_all_reduce = torch.ops.autoshard.linears_grad_all_reduce.default(layer_norm, ['model'], [grad_all_reduce_5, grad_all_reduce_7, grad_all_reduce_9], [grad_all_reduce_6, grad_all_reduce_8, grad_all_reduce_10], [True, True, True]);  layer_norm = grad_all_reduce_5 = grad_all_reduce_7 = grad_all_reduce_9 = grad_all_reduce_6 = grad_all_reduce_8 = grad_all_reduce_10 = None
    getitem_1 = linears_grad_all_reduce[0]
    getitem_2 = linears_grad_all_reduce[1]
    getitem_3 = linears_grad_all_reduce[2];  linears_grad_all_reduce = None
    view = torch.ops.aten.view.default(getitem_1, [2, 16, 2, 16]);  getitem_1 = None
    transpose = torch.ops.aten.transpose.int(view, 1, 2);  view = None
    view_1 = torch.ops.aten.view.default(getitem_2, [2, 16, 2, 16]);  getitem_2 = None
    transpose_1 = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
    view_2 = torch.ops.aten.view.default(getitem_3, [2, 16, 2, 16]);  getitem_3 = None
    transpose_2 = torch.ops.aten.transpose.int(view_2, 1, 2);  view_2 = None
    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(transpose, transpose_1, transpose_2, None, 0.0, True);  transpose = transpose_1 = transpose_2 = None
    transpose_3 = torch.ops.aten.transpose.int(scaled_dot_product_attention, 1, 2);  scaled_dot_product_attention = None
    reshape = torch.ops.aten.reshape.default(transpose_3, [2, 16, 32]);  transpose_3 = None
    grad_all_reduce_11 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_attn_out_weight, ['data']);  blocks_0_attn_out_weight = None
    grad_all_reduce_12 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_attn_out_bias, ['data']);  blocks_0_attn_out_bias = None
    bias_once = autoshard_runtime_ops_bias_once(grad_all_reduce_12, False);  grad_all_reduce_12 = None
    linear_3 = torch.ops.aten.linear.default(reshape, grad_all_reduce_11, bias_once);  reshape = grad_all_reduce_11 = bias_once = None
    add_1 = torch.ops.aten.add.Tensor(add, linear_3);  add = linear_3 = None
    all_reduce_1 = torch.ops.autoshard.all_reduce.default(add_1, 'model')
    grad_all_reduce_13 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_ln2_weight, ['data']);  blocks_0_ln2_weight = None
    grad_all_reduce_14 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_ln2_bias, ['data']);  blocks_0_ln2_bias = None
    layer_norm_1 = torch.ops.aten.layer_norm.default(all_reduce_1, [64], grad_all_reduce_13, grad_all_reduce_14, 1e-05, False);  all_reduce_1 = grad_all_reduce_13 = grad_all_reduce_14 = None
    grad_all_reduce_16 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_mlp_0_weight, ['data']);  blocks_0_mlp_0_weight = None
    grad_all_reduce_17 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_mlp_0_bias, ['data']);  blocks_0_mlp_0_bias = None
    linears_grad_all_reduce_1 = torch.ops.autoshard.linears_grad_all_reduce.default(layer_norm_1, ['model'], [grad_all_reduce_16], [grad_all_reduce_17], [True]);  layer_norm_1 = grad_all_reduce_16 = grad_all_reduce_17 = None
    getitem_4 = linears_grad_all_reduce_1[0];  linears_grad_all_reduce_1 = None
    gelu = torch.ops.aten.gelu.default(getitem_4);  getitem_4 = None
    grad_all_reduce_18 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_mlp_2_weight, ['data']);  blocks_0_mlp_2_weight = None
    grad_all_reduce_19 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_mlp_2_bias, ['data']);  blocks_0_mlp_2_bias = None
    bias_once_1 = autoshard_runtime_ops_bias_once(grad_all_reduce_19, False);  grad_all_reduce_19 = None
    linear_5 = torch.ops.aten.linear.default(gelu, grad_all_reduce_18, bias_once_1);  gelu = grad_all_reduce_18 = bias_once_1 = None
    add_2 = torch.ops.aten.add.Tensor(add_1, linear_5);  add_1 = linear_5 = None
    all_reduce_2 = torch.ops.autoshard.all_reduce.default(add_2, 'model');  add_2 = None
    grad_all_reduce_20 = torch.ops.autoshard.grad_all_reduce.default(ln_f_weight, ['data']);  ln_f_weight = None
    grad_all_reduce_21 = torch.ops.autoshard.grad_all_reduce.default(ln_f_bias, ['data']);  ln_f_bias = None
    layer_norm_2 = torch.ops.aten.layer_norm.default(all_reduce_2, [64], grad_all_reduce_20, grad_all_reduce_21, 1e-05, False);  all_reduce_2 = grad_all_reduce_20 = grad_all_reduce_21 = None
    linears_grad_all_reduce_2 = torch.ops.autoshard.linears_grad_all_reduce.default(layer_norm_2, ['model'], [grad_all_reduce], [], [False]);  layer_norm_2 = grad_all_reduce = None
    getitem_5 = linears_grad_all_reduce_2[0];  linears_grad_all_reduce_2 = None
    view_3 = torch.ops.aten.view.default(getitem_5, [32, 64]);  getitem_5 = None
    view_4 = torch.ops.aten.view.default(labels, [32]);  labels = None
    vocab_parallel_cross_entropy = torch.ops.autoshard.vocab_parallel_cross_entropy.default(view_3, view_4, -100, 1, 'model', 2, ['data']);  view_3 = view_4 = None
    getitem = vocab_parallel_cross_entropy[0];  vocab_parallel_cross_entropy = None
    all_reduce_3 = torch.ops.autoshard.all_reduce.default(getitem, 'data');  getitem = None
    all_reduce_4 = torch.ops.autoshard.all_reduce.default(all_reduce_3, 'model');  all_reduce_3 = None
    return pytree.tree_unflatten((all_reduce_4,), self._out_spec)
