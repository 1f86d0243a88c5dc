"""Mixed precision: fp32 master parameters and optimizer state, compute in a lower dtype (as FSDP2's
``MixedPrecisionPolicy``).

``autoshard.compile(model, mesh, ..., precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=...,
output_dtype=...))`` gives a program whose parameters (``sharded.parameters()``, named as the model's) keep the
model's own dtype — the *masters* the optimizer steps, so its state is in that dtype too — while every op computes
with ``param_dtype`` copies, as eager PyTorch does with ``functional_call(model, {n: p.to(param_dtype)})``:

- **Tracing** (:func:`trace_with_precision`). A graph traced in fp32 hard-codes fp32 (Hugging Face's RMSNorm does
  ``x.to(torch.float32)`` ... ``.to(input_dtype)``, and ``input_dtype`` was traced as float32), so casting the
  parameters of an fp32 graph would not give eager's bf16 program. We trace a *compute copy* of the model instead:
  the same module tree (``copy.deepcopy`` with a memo) whose floating parameters are ``param_dtype`` tensors
  (meta when the model is on meta) and whose buffers are the model's own (FSDP2 casts no buffers), called with the
  floating inputs cast to ``param_dtype`` (FSDP2's ``cast_forward_inputs``). The graph is then exactly eager's
  ``param_dtype`` graph. Its ``get_attr`` nodes are then pointed back at the model's own parameters (the masters),
  and its floating placeholders take the caller's dtype again; the user's model is never modified. The copy costs
  ``param_dtype`` bytes of every parameter while tracing (nothing on meta) and is dropped after.
- **Casts** (``mixed_precision`` pass, :mod:`autoshard.passes.mixed_precision`, right after propagation). A cast
  node ``aten._to_copy(master, dtype=param_dtype)`` goes after every such parameter and floating input, marked
  ``meta[PRECISION_CAST]``, planned in the layout its source was given: it runs on the parameter's shard and any
  all-gather after it moves ``param_dtype`` bytes (the ZeRO pass moves a data-axis storage shard through it: cast
  fused with the gather, as FSDP2 casts at all-gather). Inserting it after propagation, not before, keeps the plans
  what they are without precision: the planners see each op consume the parameter itself (an annotation stays a
  hard constraint on its real consumers; a free parameter takes the layout its first real consumer wants), where a
  cast planned on its own would pick a layout for itself. Floating outputs are cast to ``output_dtype`` when given.
- **Why not FSDP2's hooks**: FSDP2 casts in pre-forward hooks around its all-gather; here the casts are graph nodes,
  so they are priced by the cost model, placed by the same layouts as everything else, and visible in the code.
- **Gradient reduction** (``reduce_precision`` pass, after ``insert_collectives``). Autograd's gradient of a cast is
  the cast back, so a master's gradient arrives in the master's dtype. A data-parallel ``grad_all_reduce`` runs on
  whatever it is placed on — by default the ``param_dtype`` compute copy; with ``reduce_dtype`` different from
  ``param_dtype`` the pass puts it on a ``reduce_dtype`` value: directly on the master when ``reduce_dtype`` is the
  master's dtype (``master -> grad_all_reduce -> cast``: gradients summed in fp32, and the runtime's DDP-like
  bucketer can take them), else between a cast up to ``reduce_dtype`` and the cast down.

Differences from eager PyTorch under this policy are only those of summation order and of rounding the reduced
gradient in ``reduce_dtype`` — the policy's point. ``torch.autocast`` regions of a model (a ``wrap_with_autocast``
region in the trace) are a different thing and need no policy: the ``inline_autocast`` pass
(:mod:`autoshard.passes.mixed_precision`) writes autocast's casts out so the region shards like any other code.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from autoshard.errors import PlanError
from autoshard.frontend.graph_utils import verify_traced

__all__ = ["MixedPrecision", "compute_copy", "fake_like", "trace_with_precision"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: the dtype parameters (and floating inputs) are cast to for compute (the cast runs on the
    parameter's shard, before any gather); ``reduce_dtype``: the dtype data-parallel gradients are reduced in
    (default ``param_dtype``, as FSDP2); ``output_dtype``: the dtype of the model's floating outputs (default: as
    computed). The parameters the optimizer steps (masters) and its state keep the model's own dtype."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            v = getattr(self, name)
            if v is None and name != "param_dtype":
                continue
            if v not in _FLOATS:
                raise PlanError(f"MixedPrecision({name}={v!r}): must be a floating dtype, one of "
                                f"{[str(d) for d in _FLOATS]}.")

    @property
    def grad_reduce_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype


def compute_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model``'s module tree with every floating parameter replaced by a ``dtype`` copy (tied parameters stay
    tied, ``requires_grad`` kept); buffers and everything else shared with ``model``, which is left untouched."""
    memo: dict[int, object] = {}
    for p in model.parameters():
        if id(p) in memo:
            continue
        if p.is_floating_point() and p.dtype != dtype:
            memo[id(p)] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
        else:
            memo[id(p)] = p
    for b in model.buffers():
        memo[id(b)] = b
    return copy.deepcopy(model, memo)


def fake_like(val: torch.Tensor, dtype: torch.dtype, fake_mode=None) -> torch.Tensor:
    """A tensor value for ``node.meta["val"]``: ``val``'s shape, strides and device in ``dtype`` (a FakeTensor of
    ``fake_mode`` when given, else of ``val``'s own fake mode, else a meta tensor)."""
    from torch._subclasses.fake_tensor import FakeTensor

    mode = fake_mode or (val.fake_mode if isinstance(val, FakeTensor) else None)
    grad = val.requires_grad and dtype.is_floating_point  # autoshard reads requires_grad off the values
    if mode is None:
        return torch.empty_strided(val.shape, val.stride(), dtype=dtype, device="meta", requires_grad=grad)
    with mode:
        return torch.empty_strided(val.shape, val.stride(), dtype=dtype, device=val.device, requires_grad=grad)


def trace_with_precision(model: torch.nn.Module, args: tuple, kwargs: dict | None, policy: MixedPrecision,
                         device: torch.device | None = None):
    """Trace ``model`` as it computes under ``policy`` (see the module docstring): the graph of its compute copy,
    whose ``get_attr`` nodes read the model's own parameters and whose floating placeholders have the caller's
    dtypes. The ``mixed_precision`` pass then inserts the casts that make the graph consistent again. ``device``: as
    :func:`~autoshard.frontend.trace.trace`'s (where a model on meta will run)."""
    from torch.fx._pytree import tree_flatten_spec

    from autoshard.frontend.trace import trace
    from autoshard.runtime.torch_state import RANK_THREADS

    dtype = policy.param_dtype
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    kwargs = dict(kwargs or {})
    cast_in = pytree.tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point()
                              else x, (args, kwargs))
    with RANK_THREADS.exclusive():  # the copy reads the model, which rank threads may be tracing
        gm = trace(compute_copy(model, dtype), *cast_in, device=device)
    masters = dict(model.named_parameters(remove_duplicate=False))
    for name, p in list(gm.named_parameters(remove_duplicate=False)):
        master = masters.get(name)
        if master is not None and master.dtype != p.dtype:
            owner, _, leaf = name.rpartition(".")
            gm.get_submodule(owner)._parameters[leaf] = master
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op != "get_attr" or not isinstance(val, torch.Tensor):
            continue
        owner, _, leaf = str(node.target).rpartition(".")
        master = getattr(gm.get_submodule(owner), leaf)
        if isinstance(master, torch.nn.Parameter) and master.dtype != val.dtype:
            # export's own FakeTensor values stay fake; the copied layers' values are the tensors themselves
            node.meta["val"] = master if isinstance(val, torch.nn.Parameter) else fake_like(val, master.dtype)
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    leaves = tree_flatten_spec((args, kwargs), gm._in_spec)
    for holder, x in zip(holders, leaves):
        val = holder.meta.get("val")
        if isinstance(x, torch.Tensor) and isinstance(val, torch.Tensor) and x.dtype != val.dtype:
            holder.meta["val"] = fake_like(val, x.dtype)
    return verify_traced(gm, "precision")
