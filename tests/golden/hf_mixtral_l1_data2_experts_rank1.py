def forward(self, input_ids, labels):
    input_ids, labels, = fx_pytree.tree_flatten_spec(([], {'input_ids':input_ids, 'labels':labels}), self._in_spec)
    model_embed_tokens_weight = self.model.embed_tokens.weight
    rank_device = model_embed_tokens_weight.device
    model_layers_0_self_attn_q_proj_weight = getattr(self.model.layers, "0").self_attn.q_proj.weight
    model_layers_0_self_attn_k_proj_weight = getattr(self.model.layers, "0").self_attn.k_proj.weight
    model_layers_0_self_attn_v_proj_weight = getattr(self.model.layers, "0").self_attn.v_proj.weight
    model_layers_0_self_attn_o_proj_weight = getattr(self.model.layers, "0").self_attn.o_proj.weight
    model_layers_0_mlp_gate_weight = getattr(self.model.layers, "0").mlp.gate.weight
    model_layers_0_mlp_experts_gate_up_proj = getattr(self.model.layers, "0").mlp.experts.gate_up_proj
    model_layers_0_mlp_experts_down_proj = getattr(self.model.layers, "0").mlp.experts.down_proj
    model_layers_0_input_layernorm_weight = getattr(self.model.layers, "0").input_layernorm.weight
    model_layers_0_post_attention_layernorm_weight = getattr(self.model.layers, "0").post_attention_layernorm.weight
    model_norm_weight = self.model.norm.weight
    lm_head_weight = self.lm_head.weight
    model_rotary_emb_inv_freq = self.model.rotary_emb.inv_freq
    grad_all_reduce = torch.ops.autoshard.grad_all_reduce.default(model_embed_tokens_weight, ['data']);  model_embed_tokens_weight = None
    embedding = torch.ops.aten.embedding.default(grad_all_reduce, input_ids, 0);  grad_all_reduce = input_ids = None
    arange = torch.ops.aten.arange.default(8, device = rank_device, pin_memory = False)
    add = torch.ops.aten.add.Tensor(arange, 0);  arange = None
    unsqueeze = torch.ops.aten.unsqueeze.default(add, 0);  add = None
    expand = torch.ops.aten.expand.default(unsqueeze, [4, 8])
    slice_1 = torch.ops.aten.slice.Tensor(expand, 1, 0, 1)
    sub = torch.ops.aten.sub.Tensor(slice_1, 1);  slice_1 = None
    diff = torch.ops.aten.diff.default(expand, 1, -1, sub);  expand = sub = None
    ne = torch.ops.aten.ne.Scalar(diff, 1);  diff = None
    cumsum = torch.ops.aten.cumsum.default(ne, -1);  ne = None
    expand_1 = torch.ops.aten.expand.default(unsqueeze, [4, 8])
    arange_1 = torch.ops.aten.arange.default(4, device = rank_device, pin_memory = False)
    arange_2 = torch.ops.aten.arange.default(8, device = rank_device, pin_memory = False)
    add_1 = torch.ops.aten.add.Tensor(arange_2, 0);  arange_2 = None
    arange_3 = torch.ops.aten.arange.default(8, device = rank_device, pin_memory = False)
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
    expand_2 = torch.ops.aten.expand.default(and_2, [4, 1, 8, 8]);  and_2 = None
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
    add_3 = torch.ops.aten.add.Tensor(mean, 1e-05);  mean = None
    rsqrt = torch.ops.aten.rsqrt.default(add_3);  add_3 = None
    mul_3 = torch.ops.aten.mul.Tensor(to_6, rsqrt);  rsqrt = None
    to_7 = torch.ops.aten.to.dtype(mul_3, torch.float32);  mul_3 = None
    grad_all_reduce_1 = torch.ops.autoshard.grad_all_reduce.default(model_layers_0_input_layernorm_weight, ['data']);  model_layers_0_input_layernorm_weight = None
    mul_4 = torch.ops.aten.mul.Tensor(grad_all_reduce_1, to_7);  grad_all_reduce_1 = to_7 = None
    grad_all_reduce_2 = torch.ops.autoshard.grad_all_reduce.default(model_layers_0_self_attn_q_proj_weight, ['data']);  model_layers_0_self_attn_q_proj_weight = None
    linear = torch.ops.aten.linear.default(mul_4, grad_all_reduce_2);  grad_all_reduce_2 = None
    view = torch.ops.aten.view.default(linear, [2, 8, 4, 8]);  linear = None
    transpose = torch.ops.aten.transpose.int(view, 1, 2);  view = None
    grad_all_reduce_3 = torch.ops.autoshard.grad_all_reduce.default(model_layers_0_self_attn_k_proj_weight, ['data']);  model_layers_0_self_attn_k_proj_weight = None
    linear_1 = torch.ops.aten.linear.default(mul_4, grad_all_reduce_3);  grad_all_reduce_3 = None
    view_1 = torch.ops.aten.view.default(linear_1, [2, 8, 2, 8]);  linear_1 = None
    transpose_1 = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
    grad_all_reduce_4 = torch.ops.autoshard.grad_all_reduce.default(model_layers_0_self_attn_v_proj_weight, ['data']);  model_layers_0_self_attn_v_proj_weight = None
    linear_2 = torch.ops.aten.linear.default(mul_4, grad_all_reduce_4);  mul_4 = grad_all_reduce_4 = None
    view_2 = torch.ops.aten.view.default(linear_2, [2, 8, 2, 8]);  linear_2 = None
    transpose_2 = torch.ops.aten.transpose.int(view_2, 1, 2);  view_2 = None
    unsqueeze_11 = torch.ops.aten.unsqueeze.default(to_4, 1);  to_4 = None
    unsqueeze_12 = torch.ops.aten.unsqueeze.default(to_5, 1);  to_5 = None
    mul_5 = torch.ops.aten.mul.Tensor(transpose, unsqueeze_11)
    slice_2 = torch.ops.aten.slice.Tensor(transpose, 3, 0, 4)
    slice_3 = torch.ops.aten.slice.Tensor(transpose, 3, 4, 9223372036854775807);  transpose = None
    neg = torch.ops.aten.neg.default(slice_3);  slice_3 = None
    cat_1 = torch.ops.aten.cat.default([neg, slice_2], -1);  neg = slice_2 = None
    mul_6 = torch.ops.aten.mul.Tensor(cat_1, unsqueeze_12);  cat_1 = None
    add_4 = torch.ops.aten.add.Tensor(mul_5, mul_6);  mul_5 = mul_6 = None
    mul_7 = torch.ops.aten.mul.Tensor(transpose_1, unsqueeze_11);  unsqueeze_11 = None
    slice_4 = torch.ops.aten.slice.Tensor(transpose_1, 3, 0, 4)
    slice_5 = torch.ops.aten.slice.Tensor(transpose_1, 3, 4, 9223372036854775807);  transpose_1 = None
    neg_1 = torch.ops.aten.neg.default(slice_5);  slice_5 = None
    cat_2 = torch.ops.aten.cat.default([neg_1, slice_4], -1);  neg_1 = slice_4 = None
    mul_8 = torch.ops.aten.mul.Tensor(cat_2, unsqueeze_12);  cat_2 = unsqueeze_12 = None
    add_5 = torch.ops.aten.add.Tensor(mul_7, mul_8);  mul_7 = mul_8 = None
    unsqueeze_13 = torch.ops.aten.unsqueeze.default(add_5, 2);  add_5 = None
    expand_3 = torch.ops.aten.expand.default(unsqueeze_13, [2, 2, 2, 8, 8]);  unsqueeze_13 = None
    reshape = torch.ops.aten.reshape.default(expand_3, [2, 4, 8, 8]);  expand_3 = None
    unsqueeze_14 = torch.ops.aten.unsqueeze.default(transpose_2, 2);  transpose_2 = None
    expand_4 = torch.ops.aten.expand.default(unsqueeze_14, [2, 2, 2, 8, 8]);  unsqueeze_14 = None
    reshape_1 = torch.ops.aten.reshape.default(expand_4, [2, 4, 8, 8]);  expand_4 = None
    local_slice = torch.ops.autoshard.local_slice.default(expand_2, 'data', 0, 2);  expand_2 = None
    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(add_4, reshape, reshape_1, local_slice, scale = 0.3535533905932738);  add_4 = reshape = reshape_1 = local_slice = None
    reshape_2 = torch.ops.aten.reshape.default(scaled_dot_product_attention, [2, 4, 8, 8]);  scaled_dot_product_attention = None
    transpose_3 = torch.ops.aten.transpose.int(reshape_2, 1, 2);  reshape_2 = None
    reshape_3 = torch.ops.aten.reshape.default(transpose_3, [2, 8, 32]);  transpose_3 = None
    grad_all_reduce_5 = torch.ops.autoshard.grad_all_reduce.default(model_layers_0_self_attn_o_proj_weight, ['data']);  model_layers_0_self_attn_o_proj_weight = None
    linear_3 = torch.ops.aten.linear.default(reshape_3, grad_all_reduce_5);  reshape_3 = grad_all_reduce_5 = None
    add_6 = torch.ops.aten.add.Tensor(to_6, linear_3);  to_6 = linear_3 = None
    to_8 = torch.ops.aten.to.dtype(add_6, torch.float32);  add_6 = None
    pow_2 = torch.ops.aten.pow.Tensor_Scalar(to_8, 2)
    mean_1 = torch.ops.aten.mean.dim(pow_2, [-1], True);  pow_2 = None
    add_7 = torch.ops.aten.add.Tensor(mean_1, 1e-05);  mean_1 = None
    rsqrt_1 = torch.ops.aten.rsqrt.default(add_7);  add_7 = None
    mul_9 = torch.ops.aten.mul.Tensor(to_8, rsqrt_1);  rsqrt_1 = None
    to_9 = torch.ops.aten.to.dtype(mul_9, torch.float32);  mul_9 = None
    grad_all_reduce_6 = torch.ops.autoshard.grad_all_reduce.default(model_layers_0_post_attention_layernorm_weight, ['data']);  model_layers_0_post_attention_layernorm_weight = None
    mul_10 = torch.ops.aten.mul.Tensor(grad_all_reduce_6, to_9);  grad_all_reduce_6 = to_9 = None
    view_3 = torch.ops.aten.view.default(mul_10, [16, 32]);  mul_10 = None
    reshape_4 = torch.ops.aten.reshape.default(view_3, [16, 32])
    grad_all_reduce_7 = torch.ops.autoshard.grad_all_reduce.default(model_layers_0_mlp_gate_weight, ['data']);  model_layers_0_mlp_gate_weight = None
    linear_4 = torch.ops.aten.linear.default(reshape_4, grad_all_reduce_7);  reshape_4 = grad_all_reduce_7 = None
    to_10 = torch.ops.aten.to.dtype(linear_4, torch.float32);  linear_4 = None
    softmax = torch.ops.aten.softmax.int(to_10, -1)
    topk = torch.ops.aten.topk.default(softmax, 2);  softmax = None
    getitem = topk[0]
    getitem_1 = topk[1];  topk = None
    sum_1 = torch.ops.aten.sum.dim_IntList(getitem, [-1], True)
    div_tensor = torch.ops.aten.div.Tensor(getitem, sum_1);  getitem = sum_1 = None
    reshape_default = torch.ops.aten.reshape.default(view_3, [1, 16, 32]);  view_3 = None
    reshape_default_1 = torch.ops.aten.reshape.default(getitem_1, [1, 16, 2]);  getitem_1 = None
    reshape_default_2 = torch.ops.aten.reshape.default(div_tensor, [1, 16, 2]);  div_tensor = None
    slot_groups = autoshard_runtime_moe_graph_ops_slot_groups(reshape_default_1, 4, 16)
    getitem_3 = slot_groups[0]
    getitem_4 = slot_groups[1];  slot_groups = None
    dispatch_groups = autoshard_runtime_moe_graph_ops_dispatch_groups(reshape_default, reshape_default_1, getitem_3, getitem_4, 4, 16);  reshape_default = None
    reshape_default_3 = torch.ops.aten.reshape.default(dispatch_groups, [4, 16, 32]);  dispatch_groups = None
    transpose_int = torch.ops.aten.transpose.int(model_layers_0_mlp_experts_gate_up_proj, 1, 2);  model_layers_0_mlp_experts_gate_up_proj = None
    all_to_all = torch.ops.autoshard.all_to_all.default(reshape_default_3, 'data', 0, 1, 2);  reshape_default_3 = None
    bmm_default = torch.ops.aten.bmm.default(all_to_all, transpose_int);  all_to_all = transpose_int = None
    slice_tensor = torch.ops.aten.slice.Tensor(bmm_default, 2, 0, 64)
    slice_tensor_1 = torch.ops.aten.slice.Tensor(bmm_default, 2, 64, 128);  bmm_default = None
    silu_default = torch.ops.aten.silu.default(slice_tensor);  slice_tensor = None
    mul_tensor = torch.ops.aten.mul.Tensor(silu_default, slice_tensor_1);  silu_default = slice_tensor_1 = None
    transpose_int_1 = torch.ops.aten.transpose.int(model_layers_0_mlp_experts_down_proj, 1, 2);  model_layers_0_mlp_experts_down_proj = None
    bmm_default_1 = torch.ops.aten.bmm.default(mul_tensor, transpose_int_1);  mul_tensor = transpose_int_1 = None
    reshape_default_4 = torch.ops.aten.reshape.default(bmm_default_1, [2, 2, 16, 32]);  bmm_default_1 = None
    all_to_all_1 = torch.ops.autoshard.all_to_all.default(reshape_default_4, 'data', 1, 0, 2);  reshape_default_4 = None
    combine_groups = autoshard_runtime_moe_graph_ops_combine_groups(all_to_all_1, reshape_default_1, getitem_3, reshape_default_2, getitem_4);  all_to_all_1 = getitem_3 = reshape_default_2 = None
    zeros_default = torch.ops.aten.zeros.default([2, 2], dtype = torch.float32, device = rank_device)
    local_slice_1 = torch.ops.autoshard.local_slice.default(zeros_default, 'data', 0, 2);  zeros_default = None
    routing_stats = autoshard_runtime_moe_graph_ops_routing_stats(reshape_default_1, getitem_4, local_slice_1, 4);  reshape_default_1 = getitem_4 = None
    all_reduce = torch.ops.autoshard.all_reduce.default(routing_stats, 'data');  routing_stats = None
    attach = autoshard_runtime_moe_graph_ops_attach(combine_groups, local_slice_1, all_reduce, 'moe<key>', 'model.layers.0.mlp', 0.0, 0.0, 2);  combine_groups = local_slice_1 = all_reduce = None
    reshape_default_5 = torch.ops.aten.reshape.default(attach, [16, 32]);  attach = None
    reshape_5 = torch.ops.aten.reshape.default(reshape_default_5, [2, 8, 32]);  reshape_default_5 = None
    add_8 = torch.ops.aten.add.Tensor(to_8, reshape_5);  to_8 = reshape_5 = None
    to_11 = torch.ops.aten.to.dtype(add_8, torch.float32);  add_8 = None
    pow_3 = torch.ops.aten.pow.Tensor_Scalar(to_11, 2)
    mean_2 = torch.ops.aten.mean.dim(pow_3, [-1], True);  pow_3 = None
    add_9 = torch.ops.aten.add.Tensor(mean_2, 1e-05);  mean_2 = None
    rsqrt_2 = torch.ops.aten.rsqrt.default(add_9);  add_9 = None
    mul_11 = torch.ops.aten.mul.Tensor(to_11, rsqrt_2);  to_11 = rsqrt_2 = None
    to_12 = torch.ops.aten.to.dtype(mul_11, torch.float32);  mul_11 = None
    grad_all_reduce_8 = torch.ops.autoshard.grad_all_reduce.default(model_norm_weight, ['data']);  model_norm_weight = None
    mul_12 = torch.ops.aten.mul.Tensor(grad_all_reduce_8, to_12);  grad_all_reduce_8 = to_12 = None
    alias = torch.ops.aten.alias.default(mul_12);  mul_12 = None
    grad_all_reduce_9 = torch.ops.autoshard.grad_all_reduce.default(lm_head_weight, ['data']);  lm_head_weight = None
    linear_5 = torch.ops.aten.linear.default(alias, grad_all_reduce_9);  alias = grad_all_reduce_9 = None
    to_13 = torch.ops.aten.to.dtype(linear_5, torch.float32);  linear_5 = None
    pad = torch.ops.aten.pad.default(labels, [0, 1], 'constant', -100.0);  labels = None
    slice_6 = torch.ops.aten.slice.Tensor(pad, 1, 1, 9223372036854775807);  pad = None
    contiguous = torch.ops.aten.contiguous.default(slice_6);  slice_6 = None
    view_4 = torch.ops.aten.view.default(to_13, [16, 64])
    view_5 = torch.ops.aten.view.default(contiguous, [16]);  contiguous = None
    to_14 = torch.ops.aten.to.dtype_layout(view_5, dtype = torch.int64, layout = torch.strided, device = rank_device);  view_5 = None
    cross_entropy_partial_mean = autoshard_runtime_ops_cross_entropy_partial_mean(view_4, to_14, None, -100, 0.0, ('data',));  view_4 = to_14 = None
    zeros = torch.ops.aten.zeros.default([4], dtype = torch.float32, device = rank_device, pin_memory = False)
    zeros_1 = torch.ops.aten.zeros.default([4], dtype = torch.float32, device = rank_device, pin_memory = False)
    to_15 = torch.ops.aten.to.dtype_layout(to_10, dtype = torch.float32, layout = torch.strided, device = rank_device);  to_10 = None
    softmax_1 = torch.ops.aten.softmax.int(to_15, -1)
    topk_1 = torch.ops.aten.topk.default(softmax_1, 2)
    getitem_2 = topk_1[1];  topk_1 = None
    reshape_6 = torch.ops.aten.reshape.default(getitem_2, [32]);  getitem_2 = None
    to_16 = torch.ops.aten.to.dtype(reshape_6, torch.float32);  reshape_6 = None
    histc = torch.ops.aten.histc.default(to_16, 4, 0, 4);  to_16 = None
    local_slice_2 = torch.ops.autoshard.local_slice.default(zeros, 'data', 0, 2);  zeros = None
    reduce_scatter = torch.ops.autoshard.reduce_scatter.default(histc, 'data', 0, 2);  histc = None
    add_10 = torch.ops.aten.add.Tensor(local_slice_2, reduce_scatter);  local_slice_2 = reduce_scatter = None
    to_17 = torch.ops.aten.to.dtype(softmax_1, torch.float32);  softmax_1 = None
    sum_2 = torch.ops.aten.sum.dim_IntList(to_17, [0]);  to_17 = None
    all_reduce_1 = torch.ops.autoshard.all_reduce.default(sum_2, 'data');  sum_2 = None
    add_11 = torch.ops.aten.add.Tensor(zeros_1, all_reduce_1);  zeros_1 = all_reduce_1 = None
    div_1 = torch.ops.aten.div.Tensor(add_10, 32.0);  add_10 = None
    div_2 = torch.ops.aten.div.Tensor(add_11, 32.0);  add_11 = None
    unsqueeze_15 = torch.ops.aten.unsqueeze.default(div_2, 0);  div_2 = None
    local_slice_3 = torch.ops.autoshard.local_slice.default(unsqueeze_15, 'data', 1, 2);  unsqueeze_15 = None
    mul_13 = torch.ops.aten.mul.Tensor(div_1, local_slice_3);  div_1 = local_slice_3 = None
    sum_3 = torch.ops.aten.sum.default(mul_13);  mul_13 = None
    mul_14 = torch.ops.aten.mul.Tensor(sum_3, 4);  sum_3 = None
    to_18 = torch.ops.aten.to.dtype_layout(mul_14, dtype = torch.float32, layout = torch.strided, device = rank_device);  mul_14 = rank_device = None
    mul_15 = torch.ops.aten.mul.Tensor(to_18, 0.02)
    add_tensor = torch.ops.aten.add.Tensor(cross_entropy_partial_mean, mul_15);  cross_entropy_partial_mean = mul_15 = None
    all_reduce_2 = torch.ops.autoshard.all_reduce.default(add_tensor, 'data');  add_tensor = None
    all_reduce_3 = torch.ops.autoshard.all_reduce.default(to_18, 'data');  to_18 = None
    return pytree.tree_unflatten((all_reduce_2, all_reduce_3, to_13, to_15), self._out_spec)
