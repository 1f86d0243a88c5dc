"""Trace a repeated layer once and copy it: the traced graph of a 96-layer model for the cost of a 1-layer one.

``torch.export`` spends ~1 ms per op, so tracing dominates the compile of deep models. Most deep models are a
``ModuleList`` (or ``Sequential``) of identical layers. While exporting, :func:`reuse_layers` lets the *first*
layer of each such list trace normally, between marker ops that name its inputs and outputs
(``autoshard::layer_input`` / ``autoshard::layer_output``); every later layer whose inputs have the same
structure and metadata becomes one opaque ``autoshard::layer_call`` node with outputs shaped like the first
layer's, and its parameters are hidden from export (which fakifies and lifts every parameter it sees).
:func:`expand_layer_calls` then replaces each call by a copy of the first layer's ops, reading the layer's own
parameters (``layers.0.*`` → ``layers.i.*``, registered on the graph module then) under its own module path.

The copy is used only when it is provably the same function. After export, every copied layer's forward is run
once on meta tensors (no data, no FLOPs) under a dispatch recorder (:func:`_fingerprint`): the sequence of aten ops
with their non-tensor arguments and dataflow (which input, parameter or earlier result each argument is). A layer
whose recording differs from the first layer's — it branches on its index, has a different activation, reads a
different constant — is traced normally (export runs again without it). So are layers that share a parameter
with anything outside themselves; a layer called with inputs unlike the first layer's starts its group anew
(:class:`LayerMismatch`); and every layer of a list whose first layer mutates state or
reads a tensor that is neither an input nor one of its own parameters. Any surprise raises :class:`CannotReuse`
and the caller exports the whole model the ordinary way: this is a speed-up, never a change of meaning. Tests
check that the result is the same graph as a full export (same code, op for op).

:func:`find_groups` is autoshard's one detector of repeated layers. The trace calls it on the model (which layers
to trace once and copy); the plan search (``passes/plan_search/layers.py``, ``find_layers``) calls it on the traced
graph module, whose attribute tree mirrors the model's (``blocks.3.attn.q.weight``; a ``ModuleList`` becomes a
plain module with children ``0``, ``1``, ...), and then only checks, op by op, that the graph of each copy it
ties is the same. One rule for "these are copies of one layer" — the same container, the same submodules and
tensor shapes, no tensor shared with anything outside the layer — so the two stages cannot drift apart; it lives
here because the trace needs it before any graph exists, while the search can always read it off the graph
module.
"""

from __future__ import annotations

import itertools
import logging
import re
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class CannotReuse(Exception):
    """The layers cannot be copied safely: export the whole model instead."""


class LayerMismatch(CannotReuse):
    """Copy ``index`` of ``group`` is called with inputs unlike its first layer's."""

    def __init__(self, group, index: str):
        super().__init__(f"{group.prefix}.{index} is called with other inputs than {group.prefix}.{group.first}")
        self.group, self.index = group, index


# ---- marker ops (present only between export and expand_layer_calls) ------------------------------------------
_TENSOR = object()  # placeholder of a tensor among a layer's flattened non-tensor inputs
_OUTPUTS: dict[str, list[tuple]] = {}  # layer key -> output (shape, stride, dtype, device) of the first layer


@torch.library.custom_op("autoshard::layer_input", mutates_args=())
def layer_input(x: torch.Tensor, slot: int) -> torch.Tensor:
    return x.clone()


@layer_input.register_fake
def _(x, slot):
    return torch.empty_like(x)


@torch.library.custom_op("autoshard::layer_output", mutates_args=())
def layer_output(x: torch.Tensor, slot: int) -> torch.Tensor:
    return x.clone()


@layer_output.register_fake
def _(x, slot):
    return torch.empty_like(x)


@torch.library.custom_op("autoshard::layer_call", mutates_args=())
def layer_call(xs: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    raise RuntimeError("autoshard::layer_call only exists while tracing")


@layer_call.register_fake
def _(xs, key):
    return [torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype, device in
            _OUTPUTS[key]]


def _identity_backward(ctx, grad):
    return grad, None


def _no_backward(ctx, grads):
    raise RuntimeError("autoshard::layer_call only exists while tracing")


layer_input.register_autograd(_identity_backward)
layer_output.register_autograd(_identity_backward)
layer_call.register_autograd(_no_backward)

_INPUT, _OUTPUT, _CALL = (torch.ops.autoshard.layer_input.default, torch.ops.autoshard.layer_output.default,
                          torch.ops.autoshard.layer_call.default)


# ---- finding the layers ---------------------------------------------------------------------------------------
@dataclass
class LayerGroup:
    """Layers ``prefix.<i>`` of one container: the first is traced, ``copies`` become layer_call nodes."""

    prefix: str
    first: str  # index of the traced layer, as a string ("0")
    copies: list[str]
    modules: dict[str, torch.nn.Module]
    in_spec: object = None
    in_consts: list = field(default_factory=list)
    in_meta: list = field(default_factory=list)
    calls: int = 0
    out_spec: object = None
    out_meta: list = field(default_factory=list)
    stubbed: list[str] = field(default_factory=list)  # copies that became layer_call nodes


def find_groups(model: torch.nn.Module, leaves: bool = False) -> list[LayerGroup]:
    """Containers of identical layers: children of one ``ModuleList``/``Sequential`` (or of a plain module whose
    children are all numbered, as in a traced graph module) with the same submodules and tensor shapes, owning
    their tensors. Whether they compute the same is checked by the caller (the trace by fingerprint, see
    :func:`verify`; the plan search on the graph). ``leaves``: also group childless layers (one ``Linear`` each),
    which the trace skips (nothing to gain) but the search ties."""
    owners: dict[int, set[str]] = {}
    for name, t in itertools.chain(model.named_parameters(remove_duplicate=False),
                                   model.named_buffers(remove_duplicate=False)):
        owners.setdefault(id(t), set()).add(name)
    groups, taken = [], []
    for path, container in model.named_modules():
        if not _is_container(container):
            continue
        if any(path == t or path.startswith(t + ".") for t in taken):
            continue
        by_key: dict[tuple, list[str]] = {}
        for idx, child in container.named_children():
            if not leaves and not any(True for _ in child.children()):
                continue  # a leaf (one Linear): nothing to gain
            full = f"{path}.{idx}" if path else idx
            if not _owns_its_tensors(child, full, owners):
                continue
            by_key.setdefault(_structure(child), []).append(idx)
        for members in by_key.values():
            if len(members) >= 2:
                groups.append(LayerGroup(path, members[0], members[1:],
                                         {i: container.get_submodule(i) for i in members}))
                taken.extend(f"{path}.{i}" if path else i for i in members)
    return groups


def _is_container(m: torch.nn.Module) -> bool:
    names = list(m._modules)
    if len(names) < 2:
        return False
    if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
        return True
    # what torch.export's unlifted module (and expand_layer_calls) makes of a ModuleList: a plain module
    return type(m) is torch.nn.Module and all(n.isdigit() for n in names)


def _structure(m: torch.nn.Module) -> tuple:
    # sorted: a traced graph module registers a layer's tensors in the order its graph reads them
    tensors = tuple(sorted((n, tuple(t.shape), str(t.dtype), t.requires_grad, isinstance(t, torch.nn.Parameter))
                           for n, t in itertools.chain(m.named_parameters(remove_duplicate=False),
                                                       m.named_buffers(remove_duplicate=False))))
    return (tuple(sorted((n, type(s).__qualname__, type(s).__module__) for n, s in m.named_modules())), tensors)


def _owns_its_tensors(m: torch.nn.Module, path: str, owners: dict[int, set[str]]) -> bool:
    for _, t in itertools.chain(m.named_parameters(remove_duplicate=False), m.named_buffers(remove_duplicate=False)):
        if any(not (o == path or o.startswith(path + ".")) for o in owners[id(t)]):
            return False
    return True


# ---- during export ----------------------------------------------------------------------------------------------
class reuse_layers:
    """Context manager around ``torch.export``: first layers traced between markers, later ones as layer_call."""

    def __init__(self, model: torch.nn.Module, groups: list[LayerGroup]):
        self.model, self.groups = model, groups
        self.patched: list[torch.nn.Module] = []
        self.hidden: list[tuple[dict, dict]] = []

    def __enter__(self):
        for gi, g in enumerate(self.groups):
            first = g.modules[g.first]
            self._patch(first, self._traced(gi, g, first.forward))
            for i in g.copies:
                self._patch(g.modules[i], self._stub(gi, g, i, g.modules[i].forward))
                # export fakifies and lifts every parameter it sees (~1 ms each): the copies' own are added after
                for sub in g.modules[i].modules():
                    for table in (sub._parameters, sub._buffers):
                        self.hidden.append((table, dict(table)))
                        table.clear()
        return self

    def __exit__(self, *exc):
        for table, saved in self.hidden:
            table.update(saved)
        for m in self.patched:
            del m.forward
        for g in self.groups:
            for i in g.copies:
                _OUTPUTS.pop(_key(g, i), None)
        return False

    def _patch(self, m, fn):
        m.forward = fn
        self.patched.append(m)

    def _traced(self, gi, g: LayerGroup, forward):
        def traced_forward(*args, **kwargs):
            g.calls += 1
            if g.calls > 1:
                raise CannotReuse(f"{g.prefix}.{g.first} is called more than once")
            flat, spec = pytree.tree_flatten((args, kwargs))
            g.in_spec, g.in_consts = spec, [_TENSOR if isinstance(x, torch.Tensor) else x for x in flat]
            g.in_meta = [_tensor_meta(x) for x in flat if isinstance(x, torch.Tensor)]
            slots = itertools.count()
            flat = [layer_input(x, next(slots)) if isinstance(x, torch.Tensor) else x for x in flat]
            args, kwargs = pytree.tree_unflatten(flat, spec)
            out = forward(*args, **kwargs)
            oflat, ospec = pytree.tree_flatten(out)
            if not all(isinstance(x, torch.Tensor) for x in oflat):
                raise CannotReuse(f"{g.prefix}.{g.first} returns a value that is not a tensor")
            g.out_spec = ospec
            g.out_meta = [(tuple(x.shape), tuple(x.stride()), x.dtype, x.device) for x in oflat]
            return pytree.tree_unflatten([layer_output(x, j) for j, x in enumerate(oflat)], ospec)

        return traced_forward

    def _stub(self, gi, g: LayerGroup, i: str, forward):
        def stub_forward(*args, **kwargs):
            flat, spec = pytree.tree_flatten((args, kwargs))
            tensors = [x for x in flat if isinstance(x, torch.Tensor)]
            same = (g.calls == 1 and spec == g.in_spec
                    and [_TENSOR if isinstance(x, torch.Tensor) else x for x in flat] == g.in_consts
                    and [_tensor_meta(x) for x in tensors] == g.in_meta)
            if not same:  # its parameters are hidden: it cannot be traced now; start the group here instead
                raise LayerMismatch(g, i)
            key = _key(g, i)
            _OUTPUTS[key] = g.out_meta
            g.stubbed.append(i)
            return pytree.tree_unflatten(list(layer_call(tensors, key)), g.out_spec)

        return stub_forward


def verify(groups: list[LayerGroup]) -> list[tuple[LayerGroup, str]]:
    """The copied layers that do not compute what their group's first layer computes (by fingerprint)."""
    wrong = []
    for g in groups:
        if not g.stubbed:
            continue
        ref = _fingerprint(g.modules[g.first], g.in_spec, g.in_consts, g.in_meta)
        for i in g.stubbed:
            if ref is None or _fingerprint(g.modules[i], g.in_spec, g.in_consts, g.in_meta) != ref:
                wrong.append((g, i))
    return wrong


def starting_at(groups: list[LayerGroup], group: LayerGroup, index: str) -> list[LayerGroup]:
    """Fresh groups for another export, ``group`` now led by its copy ``index`` (the layers before it are traced
    as usual: typically the first layer, whose input differs from the others')."""
    out = []
    for g in groups:
        first, copies = g.first, list(g.copies)
        if g is group:
            first, copies = index, copies[copies.index(index) + 1:]
        if copies:
            out.append(LayerGroup(g.prefix, first, copies, {i: g.modules[i] for i in [first, *copies]}))
    return out


def without(groups: list[LayerGroup], wrong: list[tuple[LayerGroup, str]]) -> list[LayerGroup]:
    """Fresh groups for another export, leaving out the layers in ``wrong`` (they are then traced as usual)."""
    out = []
    for g in groups:
        copies = [i for i in g.copies if (g, i) not in wrong]
        if copies:
            out.append(LayerGroup(g.prefix, g.first, copies, {i: g.modules[i] for i in [g.first, *copies]}))
    return out


def _key(g: LayerGroup, i: str) -> str:
    return f"{g.prefix}.{i}"


def _tensor_meta(x: torch.Tensor) -> tuple:
    return (tuple(x.shape), tuple(x.stride()), x.dtype, x.device.type, x.requires_grad)


# ---- fingerprint: the dispatched ops of one layer on meta tensors ------------------------------------------------
class _Recorder(TorchDispatchMode):
    def __init__(self, labels: dict[int, str]):
        super().__init__()
        self.labels, self.ops, self.keep = labels, [], []

    def _enc(self, a):
        if isinstance(a, torch.Tensor):
            if id(a) not in self.labels:  # made outside dispatch (torch.tensor(list)): its values are unseen
                raise CannotReuse("a tensor made from Python data")
            return ("T", self.labels[id(a)], tuple(a.shape), tuple(a.stride()), a.dtype)
        if isinstance(a, (list, tuple)):
            return tuple(self._enc(b) for b in a)
        return repr(a)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        k = len(self.ops)
        self.ops.append((str(func), self._enc(args), tuple(sorted((n, self._enc(v)) for n, v in kwargs.items()))))
        for j, t in enumerate(pytree.tree_leaves(out)):
            if isinstance(t, torch.Tensor):
                self.labels[id(t)] = f"op{k}.{j}"
                self.keep.append(t)  # ids stay unique while recording
        return out


def _fingerprint(layer: torch.nn.Module, spec, consts: list, metas: list):
    """The layer's aten ops, arguments and dataflow on meta tensors; None if it cannot run there."""
    it = iter(metas)
    flat = []
    for c in consts:
        if c is _TENSOR:
            shape, stride, dtype, _, rg = next(it)
            flat.append(torch.empty_strided(shape, stride, dtype=dtype, device="meta").requires_grad_(rg))
        else:
            flat.append(c)
    labels = {id(x): f"in{j}" for j, x in enumerate(flat) if isinstance(x, torch.Tensor)}
    state = {}
    for n, t in itertools.chain(layer.named_parameters(remove_duplicate=False),
                                layer.named_buffers(remove_duplicate=False)):
        m = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta").requires_grad_(t.requires_grad)
        state[n] = m
        labels[id(m)] = f"p:{n}"
    args, kwargs = pytree.tree_unflatten(flat, spec)
    recorder = _Recorder(labels)
    try:
        with recorder:
            out = torch.func.functional_call(layer, state, args, kwargs, tie_weights=False, strict=False)
        outs = tuple(recorder._enc(t) for t in pytree.tree_leaves(out))
    except Exception as e:  # an op without a meta kernel, data-dependent code: the copies are traced instead
        logging.getLogger(__name__).info("layer %s cannot run on meta tensors to be fingerprinted (%s: %s): its "
                                         "copies are exported, not copied", type(layer).__name__,
                                         type(e).__name__, e)
        return None
    return tuple(recorder.ops), outs


# ---- after export -----------------------------------------------------------------------------------------------
def expand_layer_calls(gm: torch.fx.GraphModule, groups: list[LayerGroup], model: torch.nn.Module) -> None:
    """Replace every ``layer_call`` by a copy of its group's first layer; drop the markers. The copies' parameters
    (hidden from export) are taken from ``model`` and registered on ``gm`` under their own names."""
    g = gm.graph
    inputs: dict[str, dict[int, torch.fx.Node]] = {}
    outputs: dict[str, dict[int, torch.fx.Node]] = {}
    calls = []
    for n in g.nodes:
        if n.target is _INPUT or n.target is _OUTPUT:
            owner = _owner(n, groups)
            table = inputs if n.target is _INPUT else outputs
            table.setdefault(owner, {})[n.args[1]] = n
        elif n.target is _CALL:
            calls.append(n)
    attrs = {str(n.target): n for n in g.nodes if n.op == "get_attr"}
    anchor = next(n for n in g.nodes if n.op != "placeholder")  # new get_attrs go before it
    by_key = {_key(gr, i): (gr, i) for gr in groups for i in gr.copies}
    regions = {}
    for gr in groups:
        if f"{gr.prefix}.{gr.first}" in inputs:
            regions[_key(gr, gr.first)] = _region(g, gr, inputs[_key(gr, gr.first)],
                                                  outputs.get(_key(gr, gr.first), {}))
    for call in calls:
        gr, i = by_key[call.args[1]]
        region, ins, outs = regions[_key(gr, gr.first)]
        env = {ins[slot]: x for slot, x in enumerate(call.args[0])}
        old, new = f"{gr.prefix}.{gr.first}", f"{gr.prefix}.{i}"
        with g.inserting_before(call):
            for node in region:
                def remap(a):
                    if a in env:
                        return env[a]
                    if a.op == "get_attr":
                        target = str(a.target)
                        if target.startswith(old + "."):
                            target = new + target[len(old):]
                            if target not in attrs:
                                attrs[target] = _get_attr(gm, target, model, anchor)
                            return attrs[target]
                        raise CannotReuse(f"{node.name} reads {target}, which is not the layer's own")
                    raise CannotReuse(f"{node.name} reads {a.name} from outside its layer")

                copy = g.create_node(node.op, node.target, torch.fx.map_arg(node.args, remap),
                                     torch.fx.map_arg(node.kwargs, remap), type_expr=node.type)
                copy.meta = _moved_meta(node.meta, old, new)
                env[node] = copy
        results = [env.get(outs[j].args[0], outs[j].args[0]) for j in range(len(outs))]
        for user in list(call.users):
            if user.target.__name__ != "getitem":
                raise CannotReuse(f"{call.name} is used whole")
            user.replace_all_uses_with(results[user.args[1]])
            g.erase_node(user)
        g.erase_node(call)
    for table in (inputs, outputs):
        for nodes in table.values():
            for marker in nodes.values():
                marker.replace_all_uses_with(marker.args[0])
                g.erase_node(marker)


def _get_attr(gm: torch.fx.GraphModule, target: str, model: torch.nn.Module, before: torch.fx.Node) -> torch.fx.Node:
    """A get_attr node for ``model``'s tensor at ``target``, registered on ``gm`` (parameter or buffer alike)."""
    *path, name = target.split(".")
    owner = model.get_submodule(".".join(path))
    tensor = owner._parameters.get(name)
    is_param = tensor is not None
    if not is_param:
        tensor = owner._buffers.get(name)
    if tensor is None:
        raise CannotReuse(f"{target} is neither a parameter nor a buffer of the model")
    mod = gm
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, torch.nn.Module())
        mod = getattr(mod, part)
    if is_param:
        mod.register_parameter(name, tensor)
    else:
        mod.register_buffer(name, tensor, persistent=name not in owner._non_persistent_buffers_set)
    with gm.graph.inserting_before(before):
        return gm.graph.get_attr(target)


def _owner(marker: torch.fx.Node, groups: list[LayerGroup]) -> str:
    stack = marker.meta.get("nn_module_stack") or {}
    paths = {_clean(p) for p, _ in stack.values()}
    for gr in groups:
        if _key(gr, gr.first) in paths:
            return _key(gr, gr.first)
    raise CannotReuse(f"marker {marker.name} outside every layer")


def _region(g: torch.fx.Graph, gr: LayerGroup, ins: dict, outs: dict):
    """The first layer's ops between its markers, checked to read only its inputs, parameters and constants."""
    first, last = min(ins.values(), key=_order(g)), max(outs.values(), key=_order(g)) if outs else None
    if last is None:
        raise CannotReuse("the first layer has no outputs")
    region, inside, started = [], set(ins.values()), False
    for n in g.nodes:
        if n is first:
            started = True
        if not started or n.op != "call_function":
            if n is last:
                break
            continue
        if n.target in (_INPUT, _OUTPUT):
            if n is last:
                break
            continue
        if n.target is _CALL:
            raise CannotReuse("a copied layer runs inside the first one")
        if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable:
            # writing into a tensor the layer made itself (DeepSeek-V3's keys copied into the slices of a
            # new_empty) is the copy's own business: each copy makes and writes its own
            for a in _written(n):
                root = _view_root(a)
                if root not in inside or root in ins.values():
                    raise CannotReuse(f"{n.name} mutates its input")
        for a in n.all_input_nodes:
            if a not in inside and a.op != "get_attr":
                raise CannotReuse(f"{n.name} reads {a.name} from outside its layer")
        region.append(n)
        inside.add(n)
    for n in region:  # nothing outside the layer reads its intermediate values
        for u in n.users:
            if u not in inside and u.target is not _OUTPUT:
                raise CannotReuse(f"{u.name} reads {n.name} from inside a layer")
    return region, {k: v for k, v in ins.items()}, outs


def _written(n: torch.fx.Node) -> list:
    """The argument nodes a mutable op writes (its schema's write aliases)."""
    out = []
    for i, a in enumerate(n.target._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
            out.append(v)
    return out


def _view_root(a):
    """The node whose memory ``a`` shares, through every op whose result aliases its first argument (views,
    in-place ops returning it, an item of a split); ``a`` itself when it aliases nothing."""
    import operator

    while isinstance(a, torch.fx.Node) and a.args and isinstance(a.args[0], torch.fx.Node) and (
            a.target is operator.getitem or (isinstance(a.target, torch._ops.OpOverload)
                                             and any(r.alias_info is not None for r in a.target._schema.returns))):
        a = a.args[0]
    return a


def _order(g: torch.fx.Graph):
    pos = {n: k for k, n in enumerate(g.nodes)}
    return lambda n: pos[n]


def _moved_meta(meta: dict, old: str, new: str) -> dict:
    out = dict(meta)
    stack = meta.get("nn_module_stack")
    if stack:
        pattern = re.compile(re.escape(old) + r"(?=\.|$)")
        out["nn_module_stack"] = {pattern.sub(new, k, count=1): (pattern.sub(new, p, count=1), t)
                                  for k, (p, t) in stack.items()}
    return out


def _clean(path: str) -> str:
    from autoshard.meta import clean_path

    return clean_path(path)
