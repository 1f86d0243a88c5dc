def forward(self, x, target):
    x, target, = fx_pytree.tree_flatten_spec(([x, target], {}), self._in_spec)
    fc1_weight = self.fc1.weight
    _to_copy_default = torch.ops.aten._to_copy.default(fc1_weight, dtype = torch.bfloat16);  fc1_weight = None
    fc1_bias = self.fc1.bias
    _to_copy_default_1 = torch.ops.aten._to_copy.default(fc1_bias, dtype = torch.bfloat16);  fc1_bias = None
    fc2_weight = self.fc2.weight
    _to_copy_default_2 = torch.ops.aten._to_copy.default(fc2_weight, dtype = torch.bfloat16);  fc2_weight = None
    fc2_bias = self.fc2.bias
    _to_copy_default_3 = torch.ops.aten._to_copy.default(fc2_bias, dtype = torch.bfloat16);  fc2_bias = None
    _to_copy_default_5 = torch.ops.aten._to_copy.default(target, dtype = torch.bfloat16);  target = None
    _to_copy_default_4 = torch.ops.aten._to_copy.default(x, dtype = torch.bfloat16);  x = None
    grad_all_reduce = torch.ops.autoshard.grad_all_reduce.default(_to_copy_default, ['data']);  _to_copy_default = None
    grad_all_reduce_1 = torch.ops.autoshard.grad_all_reduce.default(_to_copy_default_1, ['data']);  _to_copy_default_1 = None
    linear = torch.ops.aten.linear.default(_to_copy_default_4, grad_all_reduce, grad_all_reduce_1);  _to_copy_default_4 = grad_all_reduce = grad_all_reduce_1 = None
    gelu = torch.ops.aten.gelu.default(linear);  linear = None
    grad_all_reduce_2 = torch.ops.autoshard.grad_all_reduce.default(_to_copy_default_2, ['data']);  _to_copy_default_2 = None
    grad_all_reduce_3 = torch.ops.autoshard.grad_all_reduce.default(_to_copy_default_3, ['data']);  _to_copy_default_3 = None
    bias_once = autoshard_runtime_ops_bias_once(grad_all_reduce_3, False);  grad_all_reduce_3 = None
    linear_1 = torch.ops.aten.linear.default(gelu, grad_all_reduce_2, bias_once);  gelu = grad_all_reduce_2 = bias_once = None
    all_reduce = torch.ops.autoshard.all_reduce.default(linear_1, 'model');  linear_1 = None
    broadcast_tensors = torch.ops.aten.broadcast_tensors.default([all_reduce, _to_copy_default_5]);  all_reduce = _to_copy_default_5 = None
    getitem = broadcast_tensors[0]
    getitem_1 = broadcast_tensors[1];  broadcast_tensors = None
    mse_loss = torch.ops.aten.mse_loss.default(getitem, getitem_1);  getitem = getitem_1 = None
    mul_tensor = torch.ops.aten.mul.Tensor(mse_loss, 0.5);  mse_loss = None
    all_reduce_1 = torch.ops.autoshard.all_reduce.default(mul_tensor, 'data');  mul_tensor = None
    return pytree.tree_unflatten((all_reduce_1,), self._out_spec)
