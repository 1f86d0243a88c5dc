"""Mixed precision passes: compute in ``param_dtype`` from masters kept in the model's dtype, reduce gradients in
``reduce_dtype``, and make the model's own ``torch.autocast`` regions plain, shardable code.

The policy and why the graph is traced from a ``param_dtype`` compute copy are in :mod:`autoshard.frontend.precision`.
Three plan-phase passes:

- :class:`InlineAutocast` (``inline_autocast``, first; a no-op on graphs without autocast). ``torch.export`` keeps
  a ``with torch.autocast(...)`` block as a ``higher_order.wrap_with_autocast`` call of a sub-graph whose ops are
  the ones *before* autocast's casts: no sharding rule could see inside it, so it ran replicated. The pass inlines
  the sub-graph and writes autocast's casts out as ``aten._to_copy`` nodes in front of each op. Which casts
  autocast applies to an op is asked of autocast itself, not of a table of ours: the op is traced once with
  ``make_fx`` on FakeTensors of its inputs' dtypes, under the region's ``torch.autocast`` state, and each input
  whose traced path goes through a ``_to_copy`` gets that cast (:func:`autocast_input_dtypes`, cached per op and
  dtypes). The values are then eager autocast's to the bit, and every op keeps its own sharding rule. Casts of
  parameters are left to :class:`AutocastParamCasts` (``autocast_param_casts``, after propagation), so the planners
  place the parameters for the op that uses them, as without autocast. Regions
  nested in the block (``enabled=False`` inside) follow their own state. A region whose ``device_type`` is not the
  traced tensors' device type does nothing, as in eager PyTorch (autocast("cuda") leaves CPU tensors alone).
- :class:`MixedPrecisionCasts` (``mixed_precision``, right after ``propagate``): a cast
  ``_to_copy(x, dtype=param_dtype)`` after every floating parameter (``get_attr`` of an ``nn.Parameter``) and floating
  input whose dtype is not ``param_dtype``, marked ``meta[PRECISION_CAST]``, and a cast to ``output_dtype`` of every
  floating output. Each cast runs in the layout its source lies in (same spec in and out), so it runs on the parameter's
  shard and any gather or redistribution comes after it, in ``param_dtype``; the ZeRO pass (next) moves a data-axis
  storage shard through it. It runs after propagation, not before, so that the planners see the parameter itself as the
  consumer's input: an annotated parameter stays a hard constraint for its real consumers, and a free one takes
  the layout its first real consumer wants (a cast planned on its own would choose a layout for itself).
- :class:`ReducePrecision` (``reduce_precision``, after ``insert_collectives``; nothing to do when ``reduce_dtype``
  is ``param_dtype``): each ``grad_all_reduce`` that syncs a parameter's gradient (its input a marked cast, possibly
  through other collectives) is made to run in ``reduce_dtype``: ``master -> grad_all_reduce -> cast`` when the
  cast reads the master directly and ``reduce_dtype`` is the master's dtype (the sum in fp32, the bucketer can take
  it), else ``cast(reduce_dtype) -> grad_all_reduce -> cast(back)``. Forward values are unchanged (the all-reduce is
  the identity forward and the up-cast is exact).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch.utils import _pytree as pytree

from autoshard import meta as M
from autoshard.compiler.collective_kinds import is_kind
from autoshard.compiler.context import Context
from autoshard.errors import PlanError
from autoshard.frontend.precision import fake_like

__all__ = ["AutocastParamCasts", "InlineAutocast", "MixedPrecisionCasts", "ReducePrecision",
           "autocast_input_dtypes", "casts"]

aten = torch.ops.aten
_CAST = aten._to_copy.default
_AUTOCAST = getattr(torch.ops.higher_order, "wrap_with_autocast", None)


def _fake_mode(gm: torch.fx.GraphModule):
    from torch._guards import detect_fake_mode

    return detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if isinstance(n.meta.get("val"),
                                                                                       torch.Tensor)])


def _cast_node(graph: torch.fx.Graph, x: torch.fx.Node, dtype: torch.dtype, like: torch.fx.Node | None,
               fake_mode, mark: bool) -> torch.fx.Node:
    node = graph.call_function(_CAST, (x,), {"dtype": dtype})
    node.meta["val"] = fake_like(x.meta["val"], dtype, fake_mode)
    src = like if like is not None else x
    for key in ("nn_module_stack", "stack_trace"):
        if key in src.meta:
            node.meta[key] = src.meta[key]
    if mark:
        node.meta[M.PRECISION_CAST] = True
    return node


# ---- mixed_precision ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MixedPrecisionCasts:
    param_dtype: torch.dtype
    output_dtype: torch.dtype | None = None
    name: str = "mixed_precision"
    phase: str = "plan"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        graph = gm.graph
        mode = _fake_mode(gm)
        count = {"parameters": 0, "inputs": 0, "outputs": 0}
        for node in list(graph.nodes):
            if not casts(gm, node, self.param_dtype):
                continue
            kind = "inputs" if node.op == "placeholder" else "parameters"
            users = list(node.users)
            anchor = node if node.op == "get_attr" else _last_placeholder(graph)
            with graph.inserting_after(anchor):
                cast = _cast_node(graph, node, self.param_dtype, users[0], mode, mark=True)
            _same_layout(cast, node)
            node.replace_all_uses_with(cast, delete_user_cb=lambda u, c=cast: u is not c)
            count[kind] += 1
        if self.output_dtype is not None:
            out = next(n for n in reversed(graph.nodes) if n.op == "output")
            cache: dict[torch.fx.Node, torch.fx.Node] = {}

            def to_output_dtype(x):
                v = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
                if not (isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != self.output_dtype):
                    return x
                if x not in cache:
                    with graph.inserting_before(out):
                        cache[x] = _cast_node(graph, x, self.output_dtype, x, mode, mark=False)
                    _same_layout(cache[x], x)
                    count["outputs"] += 1
                return cache[x]

            out.args = pytree.tree_map_only(torch.fx.Node, to_output_dtype, out.args)
        graph.lint()
        gm.recompile()
        M.plan_report(gm)[self.name] = count
        return gm


def casts(gm: torch.fx.GraphModule, node: torch.fx.Node, param_dtype: torch.dtype, read: bool | None = None) -> bool:
    """Whether :class:`MixedPrecisionCasts` casts ``node`` to ``param_dtype``: a floating parameter (``get_attr`` of
    an ``nn.Parameter``) or input in another dtype that something reads, unless marked ``M.KEEP_DTYPE``. ``read``:
    whether something reads it (default: it has users; the expert rewrite asks about the parameters it adds before
    it builds their readers). (The plan search prices these values as their ``param_dtype`` copies and the casts
    themselves: :mod:`autoshard.passes.plan_search.precision`.)"""
    val = node.meta.get("val")
    read = bool(node.users) if read is None else read
    if not isinstance(val, torch.Tensor) or not val.is_floating_point() or val.dtype == param_dtype or not read:
        return False
    if node.meta.get(M.KEEP_DTYPE):
        return False
    return node.op == "placeholder" or (node.op == "get_attr" and isinstance(_attr(gm, node.target),
                                                                             torch.nn.Parameter))


def _same_layout(cast: torch.fx.Node, src: torch.fx.Node, note: str = "mixed precision: a cast in place") -> None:
    """Plan ``cast`` (inserted after propagation) to run where ``src`` lies: same spec in and out, no sync."""
    spec = src.meta[M.SPEC]
    cast.meta[M.SPEC] = spec
    cast.meta[M.REQUIRES_GRAD] = bool(src.meta.get(M.REQUIRES_GRAD))
    cast.meta[M.STRATEGY] = M.Strategy((spec,), spec, ((),), note=note)
    cast.meta[M.DECISION] = M.Decision(0.0, reason=note)


def _attr(gm: torch.fx.GraphModule, target: str):
    owner, _, leaf = str(target).rpartition(".")
    return getattr(gm.get_submodule(owner), leaf, None)


def _last_placeholder(graph: torch.fx.Graph) -> torch.fx.Node:
    return [n for n in graph.nodes if n.op == "placeholder"][-1]


# ---- reduce_precision ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReducePrecision:
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    name: str = "reduce_precision"
    phase: str = "plan"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        if self.reduce_dtype == self.param_dtype:
            return gm  # the syncs already run on the param_dtype compute copies
        graph = gm.graph
        mode = _fake_mode(gm)
        count = {"on_master": 0, "cast_around": 0}
        for node in list(graph.nodes):
            if not is_kind(node, "grad_all_reduce"):
                continue
            x = node.args[0]
            cast = _param_cast_behind(x)
            if cast is None or x.meta["val"].dtype == self.reduce_dtype:
                continue
            master = cast.args[0]
            if x is cast and len(cast.users) == 1 and master.meta["val"].dtype == self.reduce_dtype:
                # master -> grad_all_reduce -> cast: the cast's backward hands the sum in the master's dtype
                node.args = (master, *node.args[1:])
                self._retype(node, self.reduce_dtype, mode)
                with graph.inserting_after(node):
                    down = _cast_node(graph, node, cast.meta["val"].dtype, cast, mode, mark=True)
                _same_layout(down, node)
                node.replace_all_uses_with(down, delete_user_cb=lambda u, d=down: u is not d)
                graph.erase_node(cast)
                count["on_master"] += 1
                continue
            compute_dtype = x.meta["val"].dtype
            with graph.inserting_before(node):
                up = _cast_node(graph, x, self.reduce_dtype, x, mode, mark=False)
            _same_layout(up, x)
            node.args = (up, *node.args[1:])
            self._retype(node, self.reduce_dtype, mode)
            with graph.inserting_after(node):
                down = _cast_node(graph, node, compute_dtype, x, mode, mark=False)
            _same_layout(down, node)
            node.replace_all_uses_with(down, delete_user_cb=lambda u, d=down: u is not d)
            count["cast_around"] += 1
        graph.lint()
        gm.recompile()
        M.plan_report(gm)[self.name] = count
        self._warn_reduce_scatters(gm, ctx)
        return gm

    def _warn_reduce_scatters(self, gm: torch.fx.GraphModule, ctx: Context) -> None:
        """ZeRO-2/3 parameters get their data-axis gradient from the backward of the gather that follows their cast
        (a reduce-scatter of the compute copy's gradient): that runs in ``param_dtype``, not ``reduce_dtype``."""
        names = [n.meta.get(M.PARAM, str(n.target)) for n in gm.graph.nodes
                 if n.op == "get_attr" and getattr(n.meta.get(M.STORAGE), "stage", 0) >= 2
                 and any(u.meta.get(M.PRECISION_CAST) for u in n.users)]
        if names:
            ctx.warn(f"MixedPrecision(reduce_dtype={self.reduce_dtype}) is not honoured for {len(names)} parameter(s) "
                     f"stored with ZeRO stage 2/3 (e.g. `{names[0]}`): their gradients are reduce-scattered in "
                     f"{self.param_dtype} by the backward of the gather after their cast. Use zero=1 (gradients "
                     f"all-reduced in {self.reduce_dtype}) or reduce_dtype=None to reduce in {self.param_dtype}.")

    @staticmethod
    def _retype(sync: torch.fx.Node, dtype: torch.dtype, mode) -> None:
        import dataclasses

        old = sync.meta["val"]
        sync.meta["val"] = fake_like(old, dtype, mode)
        info = sync.meta.get(M.COLLECTIVE)
        if info is not None:
            scale = dtype.itemsize / old.dtype.itemsize
            sync.meta[M.COLLECTIVE] = dataclasses.replace(info, bytes_backward=int(info.bytes_backward * scale))


def _param_cast_behind(x) -> torch.fx.Node | None:
    """The marked cast of a parameter that ``x`` is, or reaches back to through collectives only."""
    while isinstance(x, torch.fx.Node):
        if x.meta.get(M.PRECISION_CAST):
            src = x.args[0]
            return x if isinstance(src, torch.fx.Node) and src.op == "get_attr" else None
        if M.COLLECTIVE not in x.meta:
            return None
        x = x.args[0]
    return None


# ---- inline_autocast ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InlineAutocast:
    name: str = "inline_autocast"
    phase: str = "plan"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        if _AUTOCAST is None or not any(n.target is _AUTOCAST for n in gm.graph.nodes):
            return gm
        mode = _fake_mode(gm)
        regions = 0
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is _AUTOCAST:
                _inline(gm, node, mode)
                regions += 1
        gm.graph.eliminate_dead_code()
        for name, sub in list(gm.named_children()):
            if isinstance(sub, torch.fx.GraphModule) and not any(
                    n.op == "get_attr" and n.target == name for n in gm.graph.nodes):
                delattr(gm, name)
        gm.graph.lint()
        gm.recompile()
        M.plan_report(gm)[self.name] = {"regions": regions}
        return gm


def _inline(gm: torch.fx.GraphModule, hop: torch.fx.Node, mode) -> None:
    """Replace the ``wrap_with_autocast`` call ``hop`` (indexed by ``getitem`` users) by its region's ops."""
    with gm.graph.inserting_before(hop):
        outs = _emit_region(gm, hop, hop.args, mode)
    for user in list(hop.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outs[user.args[1]])
            gm.graph.erase_node(user)
    if hop.users:
        raise PlanError(f"autocast region `{hop.name}` is used other than by indexing its outputs: this "
                        "torch.export output is not understood; run the region without torch.autocast.")
    gm.graph.erase_node(hop)


def _emit_region(gm: torch.fx.GraphModule, hop: torch.fx.Node, hop_args: tuple, mode) -> list:
    """Emit the ops of autocast region ``hop_args`` = ``(device_type, dtype, enabled, cache, sub-graph,
    *operands)`` at the graph's insertion point, with autocast's casts; returns its outputs."""
    device_type, dtype, enabled, _cache, sub, *operands = hop_args
    if isinstance(sub, torch.fx.Node):
        sub = getattr(gm, sub.target)
    state = (device_type, dtype, bool(enabled))
    graph = gm.graph
    holders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(holders) != len(operands):
        raise PlanError(f"autocast region `{hop.name}` has {len(operands)} operands, but its sub-graph reads "
                        f"{len(holders)}: this torch.export output is not understood; run the region without "
                        "torch.autocast or report it.")
    env: dict[torch.fx.Node, object] = dict(zip(holders, operands))
    for n in sub.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            result = pytree.tree_map_only(torch.fx.Node, env.__getitem__, n.args[0])
            return list(result) if isinstance(result, (tuple, list)) else [result]
        if n.op == "get_attr":  # a nested region's sub-graph
            env[n] = getattr(sub, n.target)
            continue
        if n.target is aten._assert_tensor_metadata.default and not n.users:
            continue  # dtype asserts without effect on values, dropped from the main graph by trace as well
        args = pytree.tree_map_only(torch.fx.Node, env.__getitem__, n.args)
        kwargs = pytree.tree_map_only(torch.fx.Node, env.__getitem__, n.kwargs)
        if n.target is _AUTOCAST:
            env[n] = _emit_region(gm, hop, args, mode)  # a nested region: its own autocast state
            continue
        if n.target is operator.getitem and isinstance(args[0], list):
            env[n] = args[0][args[1]]
            continue
        deferred = ()
        if state[2] and isinstance(n.target, torch._ops.OpOverload):
            args, kwargs, deferred = _autocast_casts(gm, n, args, kwargs, state, mode)
        new = graph.create_node(n.op, n.target, args, kwargs, name=n.name)
        new.meta.update(n.meta)
        if deferred:
            new.meta[M.AUTOCAST_CASTS] = deferred
        if "nn_module_stack" not in new.meta and "nn_module_stack" in hop.meta:
            new.meta["nn_module_stack"] = hop.meta["nn_module_stack"]
        env[n] = new
    raise PlanError(f"autocast region `{hop.name}` has no output node.")


def _autocast_casts(gm, n: torch.fx.Node, args, kwargs, state, mode):
    """``args``/``kwargs`` of op node ``n`` with the casts autocast applies to them in region ``state``, and the
    casts of parameters left for :class:`AutocastParamCasts` as ``((flat index, dtype), ...)``."""
    graph = gm.graph
    flat, spec = pytree.tree_flatten((args, kwargs))
    tensors = tuple(i for i, a in enumerate(flat) if isinstance(a, torch.fx.Node)
                    and isinstance(a.meta.get("val"), torch.Tensor))
    if not tensors:
        return args, kwargs, ()
    vals = [flat[i].meta["val"] for i in tensors]
    if vals[0].device.type != state[0]:
        return args, kwargs, ()  # autocast of another device type leaves these tensors alone, as in eager
    others = [None if isinstance(a, torch.fx.Node) else a for a in flat]
    dtypes = autocast_input_dtypes(n.target, tuple((tuple(v.shape), v.dtype) for v in vals), state, others, spec,
                                   tensors)
    deferred = []
    for i, v, want in zip(tensors, vals, dtypes):
        if want is None or want == v.dtype:
            continue
        if flat[i].op == "get_attr" and isinstance(_attr(gm, flat[i].target), torch.nn.Parameter):
            deferred.append((i, want))  # cast after propagation, where the parameter lies
        else:
            flat[i] = _cast_node(graph, flat[i], want, n, mode, mark=False)
    args, kwargs = pytree.tree_unflatten(flat, spec)
    return args, kwargs, tuple(deferred)


@dataclass(frozen=True)
class AutocastParamCasts:
    """Autocast's casts of parameters (``meta[AUTOCAST_CASTS]`` of the ops ``inline_autocast`` wrote out), inserted
    after propagation in the layout the parameter was given — so the planners, which place a free parameter where
    its first consumer wants it and hold an annotated one to its annotation, see the op consume the parameter
    itself, exactly as without autocast. One cast per (value, dtype), shared by the ops that read it."""

    name: str = "autocast_param_casts"
    phase: str = "plan"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        todo = [n for n in gm.graph.nodes if n.meta.get(M.AUTOCAST_CASTS)]
        if not todo:
            return gm
        mode = _fake_mode(gm)
        made: dict[tuple, torch.fx.Node] = {}
        for node in todo:
            flat, spec = pytree.tree_flatten((node.args, node.kwargs))
            for i, dtype in node.meta.pop(M.AUTOCAST_CASTS):
                x = flat[i]
                if x.meta["val"].dtype == dtype:
                    continue
                if (x, dtype) not in made:
                    with gm.graph.inserting_after(x):
                        made[x, dtype] = _cast_node(gm.graph, x, dtype, node, mode, mark=False)
                    _same_layout(made[x, dtype], x, note="autocast: a cast in place")
                flat[i] = made[x, dtype]
            args, kwargs = pytree.tree_unflatten(flat, spec)
            node.args, node.kwargs = tuple(args), dict(kwargs)
        gm.graph.lint()
        gm.recompile()
        M.plan_report(gm)[self.name] = {"casts": len(made)}
        return gm


_PROBED: dict[tuple, tuple] = {}


def autocast_input_dtypes(op, inputs: tuple, state: tuple, others: list | None = None, spec=None,
                          tensors: tuple | None = None) -> tuple:
    """The dtype autocast ``state`` = ``(device_type, dtype, enabled)`` casts each tensor input of ``op`` to (None
    where it is left alone), asked of autocast itself: ``op`` traced by ``make_fx`` on FakeTensors under
    ``torch.autocast``. ``inputs``: ``(shape, dtype)`` of each tensor input; ``others``/``spec``/``tensors``: the
    op's flat arguments (None at tensors), their pytree spec and the tensors' positions (default: ``op(*tensors)``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    if others is None:
        tensors = tuple(range(len(inputs)))
        others = [None] * len(inputs)
        spec = pytree.tree_flatten((tuple(others), {}))[1]
    key = (op, inputs, state, repr(others), repr(spec), tensors)
    if key in _PROBED:
        return _PROBED[key]
    device_type, dtype, _ = state
    with FakeTensorMode():
        fakes = [torch.empty(shape, dtype=dt, device=device_type) for shape, dt in inputs]

    def call(*ts):
        flat = list(others)
        for i, t in zip(tensors, ts):
            flat[i] = t
        a, k = pytree.tree_unflatten(flat, spec)
        with torch.autocast(device_type, dtype=dtype, enabled=True):
            return op(*a, **k)

    g = make_fx(call, tracing_mode="fake")(*fakes)
    casts = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)
    out = []
    for h in (n for n in g.graph.nodes if n.op == "placeholder"):
        want = None
        for u in h.users:
            if u.op == "call_function" and u.target in casts:
                want = u.kwargs.get("dtype", u.args[1] if len(u.args) > 1 else None)
                break
        out.append(want)
    _PROBED[key] = tuple(out)
    return _PROBED[key]
