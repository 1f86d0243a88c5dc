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
    ln_f_weight = self.ln_f.weight
    ln_f_bias = self.ln_f.bias
    wte_weight = self.wte.weight
    arange = torch.ops.aten.arange.default(16, device = rank_device, pin_memory = False);  rank_device = None
    grad_all_reduce = torch.ops.autoshard.grad_all_reduce.default(wte_weight, ['data']);  wte_weight = None
    embedding = torch.ops.aten.embedding.default(grad_all_reduce, ids);  ids = None
    embedding_1 = torch.ops.aten.embedding.default(wpe_weight, arange);  wpe_weight = arange = None
    grad_all_reduce_1 = torch.ops.autoshard.grad_all_reduce.default(embedding_1, ['data']);  embedding_1 = None
    add = torch.ops.aten.add.Tensor(embedding, grad_all_reduce_1);  embedding = grad_all_reduce_1 = None
    grad_all_reduce_2 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_ln1_weight, ['data']);  blocks_0_ln1_weight = None
    grad_all_reduce_3 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_ln1_bias, ['data']);  blocks_0_ln1_bias = None
    layer_norm = torch.ops.aten.layer_norm.default(add, [64], grad_all_reduce_2, grad_all_reduce_3, 1e-05, False);  grad_all_reduce_2 = grad_all_reduce_3 = None
    grad_all_reduce_4 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_attn_q_weight, ['data']);  blocks_0_attn_q_weight = None
    grad_all_reduce_5 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_attn_q_bias, ['data']);  blocks_0_attn_q_bias = None
    linear = torch.ops.aten.linear.default(layer_norm, grad_all_reduce_4, grad_all_reduce_5);  grad_all_reduce_4 = grad_all_reduce_5 = None
    view = torch.ops.aten.view.default(linear, [2, 16, 4, 16]);  linear = None
    transpose = torch.ops.aten.transpose.int(view, 1, 2);  view = None
    grad_all_reduce_6 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_attn_k_weight, ['data']);  blocks_0_attn_k_weight = None
    grad_all_reduce_7 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_attn_k_bias, ['data']);  blocks_0_attn_k_bias = None
    linear_1 = torch.ops.aten.linear.default(layer_norm, grad_all_reduce_6, grad_all_reduce_7);  grad_all_reduce_6 = grad_all_reduce_7 = None
    view_1 = torch.ops.aten.view.default(linear_1, [2, 16, 4, 16]);  linear_1 = None
    transpose_1 = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
    grad_all_reduce_8 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_attn_v_weight, ['data']);  blocks_0_attn_v_weight = None
    grad_all_reduce_9 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_attn_v_bias, ['data']);  blocks_0_attn_v_bias = None
    linear_2 = torch.ops.aten.linear.default(layer_norm, grad_all_reduce_8, grad_all_reduce_9);  layer_norm = grad_all_reduce_8 = grad_all_reduce_9 = None
    view_2 = torch.ops.aten.view.default(linear_2, [2, 16, 4, 16]);  linear_2 = None
    transpose_2 = torch.ops.aten.transpose.int(view_2, 1, 2);  view_2 = None
    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(transpose, transpose_1, transpose_2, None, 0.0, True);  transpose = transpose_1 = transpose_2 = None
    transpose_3 = torch.ops.aten.transpose.int(scaled_dot_product_attention, 1, 2);  scaled_dot_product_attention = None
    reshape = torch.ops.aten.reshape.default(transpose_3, [2, 16, 64]);  transpose_3 = None
    grad_all_reduce_10 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_attn_out_weight, ['data']);  blocks_0_attn_out_weight = None
    grad_all_reduce_11 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_attn_out_bias, ['data']);  blocks_0_attn_out_bias = None
    linear_3 = torch.ops.aten.linear.default(reshape, grad_all_reduce_10, grad_all_reduce_11);  reshape = grad_all_reduce_10 = grad_all_reduce_11 = None
    add_1 = torch.ops.aten.add.Tensor(add, linear_3);  add = linear_3 = None
    grad_all_reduce_12 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_ln2_weight, ['data']);  blocks_0_ln2_weight = None
    grad_all_reduce_13 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_ln2_bias, ['data']);  blocks_0_ln2_bias = None
    layer_norm_1 = torch.ops.aten.layer_norm.default(add_1, [64], grad_all_reduce_12, grad_all_reduce_13, 1e-05, False);  grad_all_reduce_12 = grad_all_reduce_13 = None
    blocks_0_mlp_experts_w1 = getattr(self.blocks, "0").mlp.experts.w1
    blocks_0_mlp_experts_b1 = getattr(self.blocks, "0").mlp.experts.b1
    blocks_0_mlp_experts_w2 = getattr(self.blocks, "0").mlp.experts.w2
    blocks_0_mlp_experts_b2 = getattr(self.blocks, "0").mlp.experts.b2
    blocks_0_mlp_router_weight = getattr(self.blocks, "0").mlp.router.weight
    reshape_default = torch.ops.aten.reshape.default(layer_norm_1, [1, 32, 64]);  layer_norm_1 = None
    grad_all_reduce_14 = torch.ops.autoshard.grad_all_reduce.default(blocks_0_mlp_router_weight, ['data']);  blocks_0_mlp_router_weight = None
    linear_default = torch.ops.aten.linear.default(reshape_default, grad_all_reduce_14);  grad_all_reduce_14 = None
    softmax_int = torch.ops.aten.softmax.int(linear_default, -1)
    route_groups = autoshard_runtime_moe_graph_ops_route_groups(linear_default, 2, 20)
    getitem = route_groups[0]
    getitem_1 = route_groups[1]
    getitem_2 = route_groups[2];  route_groups = None
    gate_groups = autoshard_runtime_moe_graph_ops_gate_groups(softmax_int, getitem)
    dispatch_groups = autoshard_runtime_moe_graph_ops_dispatch_groups(reshape_default, getitem, getitem_1, getitem_2, 4, 20);  reshape_default = None
    reshape_default_1 = torch.ops.aten.reshape.default(dispatch_groups, [4, 20, 64]);  dispatch_groups = None
    unsqueeze_default = torch.ops.aten.unsqueeze.default(blocks_0_mlp_experts_b1, 1);  blocks_0_mlp_experts_b1 = None
    all_to_all = torch.ops.autoshard.all_to_all.default(reshape_default_1, 'data', 0, 1, 2);  reshape_default_1 = None
    baddbmm_default = torch.ops.aten.baddbmm.default(unsqueeze_default, all_to_all, blocks_0_mlp_experts_w1);  unsqueeze_default = all_to_all = blocks_0_mlp_experts_w1 = None
    gelu_1 = torch.ops.aten.gelu.default(baddbmm_default);  baddbmm_default = None
    unsqueeze_default_1 = torch.ops.aten.unsqueeze.default(blocks_0_mlp_experts_b2, 1);  blocks_0_mlp_experts_b2 = None
    baddbmm_default_1 = torch.ops.aten.baddbmm.default(unsqueeze_default_1, gelu_1, blocks_0_mlp_experts_w2);  unsqueeze_default_1 = gelu_1 = blocks_0_mlp_experts_w2 = None
    reshape_default_2 = torch.ops.aten.reshape.default(baddbmm_default_1, [2, 2, 20, 64]);  baddbmm_default_1 = None
    all_to_all_1 = torch.ops.autoshard.all_to_all.default(reshape_default_2, 'data', 1, 0, 2);  reshape_default_2 = None
    combine_groups = autoshard_runtime_moe_graph_ops_combine_groups(all_to_all_1, getitem, getitem_1, gate_groups, getitem_2);  all_to_all_1 = getitem_1 = gate_groups = None
    first_fraction = autoshard_runtime_moe_graph_ops_first_fraction(getitem, 4, 64)
    all_reduce = torch.ops.autoshard.all_reduce.default(first_fraction, 'data');  first_fraction = None
    aux_terms = autoshard_runtime_moe_graph_ops_aux_terms(softmax_int, linear_default, all_reduce, 4, 64);  softmax_int = linear_default = all_reduce = None
    routing_stats = autoshard_runtime_moe_graph_ops_routing_stats(getitem, getitem_2, aux_terms, 4);  getitem = getitem_2 = None
    all_reduce_1 = torch.ops.autoshard.all_reduce.default(routing_stats, 'data');  routing_stats = None
    grad_all_reduce_15 = torch.ops.autoshard.grad_all_reduce.default(all_reduce_1, ['data']);  all_reduce_1 = None
    attach = autoshard_runtime_moe_graph_ops_attach(combine_groups, aux_terms, grad_all_reduce_15, 'moe<key>', 'blocks.0.mlp', 0.01, 0.001, 2);  combine_groups = aux_terms = grad_all_reduce_15 = None
    reshape_default_3 = torch.ops.aten.reshape.default(attach, [2, 16, 64]);  attach = None
    add_2 = torch.ops.aten.add.Tensor(add_1, reshape_default_3);  add_1 = reshape_default_3 = None
    grad_all_reduce_16 = torch.ops.autoshard.grad_all_reduce.default(ln_f_weight, ['data']);  ln_f_weight = None
    grad_all_reduce_17 = torch.ops.autoshard.grad_all_reduce.default(ln_f_bias, ['data']);  ln_f_bias = None
    layer_norm_2 = torch.ops.aten.layer_norm.default(add_2, [64], grad_all_reduce_16, grad_all_reduce_17, 1e-05, False);  add_2 = grad_all_reduce_16 = grad_all_reduce_17 = None
    linear_6 = torch.ops.aten.linear.default(layer_norm_2, grad_all_reduce);  layer_norm_2 = grad_all_reduce = None
    view_3 = torch.ops.aten.view.default(linear_6, [32, 128]);  linear_6 = None
    view_4 = torch.ops.aten.view.default(labels, [32]);  labels = None
    cross_entropy_partial_mean = autoshard_runtime_ops_cross_entropy_partial_mean(view_3, view_4, None, -100, 0.0, ('data',));  view_3 = view_4 = None
    all_reduce_2 = torch.ops.autoshard.all_reduce.default(cross_entropy_partial_mean, 'data');  cross_entropy_partial_mean = None
    return pytree.tree_unflatten((all_reduce_2,), self._out_spec)
