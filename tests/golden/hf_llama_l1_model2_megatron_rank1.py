def forward(self, input_ids, labels):
    input_ids, labels, = fx_pytree.tree_flatten_spec(([], {'input_ids':input_ids, 'labels':labels}), self._in_spec)
    model_embed_tokens_weight = self.model.embed_tokens.weight
    rank_device = model_embed_tokens_weight.device
    model_layers_0_self_attn_q_proj_weight = getattr(self.model.layers, "0").self_attn.q_proj.weight
    model_layers_0_self_attn_k_proj_weight = getattr(self.model.layers, "0").self_attn.k_proj.weight
    model_layers_0_self_attn_v_proj_weight = getattr(self.model.layers, "0").self_attn.v_proj.weight
    model_layers_0_self_attn_o_proj_weight = getattr(self.model.layers, "0").self_attn.o_proj.weight
    model_layers_0_mlp_gate_proj_weight = getattr(self.model.layers, "0").mlp.gate_proj.weight
    model_layers_0_mlp_up_proj_weight = getattr(self.model.layers, "0").mlp.up_proj.weight
    model_layers_0_mlp_down_proj_weight = getattr(self.model.layers, "0").mlp.down_proj.weight
    model_layers_0_input_layernorm_weight = getattr(self.model.layers, "0").input_layernorm.weight
    model_layers_0_post_attention_layernorm_weight = getattr(self.model.layers, "0").post_attention_layernorm.weight
    model_norm_weight = self.model.norm.weight
    lm_head_weight = self.lm_head.weight
    model_rotary_emb_inv_freq = self.model.rotary_emb.inv_freq
    masked_embedding = autoshard_runtime_ops_masked_embedding(model_embed_tokens_weight, input_ids, 64, 0);  model_embed_tokens_weight = input_ids = None
    arange = torch.ops.aten.arange.default(16, device = rank_device, pin_memory = False)
    add = torch.ops.aten.add.Tensor(arange, 0);  arange = None
    unsqueeze = torch.ops.aten.unsqueeze.default(add, 0);  add = None
    expand = torch.ops.aten.expand.default(unsqueeze, [4, 16])
    slice_1 = torch.ops.aten.slice.Tensor(expand, 1, 0, 1)
    sub = torch.ops.aten.sub.Tensor(slice_1, 1);  slice_1 = None
    diff = torch.ops.aten.diff.default(expand, 1, -1, sub);  expand = sub = None
    ne = torch.ops.aten.ne.Scalar(diff, 1);  diff = None
    cumsum = torch.ops.aten.cumsum.default(ne, -1);  ne = None
    expand_1 = torch.ops.aten.expand.default(unsqueeze, [4, 16])
    arange_1 = torch.ops.aten.arange.default(4, device = rank_device, pin_memory = False)
    arange_2 = torch.ops.aten.arange.default(16, device = rank_device, pin_memory = False)
    add_1 = torch.ops.aten.add.Tensor(arange_2, 0);  arange_2 = None
    arange_3 = torch.ops.aten.arange.default(16, device = rank_device, pin_memory = False)
    add_2 = torch.ops.aten.add.Tensor(arange_3, 0);  arange_3 = None
    unsqueeze_1 = torch.ops.aten.unsqueeze.default(arange_1, 1);  arange_1 = None
    unsqueeze_2 = torch.ops.aten.unsqueeze.default(unsqueeze_1, 2);  unsqueeze_1 = None
    unsqueeze_3 = torch.ops.aten.unsqueeze.default(unsqueeze_2, 3);  unsqueeze_2 = None
    unsqueeze_4 = torch.ops.aten.unsqueeze.default(add_1, 0);  add_1 = None
    unsqueeze_5 = torch.ops.aten.unsqueeze.default(unsqueeze_4, 1);  unsqueeze_4 = None
    unsqueeze_6 = torch.ops.aten.unsqueeze.default(unsqueeze_5, 3);  unsqueeze_5 = None
    unsqueeze_7 = torch.ops.aten.unsqueeze.default(add_2, 0);  add_2 = None
    unsqueeze_8 = torch.ops.aten.unsqueeze.default(unsqueeze_7, 1);  unsqueeze_7 = None
    unsqueeze_9 = torch.ops.aten.unsqueeze.default(unsqueeze_8, 2);  unsqueeze_8 = None
    new_ones = torch.ops.aten.new_ones.default(unsqueeze_6, [], dtype = torch.bool, pin_memory = False)
    index = torch.ops.aten.index.Tensor(expand_1, [unsqueeze_3, unsqueeze_6])
    index_1 = torch.ops.aten.index.Tensor(expand_1, [unsqueeze_3, unsqueeze_9]);  expand_1 = None
    le = torch.ops.aten.le.Tensor(index_1, index);  index_1 = index = None
    to = torch.ops.aten.to.dtype_layout(le, dtype = torch.bool, layout = torch.strided, device = rank_device);  le = None
    and_1 = torch.ops.aten.__and__.Tensor(new_ones, to);  new_ones = to = None
    index_2 = torch.ops.aten.index.Tensor(cumsum, [unsqueeze_3, unsqueeze_6]);  unsqueeze_6 = None
    index_3 = torch.ops.aten.index.Tensor(cumsum, [unsqueeze_3, unsqueeze_9]);  cumsum = unsqueeze_3 = unsqueeze_9 = None
    eq = torch.ops.aten.eq.Tensor(index_2, index_3);  index_2 = index_3 = None
    to_1 = torch.ops.aten.to.dtype_layout(eq, dtype = torch.bool, layout = torch.strided, device = rank_device);  eq = None
    and_2 = torch.ops.aten.__and__.Tensor(and_1, to_1);  and_1 = to_1 = None
    expand_2 = torch.ops.aten.expand.default(and_2, [4, 1, 16, 16]);  and_2 = None
    unsqueeze_10 = torch.ops.aten.unsqueeze.default(unsqueeze, 2);  unsqueeze = None
    to_2 = torch.ops.aten.to.dtype(unsqueeze_10, torch.float32);  unsqueeze_10 = None
    to_3 = torch.ops.aten.to.device(model_rotary_emb_inv_freq, rank_device, torch.float32);  model_rotary_emb_inv_freq = None
    mul = torch.ops.aten.mul.Tensor(to_2, to_3);  to_2 = to_3 = None
    cat = torch.ops.aten.cat.default([mul, mul], -1);  mul = None
    cos = torch.ops.aten.cos.default(cat)
    mul_1 = torch.ops.aten.mul.Tensor(cos, 1.0);  cos = None
    sin = torch.ops.aten.sin.default(cat);  cat = None
    mul_2 = torch.ops.aten.mul.Tensor(sin, 1.0);  sin = None
    to_4 = torch.ops.aten.to.dtype(mul_1, torch.float32);  mul_1 = None
    to_5 = torch.ops.aten.to.dtype(mul_2, torch.float32);  mul_2 = None
    to_6 = torch.ops.aten.to.dtype(masked_embedding, torch.float32);  masked_embedding = None
    all_reduce = torch.ops.autoshard.all_reduce.default(to_6, 'model')
    pow_1 = torch.ops.aten.pow.Tensor_Scalar(all_reduce, 2)
    mean = torch.ops.aten.mean.dim(pow_1, [-1], True);  pow_1 = None
    add_3 = torch.ops.aten.add.Tensor(mean, 1e-06);  mean = None
    rsqrt = torch.ops.aten.rsqrt.default(add_3);  add_3 = None
    mul_3 = torch.ops.aten.mul.Tensor(all_reduce, rsqrt);  all_reduce = rsqrt = None
    to_7 = torch.ops.aten.to.dtype(mul_3, torch.float32);  mul_3 = None
    mul_4 = torch.ops.aten.mul.Tensor(model_layers_0_input_layernorm_weight, to_7);  model_layers_0_input_layernorm_weight = to_7 = None
    linears_grad_all_reduce = torch.ops.autoshard.linears_grad_all_reduce.default(mul_4, ['model'], [model_layers_0_self_attn_q_proj_weight, model_layers_0_self_attn_k_proj_weight, model_layers_0_self_attn_v_proj_weight], [], [False, False, False]);  mul_4 = model_layers_0_self_attn_q_proj_weight = model_layers_0_self_attn_k_proj_weight = model_layers_0_self_attn_v_proj_weight = None
    getitem_1 = linears_grad_all_reduce[0]
    getitem_2 = linears_grad_all_reduce[1]
    getitem_3 = linears_grad_all_reduce[2];  linears_grad_all_reduce = None
    view = torch.ops.aten.view.default(getitem_1, [4, 16, 2, 16]);  getitem_1 = None
    transpose = torch.ops.aten.transpose.int(view, 1, 2);  view = None
    view_1 = torch.ops.aten.view.default(getitem_2, [4, 16, 1, 16]);  getitem_2 = None
    transpose_1 = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
    view_2 = torch.ops.aten.view.default(getitem_3, [4, 16, 1, 16]);  getitem_3 = None
    transpose_2 = torch.ops.aten.transpose.int(view_2, 1, 2);  view_2 = None
    unsqueeze_11 = torch.ops.aten.unsqueeze.default(to_4, 1);  to_4 = None
    unsqueeze_12 = torch.ops.aten.unsqueeze.default(to_5, 1);  to_5 = None
    mul_5 = torch.ops.aten.mul.Tensor(transpose, unsqueeze_11)
    slice_2 = torch.ops.aten.slice.Tensor(transpose, 3, 0, 8)
    slice_3 = torch.ops.aten.slice.Tensor(transpose, 3, 8, 9223372036854775807);  transpose = None
    neg = torch.ops.aten.neg.default(slice_3);  slice_3 = None
    cat_1 = torch.ops.aten.cat.default([neg, slice_2], -1);  neg = slice_2 = None
    mul_6 = torch.ops.aten.mul.Tensor(cat_1, unsqueeze_12);  cat_1 = None
    add_4 = torch.ops.aten.add.Tensor(mul_5, mul_6);  mul_5 = mul_6 = None
    mul_7 = torch.ops.aten.mul.Tensor(transpose_1, unsqueeze_11);  unsqueeze_11 = None
    slice_4 = torch.ops.aten.slice.Tensor(transpose_1, 3, 0, 8)
    slice_5 = torch.ops.aten.slice.Tensor(transpose_1, 3, 8, 9223372036854775807);  transpose_1 = None
    neg_1 = torch.ops.aten.neg.default(slice_5);  slice_5 = None
    cat_2 = torch.ops.aten.cat.default([neg_1, slice_4], -1);  neg_1 = slice_4 = None
    mul_8 = torch.ops.aten.mul.Tensor(cat_2, unsqueeze_12);  cat_2 = unsqueeze_12 = None
    add_5 = torch.ops.aten.add.Tensor(mul_7, mul_8);  mul_7 = mul_8 = None
    unsqueeze_13 = torch.ops.aten.unsqueeze.default(add_5, 2);  add_5 = None
    expand_3 = torch.ops.aten.expand.default(unsqueeze_13, [4, 1, 2, 16, 16]);  unsqueeze_13 = None
    reshape = torch.ops.aten.reshape.default(expand_3, [4, 2, 16, 16]);  expand_3 = None
    unsqueeze_14 = torch.ops.aten.unsqueeze.default(transpose_2, 2);  transpose_2 = None
    expand_4 = torch.ops.aten.expand.default(unsqueeze_14, [4, 1, 2, 16, 16]);  unsqueeze_14 = None
    reshape_1 = torch.ops.aten.reshape.default(expand_4, [4, 2, 16, 16]);  expand_4 = None
    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(add_4, reshape, reshape_1, expand_2, scale = 0.25);  add_4 = reshape = reshape_1 = expand_2 = None
    reshape_2 = torch.ops.aten.reshape.default(scaled_dot_product_attention, [4, 2, 16, 16]);  scaled_dot_product_attention = None
    transpose_3 = torch.ops.aten.transpose.int(reshape_2, 1, 2);  reshape_2 = None
    reshape_3 = torch.ops.aten.reshape.default(transpose_3, [4, 16, 32]);  transpose_3 = None
    linear_3 = torch.ops.aten.linear.default(reshape_3, model_layers_0_self_attn_o_proj_weight);  reshape_3 = model_layers_0_self_attn_o_proj_weight = None
    add_6 = torch.ops.aten.add.Tensor(to_6, linear_3);  to_6 = linear_3 = None
    to_8 = torch.ops.aten.to.dtype(add_6, torch.float32);  add_6 = None
    all_reduce_1 = torch.ops.autoshard.all_reduce.default(to_8, 'model')
    pow_2 = torch.ops.aten.pow.Tensor_Scalar(all_reduce_1, 2)
    mean_1 = torch.ops.aten.mean.dim(pow_2, [-1], True);  pow_2 = None
    add_7 = torch.ops.aten.add.Tensor(mean_1, 1e-06);  mean_1 = None
    rsqrt_1 = torch.ops.aten.rsqrt.default(add_7);  add_7 = None
    mul_9 = torch.ops.aten.mul.Tensor(all_reduce_1, rsqrt_1);  all_reduce_1 = rsqrt_1 = None
    to_9 = torch.ops.aten.to.dtype(mul_9, torch.float32);  mul_9 = None
    mul_10 = torch.ops.aten.mul.Tensor(model_layers_0_post_attention_layernorm_weight, to_9);  model_layers_0_post_attention_layernorm_weight = to_9 = None
    linears_grad_all_reduce_1 = torch.ops.autoshard.linears_grad_all_reduce.default(mul_10, ['model'], [model_layers_0_mlp_gate_proj_weight, model_layers_0_mlp_up_proj_weight], [], [False, False]);  mul_10 = model_layers_0_mlp_gate_proj_weight = model_layers_0_mlp_up_proj_weight = None
    getitem_4 = linears_grad_all_reduce_1[0]
    getitem_5 = linears_grad_all_reduce_1[1];  linears_grad_all_reduce_1 = None
    silu = torch.ops.aten.silu.default(getitem_4);  getitem_4 = None
    mul_11 = torch.ops.aten.mul.Tensor(silu, getitem_5);  silu = getitem_5 = None
    linear_6 = torch.ops.aten.linear.default(mul_11, model_layers_0_mlp_down_proj_weight);  mul_11 = model_layers_0_mlp_down_proj_weight = None
    add_8 = torch.ops.aten.add.Tensor(to_8, linear_6);  to_8 = linear_6 = None
    to_10 = torch.ops.aten.to.dtype(add_8, torch.float32);  add_8 = None
    all_reduce_2 = torch.ops.autoshard.all_reduce.default(to_10, 'model');  to_10 = None
    pow_3 = torch.ops.aten.pow.Tensor_Scalar(all_reduce_2, 2)
    mean_2 = torch.ops.aten.mean.dim(pow_3, [-1], True);  pow_3 = None
    add_9 = torch.ops.aten.add.Tensor(mean_2, 1e-06);  mean_2 = None
    rsqrt_2 = torch.ops.aten.rsqrt.default(add_9);  add_9 = None
    mul_12 = torch.ops.aten.mul.Tensor(all_reduce_2, rsqrt_2);  all_reduce_2 = rsqrt_2 = None
    to_11 = torch.ops.aten.to.dtype(mul_12, torch.float32);  mul_12 = None
    mul_13 = torch.ops.aten.mul.Tensor(model_norm_weight, to_11);  model_norm_weight = to_11 = None
    alias = torch.ops.aten.alias.default(mul_13);  mul_13 = None
    linears_grad_all_reduce_2 = torch.ops.autoshard.linears_grad_all_reduce.default(alias, ['model'], [lm_head_weight], [], [False]);  alias = lm_head_weight = None
    getitem_6 = linears_grad_all_reduce_2[0];  linears_grad_all_reduce_2 = None
    to_12 = torch.ops.aten.to.dtype(getitem_6, torch.float32);  getitem_6 = None
    pad = torch.ops.aten.pad.default(labels, [0, 1], 'constant', -100.0);  labels = None
    slice_6 = torch.ops.aten.slice.Tensor(pad, 1, 1, 9223372036854775807);  pad = None
    contiguous = torch.ops.aten.contiguous.default(slice_6);  slice_6 = None
    view_3 = torch.ops.aten.view.default(to_12, [64, 64])
    view_4 = torch.ops.aten.view.default(contiguous, [64]);  contiguous = None
    to_13 = torch.ops.aten.to.dtype_layout(view_4, dtype = torch.int64, layout = torch.strided, device = rank_device);  view_4 = rank_device = None
    vocab_parallel_cross_entropy = torch.ops.autoshard.vocab_parallel_cross_entropy.default(view_3, to_13, -100, 1, 'model', 2, []);  view_3 = to_13 = None
    getitem = vocab_parallel_cross_entropy[0];  vocab_parallel_cross_entropy = None
    all_reduce_3 = torch.ops.autoshard.all_reduce.default(getitem, 'model');  getitem = None
    all_gather = torch.ops.autoshard.all_gather.default(to_12, 'model', 2, 2);  to_12 = None
    return pytree.tree_unflatten((all_reduce_3, all_gather), self._out_spec)
