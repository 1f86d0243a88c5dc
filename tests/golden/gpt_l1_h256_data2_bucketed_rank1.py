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
    embedding = torch.ops.aten.embedding.default(wte_weight, ids);  ids = None
    embedding_1 = torch.ops.aten.embedding.default(wpe_weight, arange);  wpe_weight = arange = None
    add = torch.ops.aten.add.Tensor(embedding, embedding_1);  embedding = embedding_1 = None
    layer_norm = torch.ops.aten.layer_norm.default(add, [256], blocks_0_ln1_weight, blocks_0_ln1_bias, 1e-05, False);  blocks_0_ln1_weight = blocks_0_ln1_bias = None
    linear = torch.ops.aten.linear.default(layer_norm, blocks_0_attn_q_weight, blocks_0_attn_q_bias);  blocks_0_attn_q_weight = blocks_0_attn_q_bias = None
    view = torch.ops.aten.view.default(linear, [2, 16, 4, 64]);  linear = None
    transpose = torch.ops.aten.transpose.int(view, 1, 2);  view = None
    linear_1 = torch.ops.aten.linear.default(layer_norm, blocks_0_attn_k_weight, blocks_0_attn_k_bias);  blocks_0_attn_k_weight = blocks_0_attn_k_bias = None
    view_1 = torch.ops.aten.view.default(linear_1, [2, 16, 4, 64]);  linear_1 = None
    transpose_1 = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
    linear_2 = torch.ops.aten.linear.default(layer_norm, blocks_0_attn_v_weight, blocks_0_attn_v_bias);  layer_norm = blocks_0_attn_v_weight = blocks_0_attn_v_bias = None
    view_2 = torch.ops.aten.view.default(linear_2, [2, 16, 4, 64]);  linear_2 = None
    transpose_2 = torch.ops.aten.transpose.int(view_2, 1, 2);  view_2 = None
    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(transpose, transpose_1, transpose_2, None, 0.0, True);  transpose = transpose_1 = transpose_2 = None
    transpose_3 = torch.ops.aten.transpose.int(scaled_dot_product_attention, 1, 2);  scaled_dot_product_attention = None
    reshape = torch.ops.aten.reshape.default(transpose_3, [2, 16, 256]);  transpose_3 = None
    linear_3 = torch.ops.aten.linear.default(reshape, blocks_0_attn_out_weight, blocks_0_attn_out_bias);  reshape = blocks_0_attn_out_weight = blocks_0_attn_out_bias = None
    add_1 = torch.ops.aten.add.Tensor(add, linear_3);  add = linear_3 = None
    layer_norm_1 = torch.ops.aten.layer_norm.default(add_1, [256], blocks_0_ln2_weight, blocks_0_ln2_bias, 1e-05, False);  blocks_0_ln2_weight = blocks_0_ln2_bias = None
    linear_4 = torch.ops.aten.linear.default(layer_norm_1, blocks_0_mlp_0_weight, blocks_0_mlp_0_bias);  layer_norm_1 = blocks_0_mlp_0_weight = blocks_0_mlp_0_bias = None
    gelu = torch.ops.aten.gelu.default(linear_4);  linear_4 = None
    linear_5 = torch.ops.aten.linear.default(gelu, blocks_0_mlp_2_weight, blocks_0_mlp_2_bias);  gelu = blocks_0_mlp_2_weight = blocks_0_mlp_2_bias = None
    add_2 = torch.ops.aten.add.Tensor(add_1, linear_5);  add_1 = linear_5 = None
    layer_norm_2 = torch.ops.aten.layer_norm.default(add_2, [256], ln_f_weight, ln_f_bias, 1e-05, False);  add_2 = ln_f_weight = ln_f_bias = None
    linear_6 = torch.ops.aten.linear.default(layer_norm_2, wte_weight);  layer_norm_2 = wte_weight = None
    view_3 = torch.ops.aten.view.default(linear_6, [32, 128]);  linear_6 = None
    view_4 = torch.ops.aten.view.default(labels, [32]);  labels = None
    cross_entropy_partial_mean = autoshard_runtime_ops_cross_entropy_partial_mean(view_3, view_4, None, -100, 0.0, ('data',));  view_3 = view_4 = None
    all_reduce = torch.ops.autoshard.all_reduce.default(cross_entropy_partial_mean, 'data');  cross_entropy_partial_mean = None
    return pytree.tree_unflatten((all_reduce,), self._out_spec)

# gradient all-reduces run outside the program, by GradBucketer (bucket_cap_mb=None), bucket by bucket in this order:
# bucket 0: over ['data'], torch.float32, closes at 1048576 bytes, 262912 elements
#         0 ln_f.bias
#       256 ln_f.weight
#       512 blocks.0.mlp.2.bias
#       768 blocks.0.mlp.2.weight
# bucket 1: over ['data'], torch.float32, closes at 26214400 bytes, 564224 elements
#         0 blocks.0.mlp.0.bias
#      1024 blocks.0.mlp.0.weight
#    263168 blocks.0.ln2.bias
#    263424 blocks.0.ln2.weight
#    263680 blocks.0.attn.out.bias
#    263936 blocks.0.attn.out.weight
#    329472 blocks.0.attn.v.bias
#    329728 blocks.0.attn.v.weight
#    395264 blocks.0.attn.k.bias
#    395520 blocks.0.attn.k.weight
#    461056 blocks.0.attn.q.bias
#    461312 blocks.0.attn.q.weight
#    526848 blocks.0.ln1.bias
#    527104 blocks.0.ln1.weight
#    527360 wpe.weight
#    531456 wte.weight
