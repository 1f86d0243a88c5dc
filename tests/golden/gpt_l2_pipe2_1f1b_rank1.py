def forward(self, add_2, labels):
    blocks_1_ln1_weight = getattr(self.blocks, "1").ln1.weight
    blocks_1_ln1_bias = getattr(self.blocks, "1").ln1.bias
    blocks_1_attn_q_weight = getattr(self.blocks, "1").attn.q.weight
    blocks_1_attn_q_bias = getattr(self.blocks, "1").attn.q.bias
    blocks_1_attn_k_weight = getattr(self.blocks, "1").attn.k.weight
    blocks_1_attn_k_bias = getattr(self.blocks, "1").attn.k.bias
    blocks_1_attn_v_weight = getattr(self.blocks, "1").attn.v.weight
    blocks_1_attn_v_bias = getattr(self.blocks, "1").attn.v.bias
    blocks_1_attn_out_weight = getattr(self.blocks, "1").attn.out.weight
    blocks_1_attn_out_bias = getattr(self.blocks, "1").attn.out.bias
    blocks_1_ln2_weight = getattr(self.blocks, "1").ln2.weight
    blocks_1_ln2_bias = getattr(self.blocks, "1").ln2.bias
    blocks_1_mlp_0_weight = getattr(getattr(self.blocks, "1").mlp, "0").weight
    blocks_1_mlp_0_bias = getattr(getattr(self.blocks, "1").mlp, "0").bias
    blocks_1_mlp_2_weight = getattr(getattr(self.blocks, "1").mlp, "2").weight
    blocks_1_mlp_2_bias = getattr(getattr(self.blocks, "1").mlp, "2").bias
    ln_f_weight = self.ln_f.weight
    ln_f_bias = self.ln_f.bias
    wte_weight = self.wte.weight
    layer_norm_2 = torch.ops.aten.layer_norm.default(add_2, [64], blocks_1_ln1_weight, blocks_1_ln1_bias, 1e-05, False);  blocks_1_ln1_weight = blocks_1_ln1_bias = None
    linear_6 = torch.ops.aten.linear.default(layer_norm_2, blocks_1_attn_q_weight, blocks_1_attn_q_bias);  blocks_1_attn_q_weight = blocks_1_attn_q_bias = None
    view_3 = torch.ops.aten.view.default(linear_6, [2, 16, 4, 16]);  linear_6 = None
    transpose_4 = torch.ops.aten.transpose.int(view_3, 1, 2);  view_3 = None
    linear_7 = torch.ops.aten.linear.default(layer_norm_2, blocks_1_attn_k_weight, blocks_1_attn_k_bias);  blocks_1_attn_k_weight = blocks_1_attn_k_bias = None
    view_4 = torch.ops.aten.view.default(linear_7, [2, 16, 4, 16]);  linear_7 = None
    transpose_5 = torch.ops.aten.transpose.int(view_4, 1, 2);  view_4 = None
    linear_8 = torch.ops.aten.linear.default(layer_norm_2, blocks_1_attn_v_weight, blocks_1_attn_v_bias);  layer_norm_2 = blocks_1_attn_v_weight = blocks_1_attn_v_bias = None
    view_5 = torch.ops.aten.view.default(linear_8, [2, 16, 4, 16]);  linear_8 = None
    transpose_6 = torch.ops.aten.transpose.int(view_5, 1, 2);  view_5 = None
    scaled_dot_product_attention_1 = torch.ops.aten.scaled_dot_product_attention.default(transpose_4, transpose_5, transpose_6, None, 0.0, True);  transpose_4 = transpose_5 = transpose_6 = None
    transpose_7 = torch.ops.aten.transpose.int(scaled_dot_product_attention_1, 1, 2);  scaled_dot_product_attention_1 = None
    reshape_1 = torch.ops.aten.reshape.default(transpose_7, [2, 16, 64]);  transpose_7 = None
    linear_9 = torch.ops.aten.linear.default(reshape_1, blocks_1_attn_out_weight, blocks_1_attn_out_bias);  reshape_1 = blocks_1_attn_out_weight = blocks_1_attn_out_bias = None
    add_3 = torch.ops.aten.add.Tensor(add_2, linear_9);  add_2 = linear_9 = None
    layer_norm_3 = torch.ops.aten.layer_norm.default(add_3, [64], blocks_1_ln2_weight, blocks_1_ln2_bias, 1e-05, False);  blocks_1_ln2_weight = blocks_1_ln2_bias = None
    linear_10 = torch.ops.aten.linear.default(layer_norm_3, blocks_1_mlp_0_weight, blocks_1_mlp_0_bias);  layer_norm_3 = blocks_1_mlp_0_weight = blocks_1_mlp_0_bias = None
    gelu_1 = torch.ops.aten.gelu.default(linear_10);  linear_10 = None
    linear_11 = torch.ops.aten.linear.default(gelu_1, blocks_1_mlp_2_weight, blocks_1_mlp_2_bias);  gelu_1 = blocks_1_mlp_2_weight = blocks_1_mlp_2_bias = None
    add_4 = torch.ops.aten.add.Tensor(add_3, linear_11);  add_3 = linear_11 = None
    layer_norm_4 = torch.ops.aten.layer_norm.default(add_4, [64], ln_f_weight, ln_f_bias, 1e-05, False);  add_4 = ln_f_weight = ln_f_bias = None
    linear_12 = torch.ops.aten.linear.default(layer_norm_4, wte_weight);  layer_norm_4 = wte_weight = None
    view_6 = torch.ops.aten.view.default(linear_12, [32, 128]);  linear_12 = None
    view_7 = torch.ops.aten.view.default(labels, [32]);  labels = None
    cross_entropy_loss = torch.ops.aten.cross_entropy_loss.default(view_6, view_7);  view_6 = view_7 = None
    return (cross_entropy_loss,)
