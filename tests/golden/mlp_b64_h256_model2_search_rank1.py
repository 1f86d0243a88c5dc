def forward(self, x, target):
    x, target, = fx_pytree.tree_flatten_spec(([x, target], {}), self._in_spec)
    fc1_weight = self.fc1.weight
    fc1_bias = self.fc1.bias
    fc2_weight = self.fc2.weight
    fc2_bias = self.fc2.bias
    linear = torch.ops.aten.linear.default(x, fc1_weight, fc1_bias);  x = fc1_weight = fc1_bias = None
    gelu = torch.ops.aten.gelu.default(linear);  linear = None
    bias_once = autoshard_runtime_ops_bias_once(fc2_bias, False);  fc2_bias = None
    linear_1 = torch.ops.aten.linear.default(gelu, fc2_weight, bias_once);  gelu = fc2_weight = bias_once = None
    all_reduce = torch.ops.autoshard.all_reduce.default(linear_1, 'model');  linear_1 = None
    broadcast_tensors = torch.ops.aten.broadcast_tensors.default([all_reduce, target]);  all_reduce = target = None
    getitem = broadcast_tensors[0]
    getitem_1 = broadcast_tensors[1];  broadcast_tensors = None
    mse_loss = torch.ops.aten.mse_loss.default(getitem, getitem_1);  getitem = getitem_1 = None
    return pytree.tree_unflatten((mse_loss,), self._out_spec)
