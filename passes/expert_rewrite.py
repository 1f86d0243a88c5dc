"""Expert rewrite: chosen dense FFNs become capacity-bounded Mixture-of-Experts layers (GShard/Switch semantics).

Runs first, on the traced graph, when ``autoshard.compile(..., moe=autoshard.MoE(...))`` is given. For each module
path that :meth:`autoshard.compiler.moe.MoE.select` picks, :func:`match_ffn` checks that the nodes under that path form
a dense FFN — one input ``x``; one or two projections of ``x`` (two: gated, e.g. Llama's SwiGLU); only pointwise
ops between them and the output projection (any activation written with them: GELU, tanh-GELU formulas, SiLU·up);
one projection producing the only value used outside. Projections are ``aten.linear`` or, for GPT-2's Conv1D,
``aten.addmm`` between flattening views; views and p=0 dropout are looked through. :func:`emit_moe` replaces it
by::

    xg     = reshape(x, [G, T_g, h])                      # routing groups: group g = data rank g's tokens
    logits = linear(xg.float(), router)                    # [G, T_g, E], float32 router
    probs  = softmax(logits, -1)
    ei, pos, keep = route_groups(logits, k, C)             # top-k, GShard positions, capacity C per group
    gate   = gate_groups(probs, ei)                        # top-1: raw prob; top-2: renormalised
    buf    = dispatch_groups(xg, ei, pos, keep, E, C)      # [E, G, C, h] scatter; experts sharded: all-to-all
    up_i   = baddbmm(b_i, buf.view(E, G*C, h), w_i)        # every in-projection, batched over experts
    hid    = <the dense FFN's pointwise ops, copied>       # activation (and gate * up)
    y      = baddbmm(b2, hid, w2).view(E, G, C, h)          # back to the token layout: all-to-all
    out    = combine_groups(y, ei, pos, gate, keep)        # [G, T_g, h] gather, gate-weighted, drops give 0
    f      = first_fraction(ei, E, T)                      # global fraction of first choices (Partial sum)
    terms  = aux_terms(probs, logits, f, E, T)             # [G, 2]: each group's share of lb and z
    stats  = routing_stats(ei, keep, terms, E)             # recorded per forward (autoshard.moe_stats)
    out    = attach(out, terms, stats, key, path, α, β, k)  # aux-loss gradients ride on the activation
    result = reshape(out, x.shape)

``G`` (routing groups) defaults to the size of ``expert_axis``, so under data parallelism each rank routes its
own tokens with ``C = ceil(k·T_g/E·capacity_factor)`` (static) and the single-device graph routes the same groups.
Expert parameters ``<path>.experts.{w1,b1,w3,b3,w2,b2}`` (stored ``[E, in, out]``; ``w3`` is the second
in-projection of a gated FFN, in graph order) and ``<path>.router.weight`` ``[E, h]`` are new ``get_attr`` nodes;
the expert ones are annotated ``Shard(0)`` on ``expert_axis`` through ``gm.meta[autoshard.meta.IMPLIED_ANNOTATIONS]``
(propagation seeds them before the user's annotations, which may override them, e.g. to split ``w1``
column-parallel over ``model`` too). Propagation then needs the buffer
sharded on experts where the tokens were sharded on groups: one all-to-all before the experts and one after
(their backwards are the inverse all-to-alls): four per layer per step.

The rewrite builds new nodes in place with FakeTensor ``val``s from the graph's own fake mode and the FFN's
``nn_module_stack``; it erases the dense FFN and its weight ``get_attr`` nodes. It reads the user's options and
never changes them: its result is a :class:`~autoshard.compiler.moe.MoERewrite` on
``gm.meta[autoshard.meta.MOE_REWRITE]`` (layers, groups, and the record key ``key`` that every ``attach`` node carries,
so two models compiled in one process keep separate records), mirrored as plain data in the plan report's
``"expert_rewrite"`` (``gm.meta[autoshard.meta.PLAN_REPORT]``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.fx

from autoshard import meta as M
from autoshard.compiler.context import Context
from autoshard.errors import PlanError
from autoshard.frontend import hf_blocks
from autoshard.frontend.graph_utils import NodeBuilder, fetch_attr
from autoshard.runtime.moe import graph_ops
from autoshard.compiler.moe.options import capacity_of
from autoshard.runtime.moe.records import new_key
from autoshard.compiler.moe.result import MoELayer, MoERewrite
from autoshard.placements import Replicate, Shard

aten = torch.ops.aten

#: Ops allowed between the FFN's projections (the activation): pointwise, shape-preserving.
POINTWISE = {
    aten.gelu.default, aten.silu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default,
    aten.erf.default, aten.exp.default, aten.neg.default, aten.mul.Tensor, aten.mul.Scalar, aten.add.Tensor,
    aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.div.Tensor, aten.div.Scalar, aten.pow.Tensor_Scalar,
    aten.square.default, aten.clone.default, aten.relu_.default, aten.gelu_.default, aten.silu_.default,
}


@dataclasses.dataclass(frozen=True)
class FFN:
    path: str
    x: torch.fx.Node
    in_projs: tuple[torch.fx.Node, ...]  # projections of x (aten.linear, or addmm for Conv1D), graph order
    between: tuple[torch.fx.Node, ...]  # pointwise nodes, graph order
    out_proj: torch.fx.Node  # the projection producing the FFN's result
    result: torch.fx.Node  # the value used outside (out_proj, or a view/no-op dropout of it)
    nodes: tuple[torch.fx.Node, ...]  # every call_function node of the module
    identity: dict  # view / no-op dropout node -> the node it passes through


#: Ops the matcher looks through: flattening views around a projection (GPT-2's Conv1D) and p=0 dropout.
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.contiguous.default}


def projection_weights(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node | None, bool] | None:
    """(weight, bias, stored [out, in]) of a projection node: ``aten.linear`` or ``aten.addmm`` (Conv1D)."""
    if node.target == aten.linear.default:
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return node.args[1], bias, True
    if node.target == aten.addmm.default and len(node.args) == 3 and not node.kwargs:
        return node.args[2], node.args[0], False
    return None


def _projection_input(node: torch.fx.Node) -> torch.fx.Node:
    return node.args[0] if node.target == aten.linear.default else node.args[1]
@contextlib.contextmanager
def _compute_dtype_values(gm: torch.fx.GraphModule, ctx: Context):
    """Under ``precision=MixedPrecision(param_dtype)`` the graph is the trace of the ``param_dtype`` compute copy
    (:func:`autoshard.frontend.precision.trace_with_precision`), but its parameter ``get_attr`` nodes (and floating
    inputs) hold the masters' dtype until the ``mixed_precision`` pass, after propagation, casts each where it is read.
    The nodes built here compute their values from their inputs' (fake) values: while building, those read as the
    ``param_dtype`` values they are in the compute copy (the experts' bmm of bf16 tokens and bf16 weights, as one
    device computes under the policy), and afterwards the masters' values again, so the pass casts them as any
    other parameter. The router is the model's own code, traced as the compute copy runs it (HF: a bf16 gate linear,
    its softmax in float32)."""
    from torch._guards import detect_fake_mode

    from autoshard.passes.mixed_precision import casts
    from autoshard.frontend.precision import fake_like

    policy = getattr(ctx.options, "precision", None)
    if policy is None:
        yield lambda node: None
        return
    mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)])
    masters = {}

    def compute(node: torch.fx.Node, read: bool | None = None) -> None:
        if casts(gm, node, policy.param_dtype, read):
            masters[node] = node.meta["val"]
            node.meta["val"] = fake_like(masters[node], policy.param_dtype, mode)

    for node in gm.graph.nodes:
        compute(node)
    try:
        yield lambda node: compute(node, read=True)  # a parameter the rewrite adds, before its readers are built
    finally:
        for node, val in masters.items():
            node.meta["val"] = val


@dataclasses.dataclass(frozen=True)
class ExpertRewrite:
    name: str = "expert_rewrite"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        opts = getattr(ctx.options, "moe", None)
        if opts is None:
            return gm
        if opts.existing:  # the model's own sparse-MoE blocks (Hugging Face): autoshard/frontend/hf_blocks.py

            with _compute_dtype_values(gm, ctx):
                return rewrite_existing(gm, ctx, opts, self.name)
        mesh = ctx.mesh
        n = mesh.axis_size(opts.expert_axis) if opts.expert_axis in mesh.names else 1
        if opts.num_experts % n:
            raise PlanError(f"MoE num_experts has {opts.num_experts}, but it must be divisible by the size {n} of "
                            f"expert axis `{opts.expert_axis}`. Use a multiple of {n} experts.")
        groups = opts.groups if opts.groups is not None else n
        if groups % n:
            raise PlanError(f"MoE groups has {groups}, but it must be a multiple of the size {n} of expert axis "
                            f"`{opts.expert_axis}` (each rank routes whole groups).")
        paths = module_paths(gm)
        key = new_key()
        layers = []
        annotations = []
        gen = torch.Generator().manual_seed(opts.seed)
        with _compute_dtype_values(gm, ctx) as compute:
            for path in opts.select(paths):
                ffn = match_ffn(gm, path)
                layer = emit_moe(gm, ffn, opts, groups, gen, key, compute)
                layers.append(layer)
                if n > 1:
                    spec = tuple(Shard(0) if a == opts.expert_axis else Replicate() for a in mesh.names)
                    annotations += [(name, spec) for name in layer.expert_params]
        gm.graph.lint()
        gm.recompile()
        result = MoERewrite(tuple(layers), groups, opts.expert_axis, key)
        gm.meta[M.MOE_REWRITE] = result
        gm.meta[M.IMPLIED_ANNOTATIONS] = tuple(annotations) + gm.meta.get(M.IMPLIED_ANNOTATIONS, ())
        M.plan_report(gm)[self.name] = result.report()
        return gm


def module_paths(gm: torch.fx.GraphModule) -> list[str]:
    """Every module path (and prefix) that owns a call_function node, in graph order."""
    seen: dict[str, None] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        parts = M.module_path(node).split(".")
        for i in range(1, len(parts) + 1):
            p = ".".join(parts[:i])
            if p:
                seen.setdefault(p, None)
    return list(seen)


def _under(node: torch.fx.Node, path: str) -> bool:
    p = M.module_path(node)
    return p == path or p.startswith(path + ".")


def _not_ffn(path: str, actual: str) -> PlanError:
    return PlanError(f"module `{path}` selected by MoE layers has {actual}, but an expert rewrite needs a dense FFN: "
                     "linear → activation → linear, or gated (two linears of the input, an activation and a product, "
                     "then a linear). Select only FFN modules (e.g. layers='blocks.*.mlp'), or list them explicitly.")


def match_ffn(gm: torch.fx.GraphModule, path: str) -> FFN:
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and _under(n, path)]
    if not nodes:
        raise _not_ffn(path, "no operations")
    inside = set(nodes)
    identity: dict = {}
    for n in nodes:
        if n.target in _VIEWS:
            identity[n] = n.args[0]
        elif n.target == aten.dropout.default:
            p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
            train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train", True)
            if p and train:
                raise _not_ffn(path, f"dropout with p={p} (node `{n.name}`); only p=0 (or eval) dropout")
            identity[n] = n.args[0]

    def src(a):
        while a in identity:
            a = identity[a]
        return a

    escaping = [n for n in nodes if any(u not in inside for u in n.users)]
    if len(escaping) != 1:
        raise _not_ffn(path, f"{len(escaping)} values used outside it ({[e.name for e in escaping]})")
    result = escaping[0]
    out_proj = src(result)
    if out_proj not in inside or projection_weights(out_proj) is None:
        raise _not_ffn(path, f"its result computed by {getattr(out_proj, 'target', out_proj)}, not a linear")
    outside_inputs = {a for n in nodes for a in n.all_input_nodes if a not in inside and a.op != "get_attr"}
    if len(outside_inputs) != 1:
        raise _not_ffn(path, f"{len(outside_inputs)} inputs ({sorted(a.name for a in outside_inputs)})")
    x = next(iter(outside_inputs))
    projs = [n for n in nodes if n not in identity and projection_weights(n) is not None]
    in_projs = [n for n in projs if n is not out_proj and src(_projection_input(n)) is x]
    if not 1 <= len(in_projs) <= 2 or len(projs) != len(in_projs) + 1:
        raise _not_ffn(path, f"{len(projs)} linears, {len(in_projs)} of them reading the input")
    between = [n for n in nodes if n not in projs and n not in identity]
    produced = set(in_projs) | set(between)
    for n in between:
        if n.target not in POINTWISE:
            raise _not_ffn(path, f"op {n.target} (node `{n.name}`) between its projections")
        for a in n.all_input_nodes:
            if src(a) not in produced:
                raise _not_ffn(path, f"node `{n.name}` reading `{a.name}`, which is not computed from the "
                                     "projections")
    if src(_projection_input(out_proj)) not in between:
        raise _not_ffn(path, "no activation between its projections")
    for lin in [*in_projs, out_proj]:
        weight, bias, _ = projection_weights(lin)
        if any(not isinstance(t, torch.fx.Node) or t.op != "get_attr" for t in (weight, bias) if t is not None):
            raise _not_ffn(path, f"linear `{lin.name}` whose weight is computed, not a parameter")
    if len(in_projs) == 2:
        shapes = {tuple(p.meta["val"].shape) for p in in_projs}
        if len(shapes) != 1:
            raise _not_ffn(path, f"gated projections of different shapes {sorted(shapes)}")
    if tuple(result.meta["val"].shape) != tuple(x.meta["val"].shape):
        raise _not_ffn(path, f"output shape {list(result.meta['val'].shape)} unlike its input's "
                             f"{list(x.meta['val'].shape)}")
    return FFN(path, x, tuple(in_projs), tuple(between), out_proj, result, tuple(nodes), identity)


def _stack_for(ffn: FFN):
    stack = ffn.out_proj.meta.get("nn_module_stack")
    if not stack:
        return None
    kept = {k: v for k, v in stack.items()
            if M.clean_path(v[0]) == ffn.path or ffn.path.startswith(M.clean_path(v[0]) + ".")}
    return kept or None


def _expert_weight(dense: torch.Tensor, experts: int, opts, gen: torch.Generator, fan_in: int) -> torch.Tensor:
    """``dense`` (already ``[in, out]`` or ``[out]``) broadcast to every expert: upcycled (+ noise) or fresh; on the
    meta device (a meta-built model, a plan traced from the meta skeleton) its shape alone."""
    if dense.is_meta:
        return torch.empty((experts, *dense.shape), dtype=dense.dtype, device="meta")
    with torch.no_grad():
        if opts.init == "upcycle":
            w = dense.detach().unsqueeze(0).repeat(experts, *([1] * dense.dim())).clone()
            if opts.noise:
                std = float(dense.detach().float().std()) if dense.numel() > 1 else 1.0
                w += (torch.randn(w.shape, generator=gen) * (opts.noise * std)).to(w.dtype)
            return w
        bound = 1.0 / math.sqrt(fan_in)
        return ((torch.rand((experts, *dense.shape), generator=gen) * 2 - 1) * bound).to(dense.dtype)


def emit_moe(gm: torch.fx.GraphModule, ffn: FFN, opts, groups: int, gen: torch.Generator, key: str,
             compute=None) -> MoELayer:
    """Replace ``ffn`` by the MoE layer of the module docstring; ``key`` is the record key its ``attach`` carries.

    The new parameters are masters in the dense weights' dtype (fp32 under ``precision=``, like every parameter;
    the router always float32). ``compute`` (from :func:`_compute_dtype_values`) makes an expert parameter's node
    read as its ``param_dtype`` copy while the layer is built, so the experts compute in ``param_dtype`` as every
    other op of the compute copy does (the ``mixed_precision`` pass casts them after propagation); the router's node
    is marked ``KEEP_DTYPE``, never cast: the router computes in float32 under every policy."""

    compute = compute or (lambda node: None)
    x = ffn.x
    xval = x.meta["val"]
    shape = tuple(int(s) for s in xval.shape)
    hidden = shape[-1]
    tokens = math.prod(shape[:-1])
    if len(shape) < 2 or shape[0] % groups:
        raise PlanError(f"MoE layer `{ffn.path}` has input of shape {list(shape)}, but its leading (batch) dim must "
                        f"be divisible by the {groups} routing groups ({_groups_origin(opts)}). Use a batch that "
                        f"is a multiple of {groups}.")
    per_group = tokens // groups
    E, k = opts.num_experts, opts.top_k
    cap = capacity_of(per_group, opts)
    b = NodeBuilder(gm, ffn.result, xval.fake_mode, _stack_for(ffn), ffn.out_proj.meta.get("stack_trace"))
    path = ffn.path

    # parameters
    names = ["w1", "w3"][: len(ffn.in_projs)]
    expert_params = []
    w_in, b_in = [], []
    def dense(lin):  # (weight as [in, out], bias or None) of a dense projection
        weight, bias, out_in = projection_weights(lin)
        w = fetch_attr(gm, weight.target)
        return (w.t() if out_in else w), (None if bias is None else fetch_attr(gm, bias.target))

    for name, lin in zip(names, ffn.in_projs):
        dense_w, dense_b = dense(lin)  # [h, f]
        w_in.append(b.param(f"{path}.experts.{name}", _expert_weight(dense_w, E, opts, gen, hidden)))
        expert_params.append(f"{path}.experts.{name}")
        if dense_b is not None:
            bname = "b" + name[1:]
            b_in.append(b.param(f"{path}.experts.{bname}", _expert_weight(dense_b, E, opts, gen, hidden)))
            expert_params.append(f"{path}.experts.{bname}")
        else:
            b_in.append(None)
    dense_w2, dense_b2 = dense(ffn.out_proj)  # [f, h]
    ffn_dim = dense_w2.shape[0]
    w2 = b.param(f"{path}.experts.w2", _expert_weight(dense_w2, E, opts, gen, ffn_dim))
    expert_params.append(f"{path}.experts.w2")
    b2 = None
    if dense_b2 is not None:
        b2 = b.param(f"{path}.experts.b2", _expert_weight(dense_b2, E, opts, gen, ffn_dim))
        expert_params.append(f"{path}.experts.b2")
    router = b.param(f"{path}.router.weight", torch.empty(E, hidden, device="meta") if dense_w2.is_meta
                     else torch.randn(E, hidden, generator=gen) * opts.router_std)
    router.meta[M.KEEP_DTYPE] = True
    for w in (*w_in, *b_in, w2, b2):
        if w is not None:
            compute(w)

    # routing
    xg = b.call(aten.reshape.default, x, [groups, per_group, hidden])
    xf = xg if xval.dtype == torch.float32 else b.call(aten._to_copy.default, xg, dtype=torch.float32)
    logits = b.call(aten.linear.default, xf, router)
    probs = b.call(aten.softmax.int, logits, -1)
    routed = b.call(graph_ops.route_groups, logits, k, cap)
    ei, pos, keep = b.items(routed, 3)
    gate = b.call(graph_ops.gate_groups, probs, ei)

    # experts
    buf = b.call(graph_ops.dispatch_groups, xg, ei, pos, keep, E, cap)
    flat = b.call(aten.reshape.default, buf, [E, groups * cap, hidden])

    def project(inp, w, bias):
        if bias is None:
            return b.call(aten.bmm.default, inp, w)
        return b.call(aten.baddbmm.default, b.call(aten.unsqueeze.default, bias, 1), inp, w)

    def src(a):
        while a in ffn.identity:
            a = ffn.identity[a]
        return a

    env = {lin: project(flat, w, bias) for lin, w, bias in zip(ffn.in_projs, w_in, b_in)}
    for old in ffn.between:
        env[old] = b.copy(old, env, src)
    down = project(env[src(_projection_input(ffn.out_proj))], w2, b2)
    y = b.call(aten.reshape.default, down, [E, groups, cap, hidden])
    out = b.call(graph_ops.combine_groups, y, ei, pos, gate, keep)

    # losses and statistics
    frac = b.call(graph_ops.first_fraction, ei, E, tokens)
    terms = b.call(graph_ops.aux_terms, probs, logits, frac, E, tokens)
    stats = b.call(graph_ops.routing_stats, ei, keep, terms, E)
    out = b.call(graph_ops.attach, out, terms, stats, key, path, float(opts.aux_loss_weight),
                 float(opts.z_loss_weight), k)
    result = b.call(aten.reshape.default, out, list(shape))

    ffn.result.replace_all_uses_with(result)
    dense_attrs = {a for n in ffn.nodes for a in n.all_input_nodes if a.op == "get_attr"}
    for node in reversed(ffn.nodes):
        gm.graph.erase_node(node)
    dense_attrs = {a for a in dense_attrs if not a.users}
    for a in dense_attrs:
        gm.graph.erase_node(a)
    itemsize = xval.element_size()
    return MoELayer(path=path, experts=E, top_k=k, groups=groups, tokens_per_group=per_group, capacity=cap,
                    capacity_factor=opts.capacity_factor, gated=len(ffn.in_projs) == 2, hidden=hidden, ffn=ffn_dim,
                    buffer_bytes=E * groups * cap * hidden * itemsize, expert_params=tuple(expert_params),
                    router=f"{path}.router.weight", init=opts.init,
                    replaced=tuple(sorted(str(a.target) for a in dense_attrs)))


__all__ = ["ExpertRewrite", "emit_moe", "match_ffn", "module_paths", "projection_weights"]


# ---- MoE(existing=True): the model's own Hugging Face sparse-MoE blocks ------------------------------------
def _is_experts(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target == torch.ops.autoshard.hf_experts.default


_LAYOUT_OPS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
               torch.ops.aten.cat.default, torch.ops.aten.transpose.int, torch.ops.aten.permute.default,
               torch.ops.aten.t.default, torch.ops.aten.alias.default}


def _weights(t) -> list[torch.fx.Node]:
    """The parameters (``get_attr``) an experts weight argument is, or is viewed, concatenated or transposed from
    (DBRX's flat weights reach the op as ``cat([w1.view(...), v1.view(...)])`` and ``w2.view(...).transpose``)."""
    out, stack, seen = [], [t], set()
    while stack:
        x = stack.pop()
        if not isinstance(x, torch.fx.Node) or x in seen:
            continue
        seen.add(x)
        if x.op == "get_attr":
            out.append(x)
        elif x.op == "call_function" and x.target in _LAYOUT_OPS:
            stack.extend(reversed(x.all_input_nodes))
    return out


def _block_of(gm: torch.fx.GraphModule, node: torch.fx.Node, found: hf_blocks.Found | None) -> hf_blocks.Block:
    up = node.args[3]
    sources = _weights(up)
    path = str(sources[0].target).rsplit(".experts.", 1)[0] if sources else M.module_path(node)
    for block in (found.blocks if found else ()):
        if block.path == path:
            return block
    act, has_gate, transposed, concatenated = node.args[7:11]
    e = up.meta["val"].shape[0]
    return hf_blocks.Block(path, "gate", e, int(node.args[1].meta["val"].shape[-1]), act, has_gate, transposed,
                           concatenated, node.args[5] is not None)


def _project(b, inp: torch.fx.Node, w: torch.fx.Node, bias, transposed: bool) -> torch.fx.Node:
    """``inp[E, n, in] @ w[e]ᵀ (+ bias)`` for HF's stacked ``w[E, out, in]`` (``[E, in, out]`` when transposed)."""
    aten = torch.ops.aten
    wt = w if transposed else b.call(aten.transpose.int, w, 1, 2)
    if bias is None:
        return b.call(aten.bmm.default, inp, wt)
    return b.call(aten.baddbmm.default, b.call(aten.unsqueeze.default, bias, 1), inp, wt)


def _groups_origin(opts) -> str:
    """Where the number of routing groups came from, for an error message: the user's ``groups=`` or the default."""
    if opts.groups is not None:
        return f"MoE groups={opts.groups}"
    return f"one per rank of expert axis `{opts.expert_axis}`"


def rewrite_existing(gm: torch.fx.GraphModule, ctx, opts, name: str):
    """``MoE(existing=True)``: expand every ``hf_experts`` node (see the module docstring). Returns the
    :class:`~autoshard.compiler.moe.MoERewrite`."""
    from autoshard.runtime.moe.routing import capacity
    from autoshard.placements import Replicate, Shard

    found: hf_blocks.Found | None = gm.meta.get(hf_blocks.FOUND)
    nodes = [n for n in gm.graph.nodes if _is_experts(n)]
    if not nodes:
        model = found.model if found else "the model"
        why = "".join(f"; `{p}`: {r}" for p, r in (found.rejected if found else ()))
        raise PlanError(f"MoE(existing=True) was given, but {model} has no sparse-MoE block autoshard recognises "
                        "(looked for a module with a router child `gate`/`router` holding weight [E, hidden] and "
                        "top_k, and an `experts` child with stacked 3-D `gate_up_proj`/`up_proj` and `down_proj` "
                        f"parameters: transformers' experts interface, as Mixtral and Qwen2-MoE{why}). Use "
                        "MoE(layers=..., num_experts=...) to turn dense FFNs into MoE layers instead.")
    mesh = ctx.mesh
    n = mesh.axis_size(opts.expert_axis) if opts.expert_axis in mesh.names else 1
    groups = opts.groups if opts.groups is not None else n
    if groups % n:
        raise PlanError(f"MoE groups has {groups}, but it must be a multiple of the size {n} of expert axis "
                        f"`{opts.expert_axis}` (each rank routes whole groups).")
    blocks = [(node, _block_of(gm, node, found)) for node in nodes]
    if opts.layers != "*.mlp" or opts.every != 1:  # the defaults take every recognised block
        chosen = set(opts.select([b.path for _, b in blocks]))
        blocks = [(node, b) for node, b in blocks if b.path in chosen]
    key = new_key()
    layers, annotations = [], []
    aten = torch.ops.aten
    for node, block in blocks:
        hidden, index, weights, up, down, up_bias, down_bias = node.args[:7]
        E, k = block.experts, block.top_k
        if E % n:
            raise PlanError(f"MoE block `{block.path}` has {E} experts, but they must be divisible by the size {n} of "
                            f"expert axis `{opts.expert_axis}`. Use a mesh whose `{opts.expert_axis}` size "
                            f"divides {E}.")
        xval = hidden.meta["val"]
        tokens, h = (int(s) for s in xval.shape)
        if tokens % groups:
            raise PlanError(f"MoE block `{block.path}` routes {tokens} tokens, but they must be divisible by the "
                            f"{groups} routing groups ({_groups_origin(opts)}). Use a batch whose tokens are a "
                            f"multiple of {groups}.")
        per_group = tokens // groups
        cf = opts.capacity_factor
        cap = per_group if cf is None else min(per_group, capacity(per_group, E, k, cf))
        b = NodeBuilder(gm, node, xval.fake_mode, node.meta.get("nn_module_stack"), node.meta.get("stack_trace"))
        xg = b.call(aten.reshape.default, hidden, [groups, per_group, h])
        ei = b.call(aten.reshape.default, index, [groups, per_group, k])
        wg = b.call(aten.reshape.default, weights, [groups, per_group, k])
        pos, keep = b.items(b.call(graph_ops.slot_groups, ei, E, cap), 2)
        buf = b.call(graph_ops.dispatch_groups, xg, ei, pos, keep, E, cap)
        flat = b.call(aten.reshape.default, buf, [E, groups * cap, h])

        gu = _project(b, flat, up, up_bias, block.transposed)
        width = int(gu.meta["val"].shape[-1])
        act = {"silu": (aten.silu.default, {}), "gelu": (aten.gelu.default, {}), "relu": (aten.relu.default, {}),
               "gelu_tanh": (aten.gelu.default, {"approximate": "tanh"})}[block.activation]
        if block.has_gate:
            f = width // 2
            if block.concatenated:
                g_part = b.call(aten.slice.Tensor, gu, 2, 0, f)
                u_part = b.call(aten.slice.Tensor, gu, 2, f, width)
            else:
                g_part = b.call(aten.slice.Tensor, gu, 2, 0, width, 2)
                u_part = b.call(aten.slice.Tensor, gu, 2, 1, width, 2)
            hid = b.call(aten.mul.Tensor, b.call(act[0], g_part, **act[1]), u_part)
        else:
            f = width
            hid = b.call(act[0], gu, **act[1])
        y = b.call(aten.reshape.default, _project(b, hid, down, down_bias, block.transposed), [E, groups, cap, h])
        out = b.call(graph_ops.combine_groups, y, ei, pos, wg, keep)
        terms = b.call(aten.zeros.default, [groups, 2], dtype=torch.float32, device=xval.device)
        stats = b.call(graph_ops.routing_stats, ei, keep, terms, E)
        out = b.call(graph_ops.attach, out, terms, stats, key, block.path, 0.0, 0.0, k)
        result = b.call(aten.reshape.default, out, [tokens, h])
        if result.meta["val"].dtype != xval.dtype:
            result = b.call(aten._to_copy.default, result, dtype=xval.dtype)
        node.replace_all_uses_with(result)
        gm.graph.erase_node(node)
        params = tuple(str(w.target) for t in (up, up_bias, down, down_bias) for w in _weights(t))
        if n > 1:
            spec = tuple(Shard(0) if a == opts.expert_axis else Replicate() for a in mesh.names)
            annotations += [(p, spec) for p in params]
        router = f"{block.path}.{block.router}.weight" if block.path else f"{block.router}.weight"
        layers.append(MoELayer(path=block.path, experts=E, top_k=k, groups=groups, tokens_per_group=per_group,
                               capacity=cap, capacity_factor=opts.capacity_factor, gated=block.has_gate, hidden=h,
                               ffn=f, buffer_bytes=E * groups * cap * h * xval.element_size(), expert_params=params,
                               router=router, init="existing"))
    gm.graph.lint()
    gm.recompile()
    result = MoERewrite(tuple(layers), groups, opts.expert_axis, key)
    gm.meta[M.MOE_REWRITE] = result
    gm.meta[M.IMPLIED_ANNOTATIONS] = tuple(annotations) + gm.meta.get(M.IMPLIED_ANNOTATIONS, ())
    M.plan_report(gm)[name] = result.report()
    return gm

