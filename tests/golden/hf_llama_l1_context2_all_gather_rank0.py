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
    sequence_slice = autoshard_runtime_context_sequence_slice(input_ids, 'context', 1, 2, True);  input_ids = None
    grad_all_reduce = torch.ops.autoshard.grad_all_reduce.default(model_embed_tokens_weight, ['context']);  model_embed_tokens_weight = None
    embedding = torch.ops.aten.embedding.default(grad_all_reduce, sequence_slice, 0);  grad_all_reduce = sequence_slice = None
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
    to_6 = torch.ops.aten.to.dtype(embedding, torch.float32);  embedding = None
    pow_1 = torch.ops.aten.pow.Tensor_Scalar(to_6, 2)
    mean = torch.ops.aten.mean.dim(pow_1, [-1], True);  pow_1 = None
    add_3 = torch.ops.aten.add.Tensor(mean, 1e-06);  mean = None
    rsqrt = torch.ops.aten.rsqrt.default(add_3);  add_3 = None
    mul_3 = torch.ops.aten.mul.Tensor(to_6, rsqrt);  rsqrt = None
    to_7 = torch.ops.aten.to.dtype(mul_3, torch.float32);  mul_3 = None
    grad_all_reduce_1 = torch.ops.autoshard.grad_all_reduce.default(model_layers_0_input_layernorm_weight, ['context']);  model_layers_0_input_layernorm_weight = None
    mul_4 = torch.ops.aten.mul.Tensor(grad_all_reduce_1, to_7);  grad_all_reduce_1 = to_7 = None
    grad_all_reduce_2 = torch.ops.autoshard.grad_all_reduce.default(model_layers_0_self_attn_q_proj_weight, ['context']);  model_layers_0_self_attn_q_proj_weight = None
    linear = torch.ops.aten.linear.default(mul_4, grad_all_reduce_2);  grad_all_reduce_2 = None
    view = torch.ops.aten.view.default(linear, [4, 8, 4, 16]);  linear = None
    transpose = torch.ops.aten.transpose.int(view, 1, 2);  view = None
    grad_all_reduce_3 = torch.ops.autoshard.grad_all_reduce.default(model_layers_0_self_attn_k_proj_weight, ['context']);  model_layers_0_self_attn_k_proj_weight = None
    linear_1 = torch.ops.aten.linear.default(mul_4, grad_all_reduce_3);  grad_all_reduce_3 = None
    view_1 = torch.ops.aten.view.default(linear_1, [4, 8, 2, 16]);  linear_1 = None
    transpose_1 = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
    grad_all_reduce_4 = torch.ops.autoshard.grad_all_reduce.default(model_layers_0_self_attn_v_proj_weight, ['context']);  model_layers_0_self_attn_v_proj_weight = None
    linear_2 = torch.ops.aten.linear.default(mul_4, grad_all_reduce_4);  mul_4 = grad_all_reduce_4 = None
    view_2 = torch.ops.aten.view.default(linear_2, [4, 8, 2, 16]);  linear_2 = None
    transpose_2 = torch.ops.aten.transpose.int(view_2, 1, 2);  view_2 = None
    unsqueeze_11 = torch.ops.aten.unsqueeze.default(to_4, 1);  to_4 = None
    unsqueeze_12 = torch.ops.aten.unsqueeze.default(to_5, 1);  to_5 = None
    head_tail = autoshard_runtime_context_head_tail(unsqueeze_11, 2, 2, False);  unsqueeze_11 = None
    local_slice = torch.ops.autoshard.local_slice.default(head_tail, 'context', 2, 2);  head_tail = None
    mul_5 = torch.ops.aten.mul.Tensor(transpose, local_slice)
    slice_2 = torch.ops.aten.slice.Tensor(transpose, 3, 0, 8)
    slice_3 = torch.ops.aten.slice.Tensor(transpose, 3, 8, 9223372036854775807);  transpose = None
    neg = torch.ops.aten.neg.default(slice_3);  slice_3 = None
    cat_1 = torch.ops.aten.cat.default([neg, slice_2], -1);  neg = slice_2 = None
    head_tail_1 = autoshard_runtime_context_head_tail(unsqueeze_12, 2, 2, False);  unsqueeze_12 = None
    local_slice_1 = torch.ops.autoshard.local_slice.default(head_tail_1, 'context', 2, 2);  head_tail_1 = None
    mul_6 = torch.ops.aten.mul.Tensor(cat_1, local_slice_1);  cat_1 = None
    add_4 = torch.ops.aten.add.Tensor(mul_5, mul_6);  mul_5 = mul_6 = None
    mul_7 = torch.ops.aten.mul.Tensor(transpose_1, local_slice);  local_slice = None
    slice_4 = torch.ops.aten.slice.Tensor(transpose_1, 3, 0, 8)
    slice_5 = torch.ops.aten.slice.Tensor(transpose_1, 3, 8, 9223372036854775807);  transpose_1 = None
    neg_1 = torch.ops.aten.neg.default(slice_5);  slice_5 = None
    cat_2 = torch.ops.aten.cat.default([neg_1, slice_4], -1);  neg_1 = slice_4 = None
    mul_8 = torch.ops.aten.mul.Tensor(cat_2, local_slice_1);  cat_2 = local_slice_1 = None
    add_5 = torch.ops.aten.add.Tensor(mul_7, mul_8);  mul_7 = mul_8 = None
    unsqueeze_13 = torch.ops.aten.unsqueeze.default(add_5, 2);  add_5 = None
    expand_3 = torch.ops.aten.expand.default(unsqueeze_13, [4, 2, 2, 8, 16]);  unsqueeze_13 = None
    reshape = torch.ops.aten.reshape.default(expand_3, [4, 4, 8, 16]);  expand_3 = None
    unsqueeze_14 = torch.ops.aten.unsqueeze.default(transpose_2, 2);  transpose_2 = None
    expand_4 = torch.ops.aten.expand.default(unsqueeze_14, [4, 2, 2, 8, 16]);  unsqueeze_14 = None
    reshape_1 = torch.ops.aten.reshape.default(expand_4, [4, 4, 8, 16]);  expand_4 = None
    head_tail_2 = autoshard_runtime_context_head_tail(expand_2, 2, 2, False);  expand_2 = None
    local_slice_2 = torch.ops.autoshard.local_slice.default(head_tail_2, 'context', 2, 2);  head_tail_2 = None
    context_attention = autoshard_runtime_context_context_attention(add_4, reshape, reshape_1, local_slice_2, 'context', 2, 'all_gather', False, True, 0.25);  add_4 = reshape = reshape_1 = local_slice_2 = None
    reshape_2 = torch.ops.aten.reshape.default(context_attention, [4, 4, 8, 16]);  context_attention = None
    transpose_3 = torch.ops.aten.transpose.int(reshape_2, 1, 2);  reshape_2 = None
    reshape_3 = torch.ops.aten.reshape.default(transpose_3, [4, 8, 64]);  transpose_3 = None
    grad_all_reduce_5 = torch.ops.autoshard.grad_all_reduce.default(model_layers_0_self_attn_o_proj_weight, ['context']);  model_layers_0_self_attn_o_proj_weight = None
    linear_3 = torch.ops.aten.linear.default(reshape_3, grad_all_reduce_5);  reshape_3 = grad_all_reduce_5 = None
    add_6 = torch.ops.aten.add.Tensor(to_6, linear_3);  to_6 = linear_3 = None
    to_8 = torch.ops.aten.to.dtype(add_6, torch.float32);  add_6 = None
    pow_2 = torch.ops.aten.pow.Tensor_Scalar(to_8, 2)
    mean_1 = torch.ops.aten.mean.dim(pow_2, [-1], True);  pow_2 = None
    add_7 = torch.ops.aten.add.Tensor(mean_1, 1e-06);  mean_1 = None
    rsqrt_1 = torch.ops.aten.rsqrt.default(add_7);  add_7 = None
    mul_9 = torch.ops.aten.mul.Tensor(to_8, rsqrt_1);  rsqrt_1 = None
    to_9 = torch.ops.aten.to.dtype(mul_9, torch.float32);  mul_9 = None
    grad_all_reduce_6 = torch.ops.autoshard.grad_all_reduce.default(model_layers_0_post_attention_layernorm_weight, ['context']);  model_layers_0_post_attention_layernorm_weight = None
    mul_10 = torch.ops.aten.mul.Tensor(grad_all_reduce_6, to_9);  grad_all_reduce_6 = to_9 = None
    grad_all_reduce_7 = torch.ops.autoshard.grad_all_reduce.default(model_layers_0_mlp_gate_proj_weight, ['context']);  model_layers_0_mlp_gate_proj_weight = None
    linear_4 = torch.ops.aten.linear.default(mul_10, grad_all_reduce_7);  grad_all_reduce_7 = None
    silu = torch.ops.aten.silu.default(linear_4);  linear_4 = None
    grad_all_reduce_8 = torch.ops.autoshard.grad_all_reduce.default(model_layers_0_mlp_up_proj_weight, ['context']);  model_layers_0_mlp_up_proj_weight = None
    linear_5 = torch.ops.aten.linear.default(mul_10, grad_all_reduce_8);  mul_10 = grad_all_reduce_8 = None
    mul_11 = torch.ops.aten.mul.Tensor(silu, linear_5);  silu = linear_5 = None
    grad_all_reduce_9 = torch.ops.autoshard.grad_all_reduce.default(model_layers_0_mlp_down_proj_weight, ['context']);  model_layers_0_mlp_down_proj_weight = None
    linear_6 = torch.ops.aten.linear.default(mul_11, grad_all_reduce_9);  mul_11 = grad_all_reduce_9 = None
    add_8 = torch.ops.aten.add.Tensor(to_8, linear_6);  to_8 = linear_6 = None
    to_10 = torch.ops.aten.to.dtype(add_8, torch.float32);  add_8 = None
    pow_3 = torch.ops.aten.pow.Tensor_Scalar(to_10, 2)
    mean_2 = torch.ops.aten.mean.dim(pow_3, [-1], True);  pow_3 = None
    add_9 = torch.ops.aten.add.Tensor(mean_2, 1e-06);  mean_2 = None
    rsqrt_2 = torch.ops.aten.rsqrt.default(add_9);  add_9 = None
    mul_12 = torch.ops.aten.mul.Tensor(to_10, rsqrt_2);  to_10 = rsqrt_2 = None
    to_11 = torch.ops.aten.to.dtype(mul_12, torch.float32);  mul_12 = None
    grad_all_reduce_10 = torch.ops.autoshard.grad_all_reduce.default(model_norm_weight, ['context']);  model_norm_weight = None
    mul_13 = torch.ops.aten.mul.Tensor(grad_all_reduce_10, to_11);  grad_all_reduce_10 = to_11 = None
    alias = torch.ops.aten.alias.default(mul_13);  mul_13 = None
    grad_all_reduce_11 = torch.ops.autoshard.grad_all_reduce.default(lm_head_weight, ['context']);  lm_head_weight = None
    linear_7 = torch.ops.aten.linear.default(alias, grad_all_reduce_11);  alias = grad_all_reduce_11 = None
    to_12 = torch.ops.aten.to.dtype(linear_7, torch.float32);  linear_7 = None
    pad = torch.ops.aten.pad.default(labels, [0, 1], 'constant', -100.0);  labels = None
    slice_6 = torch.ops.aten.slice.Tensor(pad, 1, 1, 9223372036854775807);  pad = None
    contiguous = torch.ops.aten.contiguous.default(slice_6);  slice_6 = None
    all_gather = torch.ops.autoshard.all_gather.default(to_12, 'context', 1, 2);  to_12 = None
    head_tail_3 = autoshard_runtime_context_head_tail(all_gather, 1, 2, True);  all_gather = None
    view_3 = torch.ops.aten.view.default(head_tail_3, [64, 128])
    view_4 = torch.ops.aten.view.default(contiguous, [64]);  contiguous = None
    to_13 = torch.ops.aten.to.dtype_layout(view_4, dtype = torch.int64, layout = torch.strided, device = rank_device);  view_4 = rank_device = None
    cross_entropy_loss = torch.ops.aten.cross_entropy_loss.default(view_3, to_13);  view_3 = to_13 = None
    return pytree.tree_unflatten((cross_entropy_loss, head_tail_3), self._out_spec)
