def forward(self, input_ids, labels):
    input_ids, labels, = fx_pytree.tree_flatten_spec(([], {'input_ids':input_ids, 'labels':labels}), self._in_spec)
    transformer_wpe_weight = self.transformer.wpe.weight
    rank_device = transformer_wpe_weight.device
    transformer_h_0_ln_1_weight = getattr(self.transformer.h, "0").ln_1.weight
    transformer_h_0_ln_1_bias = getattr(self.transformer.h, "0").ln_1.bias
    transformer_h_0_attn_c_attn_weight = getattr(self.transformer.h, "0").attn.c_attn.weight
    transformer_h_0_attn_c_attn_bias = getattr(self.transformer.h, "0").attn.c_attn.bias
    transformer_h_0_attn_c_proj_weight = getattr(self.transformer.h, "0").attn.c_proj.weight
    transformer_h_0_attn_c_proj_bias = getattr(self.transformer.h, "0").attn.c_proj.bias
    transformer_h_0_ln_2_weight = getattr(self.transformer.h, "0").ln_2.weight
    transformer_h_0_ln_2_bias = getattr(self.transformer.h, "0").ln_2.bias
    transformer_h_0_mlp_c_fc_weight = getattr(self.transformer.h, "0").mlp.c_fc.weight
    transformer_h_0_mlp_c_fc_bias = getattr(self.transformer.h, "0").mlp.c_fc.bias
    transformer_h_0_mlp_c_proj_weight = getattr(self.transformer.h, "0").mlp.c_proj.weight
    transformer_h_0_mlp_c_proj_bias = getattr(self.transformer.h, "0").mlp.c_proj.bias
    transformer_ln_f_weight = self.transformer.ln_f.weight
    transformer_ln_f_bias = self.transformer.ln_f.bias
    transformer_wte_weight = self.transformer.wte.weight
    view = torch.ops.aten.view.default(input_ids, [4, 16]);  input_ids = None
    masked_embedding = autoshard_runtime_ops_masked_embedding(transformer_wte_weight, view, 0, -1);  view = None
    arange = torch.ops.aten.arange.default(16, device = rank_device, pin_memory = False)
    add = torch.ops.aten.add.Tensor(arange, 0);  arange = None
    unsqueeze = torch.ops.aten.unsqueeze.default(add, 0);  add = None
    masked_embedding_1 = autoshard_runtime_ops_masked_embedding(transformer_wpe_weight, unsqueeze, 0, -1);  transformer_wpe_weight = None
    to = torch.ops.aten.to.dtype_layout(masked_embedding_1, dtype = torch.float32, layout = torch.strided, device = rank_device);  masked_embedding_1 = None
    add_1 = torch.ops.aten.add.Tensor(masked_embedding, to);  masked_embedding = to = None
    expand = torch.ops.aten.expand.default(unsqueeze, [4, 16])
    slice_1 = torch.ops.aten.slice.Tensor(expand, 1, 0, 1)
    sub = torch.ops.aten.sub.Tensor(slice_1, 1);  slice_1 = None
    diff = torch.ops.aten.diff.default(expand, 1, -1, sub);  expand = sub = None
    ne = torch.ops.aten.ne.Scalar(diff, 1);  diff = None
    cumsum = torch.ops.aten.cumsum.default(ne, -1);  ne = None
    expand_1 = torch.ops.aten.expand.default(unsqueeze, [4, 16]);  unsqueeze = None
    arange_1 = torch.ops.aten.arange.default(4, device = rank_device, pin_memory = False)
    arange_2 = torch.ops.aten.arange.default(16, device = rank_device, pin_memory = False)
    add_2 = torch.ops.aten.add.Tensor(arange_2, 0);  arange_2 = None
    arange_3 = torch.ops.aten.arange.default(16, device = rank_device, pin_memory = False)
    add_3 = torch.ops.aten.add.Tensor(arange_3, 0);  arange_3 = None
    unsqueeze_1 = torch.ops.aten.unsqueeze.default(arange_1, 1);  arange_1 = None
    unsqueeze_2 = torch.ops.aten.unsqueeze.default(unsqueeze_1, 2);  unsqueeze_1 = None
    unsqueeze_3 = torch.ops.aten.unsqueeze.default(unsqueeze_2, 3);  unsqueeze_2 = None
    unsqueeze_4 = torch.ops.aten.unsqueeze.default(add_2, 0);  add_2 = None
    unsqueeze_5 = torch.ops.aten.unsqueeze.default(unsqueeze_4, 1);  unsqueeze_4 = None
    unsqueeze_6 = torch.ops.aten.unsqueeze.default(unsqueeze_5, 3);  unsqueeze_5 = None
    unsqueeze_7 = torch.ops.aten.unsqueeze.default(add_3, 0);  add_3 = None
    unsqueeze_8 = torch.ops.aten.unsqueeze.default(unsqueeze_7, 1);  unsqueeze_7 = None
    unsqueeze_9 = torch.ops.aten.unsqueeze.default(unsqueeze_8, 2);  unsqueeze_8 = None
    new_ones = torch.ops.aten.new_ones.default(unsqueeze_6, [], dtype = torch.bool, pin_memory = False)
    index = torch.ops.aten.index.Tensor(expand_1, [unsqueeze_3, unsqueeze_6])
    index_1 = torch.ops.aten.index.Tensor(expand_1, [unsqueeze_3, unsqueeze_9]);  expand_1 = None
    le = torch.ops.aten.le.Tensor(index_1, index);  index_1 = index = None
    to_1 = torch.ops.aten.to.dtype_layout(le, dtype = torch.bool, layout = torch.strided, device = rank_device);  le = None
    and_1 = torch.ops.aten.__and__.Tensor(new_ones, to_1);  new_ones = to_1 = None
    index_2 = torch.ops.aten.index.Tensor(cumsum, [unsqueeze_3, unsqueeze_6]);  unsqueeze_6 = None
    index_3 = torch.ops.aten.index.Tensor(cumsum, [unsqueeze_3, unsqueeze_9]);  cumsum = unsqueeze_3 = unsqueeze_9 = None
    eq = torch.ops.aten.eq.Tensor(index_2, index_3);  index_2 = index_3 = None
    to_2 = torch.ops.aten.to.dtype_layout(eq, dtype = torch.bool, layout = torch.strided, device = rank_device);  eq = None
    and_2 = torch.ops.aten.__and__.Tensor(and_1, to_2);  and_1 = to_2 = None
    expand_2 = torch.ops.aten.expand.default(and_2, [4, 1, 16, 16]);  and_2 = None
    all_reduce = torch.ops.autoshard.all_reduce.default(add_1, 'model');  add_1 = None
    dropout = torch.ops.aten.dropout.default(all_reduce, 0.0, True);  all_reduce = None
    layer_norm = torch.ops.aten.layer_norm.default(dropout, [64], transformer_h_0_ln_1_weight, transformer_h_0_ln_1_bias, 1e-05, False);  transformer_h_0_ln_1_weight = transformer_h_0_ln_1_bias = None
    view_1 = torch.ops.aten.view.default(layer_norm, [64, 64]);  layer_norm = None
    grad_all_reduce = torch.ops.autoshard.grad_all_reduce.default(view_1, ['model']);  view_1 = None
    addmm = torch.ops.aten.addmm.default(transformer_h_0_attn_c_attn_bias, grad_all_reduce, transformer_h_0_attn_c_attn_weight);  transformer_h_0_attn_c_attn_bias = grad_all_reduce = transformer_h_0_attn_c_attn_weight = None
    view_2 = torch.ops.aten.view.default(addmm, [4, 16, 96]);  addmm = None
    all_gather = torch.ops.autoshard.all_gather.default(view_2, 'model', 2, 2);  view_2 = None
    split = torch.ops.aten.split.Tensor(all_gather, 64, 2);  all_gather = None
    getitem = split[0]
    getitem_1 = split[1]
    getitem_2 = split[2];  split = None
    view_3 = torch.ops.aten.view.default(getitem_1, [4, 16, 4, 16]);  getitem_1 = None
    transpose = torch.ops.aten.transpose.int(view_3, 1, 2);  view_3 = None
    view_4 = torch.ops.aten.view.default(getitem_2, [4, 16, 4, 16]);  getitem_2 = None
    transpose_1 = torch.ops.aten.transpose.int(view_4, 1, 2);  view_4 = None
    view_5 = torch.ops.aten.view.default(getitem, [4, 16, 4, 16]);  getitem = None
    transpose_2 = torch.ops.aten.transpose.int(view_5, 1, 2);  view_5 = None
    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(transpose_2, transpose, transpose_1, expand_2, scale = 0.25);  transpose_2 = transpose = transpose_1 = expand_2 = None
    reshape = torch.ops.aten.reshape.default(scaled_dot_product_attention, [4, 4, 16, 16]);  scaled_dot_product_attention = None
    transpose_3 = torch.ops.aten.transpose.int(reshape, 1, 2);  reshape = None
    reshape_1 = torch.ops.aten.reshape.default(transpose_3, [4, 16, 64]);  transpose_3 = None
    view_6 = torch.ops.aten.view.default(reshape_1, [64, 64]);  reshape_1 = None
    local_slice = torch.ops.autoshard.local_slice.default(view_6, 'model', 1, 2);  view_6 = None
    bias_once = autoshard_runtime_ops_bias_once(transformer_h_0_attn_c_proj_bias, True);  transformer_h_0_attn_c_proj_bias = None
    addmm_1 = torch.ops.aten.addmm.default(bias_once, local_slice, transformer_h_0_attn_c_proj_weight);  bias_once = local_slice = transformer_h_0_attn_c_proj_weight = None
    view_7 = torch.ops.aten.view.default(addmm_1, [4, 16, 64]);  addmm_1 = None
    all_reduce_1 = torch.ops.autoshard.all_reduce.default(view_7, 'model');  view_7 = None
    dropout_1 = torch.ops.aten.dropout.default(all_reduce_1, 0.0, True);  all_reduce_1 = None
    add_4 = torch.ops.aten.add.Tensor(dropout_1, dropout);  dropout_1 = dropout = None
    layer_norm_1 = torch.ops.aten.layer_norm.default(add_4, [64], transformer_h_0_ln_2_weight, transformer_h_0_ln_2_bias, 1e-05, False);  transformer_h_0_ln_2_weight = transformer_h_0_ln_2_bias = None
    view_8 = torch.ops.aten.view.default(layer_norm_1, [64, 64]);  layer_norm_1 = None
    grad_all_reduce_1 = torch.ops.autoshard.grad_all_reduce.default(view_8, ['model']);  view_8 = None
    addmm_2 = torch.ops.aten.addmm.default(transformer_h_0_mlp_c_fc_bias, grad_all_reduce_1, transformer_h_0_mlp_c_fc_weight);  transformer_h_0_mlp_c_fc_bias = grad_all_reduce_1 = transformer_h_0_mlp_c_fc_weight = None
    view_9 = torch.ops.aten.view.default(addmm_2, [4, 16, 128]);  addmm_2 = None
    mul = torch.ops.aten.mul.Tensor(view_9, 0.5)
    pow_1 = torch.ops.aten.pow.Tensor_Scalar(view_9, 3.0)
    mul_1 = torch.ops.aten.mul.Tensor(pow_1, 0.044715);  pow_1 = None
    add_5 = torch.ops.aten.add.Tensor(view_9, mul_1);  view_9 = mul_1 = None
    mul_2 = torch.ops.aten.mul.Tensor(add_5, 0.7978845608028654);  add_5 = None
    tanh = torch.ops.aten.tanh.default(mul_2);  mul_2 = None
    add_6 = torch.ops.aten.add.Tensor(tanh, 1.0);  tanh = None
    mul_3 = torch.ops.aten.mul.Tensor(mul, add_6);  mul = add_6 = None
    view_10 = torch.ops.aten.view.default(mul_3, [64, 128]);  mul_3 = None
    bias_once_1 = autoshard_runtime_ops_bias_once(transformer_h_0_mlp_c_proj_bias, True);  transformer_h_0_mlp_c_proj_bias = None
    addmm_3 = torch.ops.aten.addmm.default(bias_once_1, view_10, transformer_h_0_mlp_c_proj_weight);  bias_once_1 = view_10 = transformer_h_0_mlp_c_proj_weight = None
    view_11 = torch.ops.aten.view.default(addmm_3, [4, 16, 64]);  addmm_3 = None
    all_reduce_2 = torch.ops.autoshard.all_reduce.default(view_11, 'model');  view_11 = None
    dropout_2 = torch.ops.aten.dropout.default(all_reduce_2, 0.0, True);  all_reduce_2 = None
    add_7 = torch.ops.aten.add.Tensor(add_4, dropout_2);  add_4 = dropout_2 = None
    layer_norm_2 = torch.ops.aten.layer_norm.default(add_7, [64], transformer_ln_f_weight, transformer_ln_f_bias, 1e-05, False);  add_7 = transformer_ln_f_weight = transformer_ln_f_bias = None
    view_12 = torch.ops.aten.view.default(layer_norm_2, [4, 16, 64]);  layer_norm_2 = None
    alias = torch.ops.aten.alias.default(view_12);  view_12 = None
    linears_grad_all_reduce = torch.ops.autoshard.linears_grad_all_reduce.default(alias, ['model'], [transformer_wte_weight], [], [False]);  alias = transformer_wte_weight = None
    getitem_4 = linears_grad_all_reduce[0];  linears_grad_all_reduce = None
    to_3 = torch.ops.aten.to.dtype(getitem_4, torch.float32);  getitem_4 = None
    pad = torch.ops.aten.pad.default(labels, [0, 1], 'constant', -100.0);  labels = None
    slice_2 = torch.ops.aten.slice.Tensor(pad, 1, 1, 9223372036854775807);  pad = None
    contiguous = torch.ops.aten.contiguous.default(slice_2);  slice_2 = None
    view_13 = torch.ops.aten.view.default(to_3, [64, 64])
    view_14 = torch.ops.aten.view.default(contiguous, [64]);  contiguous = None
    to_4 = torch.ops.aten.to.dtype_layout(view_14, dtype = torch.int64, layout = torch.strided, device = rank_device);  view_14 = rank_device = None
    vocab_parallel_cross_entropy = torch.ops.autoshard.vocab_parallel_cross_entropy.default(view_13, to_4, -100, 1, 'model', 2, []);  view_13 = to_4 = None
    getitem_3 = vocab_parallel_cross_entropy[0];  vocab_parallel_cross_entropy = None
    all_reduce_3 = torch.ops.autoshard.all_reduce.default(getitem_3, 'model');  getitem_3 = None
    all_gather_1 = torch.ops.autoshard.all_gather.default(to_3, 'model', 2, 2);  to_3 = None
    return pytree.tree_unflatten((all_reduce_3, all_gather_1), self._out_spec)
