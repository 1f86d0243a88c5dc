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
    all_gather_reshard_group = torch.ops.autoshard.all_gather_reshard_group.default([wte_weight, ln_f_weight, ln_f_bias], 'data', [0, 0, 0], 2, ['data'], [blocks_0_ln1_weight, blocks_0_ln1_bias, blocks_0_attn_q_weight, blocks_0_attn_q_bias, blocks_0_attn_k_weight, blocks_0_attn_k_bias, blocks_0_attn_v_weight, blocks_0_attn_v_bias, blocks_0_attn_out_weight, blocks_0_attn_out_bias, blocks_0_ln2_weight, blocks_0_ln2_bias, blocks_0_mlp_0_weight, blocks_0_mlp_0_bias, blocks_0_mlp_2_weight, blocks_0_mlp_2_bias]);  wte_weight = ln_f_weight = ln_f_bias = None
    getitem = all_gather_reshard_group[0]
    getitem_1 = all_gather_reshard_group[1]
    getitem_2 = all_gather_reshard_group[2];  all_gather_reshard_group = None
    embedding = torch.ops.aten.embedding.default(getitem, ids);  ids = None
    all_gather_reshard_19 = torch.ops.autoshard.all_gather_reshard.default(wpe_weight, 'data', 0, 2, []);  wpe_weight = None
    embedding_1 = torch.ops.aten.embedding.default(all_gather_reshard_19, arange);  all_gather_reshard_19 = arange = None
    grad_all_reduce_1 = torch.ops.autoshard.grad_all_reduce.default(embedding_1, ['data']);  embedding_1 = None
    add = torch.ops.aten.add.Tensor(embedding, grad_all_reduce_1);  embedding = grad_all_reduce_1 = None
    all_gather_reshard_group_1 = torch.ops.autoshard.all_gather_reshard_group.default([blocks_0_ln1_weight, blocks_0_ln1_bias, blocks_0_attn_q_weight, blocks_0_attn_q_bias, blocks_0_attn_k_weight, blocks_0_attn_k_bias, blocks_0_attn_v_weight, blocks_0_attn_v_bias, blocks_0_attn_out_weight, blocks_0_attn_out_bias, blocks_0_ln2_weight, blocks_0_ln2_bias, blocks_0_mlp_0_weight, blocks_0_mlp_0_bias, blocks_0_mlp_2_weight, blocks_0_mlp_2_bias], 'data', [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], 2, ['data'], []);  blocks_0_ln1_weight = blocks_0_ln1_bias = blocks_0_attn_q_weight = blocks_0_attn_q_bias = blocks_0_attn_k_weight = blocks_0_attn_k_bias = blocks_0_attn_v_weight = blocks_0_attn_v_bias = blocks_0_attn_out_weight = blocks_0_attn_out_bias = blocks_0_ln2_weight = blocks_0_ln2_bias = blocks_0_mlp_0_weight = blocks_0_mlp_0_bias = blocks_0_mlp_2_weight = blocks_0_mlp_2_bias = None
    getitem_3 = all_gather_reshard_group_1[0]
    getitem_4 = all_gather_reshard_group_1[1]
    getitem_5 = all_gather_reshard_group_1[2]
    getitem_6 = all_gather_reshard_group_1[3]
    getitem_7 = all_gather_reshard_group_1[4]
    getitem_8 = all_gather_reshard_group_1[5]
    getitem_9 = all_gather_reshard_group_1[6]
    getitem_10 = all_gather_reshard_group_1[7]
    getitem_11 = all_gather_reshard_group_1[8]
    getitem_12 = all_gather_reshard_group_1[9]
    getitem_13 = all_gather_reshard_group_1[10]
    getitem_14 = all_gather_reshard_group_1[11]
    getitem_15 = all_gather_reshard_group_1[12]
    getitem_16 = all_gather_reshard_group_1[13]
    getitem_17 = all_gather_reshard_group_1[14]
    getitem_18 = all_gather_reshard_group_1[15];  all_gather_reshard_group_1 = None
    layer_norm = torch.ops.aten.layer_norm.default(add, [64], getitem_3, getitem_4, 1e-05, False);  getitem_3 = getitem_4 = None
    linear = torch.ops.aten.linear.default(layer_norm, getitem_5, getitem_6);  getitem_5 = getitem_6 = None
    view = torch.ops.aten.view.default(linear, [2, 16, 4, 16]);  linear = None
    transpose = torch.ops.aten.transpose.int(view, 1, 2);  view = None
    linear_1 = torch.ops.aten.linear.default(layer_norm, getitem_7, getitem_8);  getitem_7 = getitem_8 = None
    view_1 = torch.ops.aten.view.default(linear_1, [2, 16, 4, 16]);  linear_1 = None
    transpose_1 = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
    linear_2 = torch.ops.aten.linear.default(layer_norm, getitem_9, getitem_10);  layer_norm = getitem_9 = getitem_10 = None
    view_2 = torch.ops.aten.view.default(linear_2, [2, 16, 4, 16]);  linear_2 = None
    transpose_2 = torch.ops.aten.transpose.int(view_2, 1, 2);  view_2 = None
    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(transpose, transpose_1, transpose_2, None, 0.0, True);  transpose = transpose_1 = transpose_2 = None
    transpose_3 = torch.ops.aten.transpose.int(scaled_dot_product_attention, 1, 2);  scaled_dot_product_attention = None
    reshape = torch.ops.aten.reshape.default(transpose_3, [2, 16, 64]);  transpose_3 = None
    linear_3 = torch.ops.aten.linear.default(reshape, getitem_11, getitem_12);  reshape = getitem_11 = getitem_12 = None
    add_1 = torch.ops.aten.add.Tensor(add, linear_3);  add = linear_3 = None
    layer_norm_1 = torch.ops.aten.layer_norm.default(add_1, [64], getitem_13, getitem_14, 1e-05, False);  getitem_13 = getitem_14 = None
    linear_4 = torch.ops.aten.linear.default(layer_norm_1, getitem_15, getitem_16);  layer_norm_1 = getitem_15 = getitem_16 = None
    gelu = torch.ops.aten.gelu.default(linear_4);  linear_4 = None
    linear_5 = torch.ops.aten.linear.default(gelu, getitem_17, getitem_18);  gelu = getitem_17 = getitem_18 = None
    add_2 = torch.ops.aten.add.Tensor(add_1, linear_5);  add_1 = linear_5 = None
    layer_norm_2 = torch.ops.aten.layer_norm.default(add_2, [64], getitem_1, getitem_2, 1e-05, False);  add_2 = getitem_1 = getitem_2 = None
    linear_6 = torch.ops.aten.linear.default(layer_norm_2, getitem);  layer_norm_2 = getitem = None
    view_3 = torch.ops.aten.view.default(linear_6, [32, 128]);  linear_6 = None
    view_4 = torch.ops.aten.view.default(labels, [32]);  labels = None
    cross_entropy_partial_mean = autoshard_runtime_ops_cross_entropy_partial_mean(view_3, view_4, None, -100, 0.0, ('data',));  view_3 = view_4 = None
    all_reduce = torch.ops.autoshard.all_reduce.default(cross_entropy_partial_mean, 'data');  cross_entropy_partial_mean = None
    return pytree.tree_unflatten((all_reduce,), self._out_spec)
