"""Hugging Face sparse-MoE blocks (Mixtral, Qwen2-MoE, and others on transformers' experts interface) run with
experts sharded over an expert axis: ``autoshard.compile(..., moe=autoshard.MoE(existing=True, ...))``.

A transformers 5 sparse-MoE block is a router child (``gate``/``router``: a ``weight [E, h]`` and ``top_k``)
that returns HF's own ``(router_logits, top_k_weights, top_k_index)`` with static shapes, and an ``experts`` child
holding every expert's weights stacked (``gate_up_proj [E, 2f, h]``, ``down_proj [E, h, f]``; transposed and
biased variants too) whose *forward* loops over per-expert token lists (data-dependent shapes: it does not
trace) or calls ``grouped_mm`` (no sharding rule). Only the experts' forward is replaced; the router, the shared
expert (Qwen2-MoE's sigmoid-gated one), the block's own code and HF's ``output_router_logits`` load-balancing loss
stay Hugging Face's, so their definitions (softmax dtype, top-k, whether the top-k weights are renormalised, the
aux loss over all tokens) are HF's by construction.

Two steps, one at trace time (this module) and one at plan time (``passes/expert_rewrite.py``, whose sharding rules
for these ops are in :mod:`autoshard.compiler.ops.hf_moe`):

1. :func:`swapped` (around ``torch.export`` in :mod:`autoshard.frontend.trace`): every recognised block's experts module
   gets, for the duration of the export only, an instance ``forward`` that calls one static-shape op,
   ``torch.ops.autoshard.hf_experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, ...)``. The
   parameters are passed as they are, so the graph reads them by their HF FQNs (checkpoints, annotations and
   parameter names match the HF model). The instance attribute is removed afterwards: the user's model is left
   exactly as it was. What was found (and why other candidates were not taken) goes to ``gm.meta[FOUND]``.
   Without ``moe=`` the op stays in the graph: its eager form (:func:`experts_reference`) is sparse, dropless and
   exact: the ``(token, choice)`` pairs are sorted by expert, their token rows gathered, each expert's FFN run on
   its own rows only (one grouped GEMM, ``torch._grouped_mm``, where the device and dtype have it, else one matmul
   per expert) and the outputs added back into ``[T, h]`` weighted by the routing weights: ``T·k`` rows of work,
   ``k/E`` of running every expert on every token (:func:`experts_dense_reference`, kept as the tests' oracle).
   Backward recomputes that sparse form under autograd. The op's rule shards it on tokens (data parallelism) and
   on the stacked weights' expert dim (``"e"``: a rank holding experts ``[o, o + E/n)`` keeps only the choices of
   those experts and runs them on their tokens, a Partial share of the output; the local form passes
   ``expert_offset=o``). So the planner can split the experts over any axis, or store them sharded over `data`
   (ZeRO), with no ``moe=`` and nothing dropped.
2. :func:`autoshard.passes.expert_rewrite.rewrite_existing` (``MoE(existing=True)``): each ``hf_experts`` node becomes
   the expert rewrite's capacity-bounded subgraph, made from the same group ops
   (:mod:`autoshard.runtime.moe.graph_ops`)::

       xg, ei, w  = reshape(hidden | top_k_index | top_k_weights, [G, T_g, ...])   # routing groups
       pos, keep  = slot_groups(ei, E, C)               # GShard positions of HF's choices (first choices first)
       buf        = dispatch_groups(xg, ei, pos, keep, E, C)                       # [E, G, C, h]: all-to-all
       gu         = bmm(buf.view(E, G*C, h), gate_up_proj.transpose(1, 2))         # experts sharded Shard(0)
       hid        = act(gu[..., :f]) * gu[..., f:]                                 # HF's _apply_gate
       y          = bmm(hid, down_proj.transpose(1, 2)).view(E, G, C, h)           # all-to-all back
       out        = combine_groups(y, ei, pos, w, keep).view(T, h)                 # HF's routing weights

   ``C = T_g`` when ``capacity_factor=None`` (dropless: an expert gets at most one choice per token, so every
   routed token fits and the result is Hugging Face's), else ``min(T_g, ceil(k·T_g/E·cf))`` with over-capacity
   choices dropped as the expert rewrite drops them (their weight is not renormalised). The expert parameters
   are annotated ``Shard(0)`` on the expert axis through ``gm.meta[autoshard.meta.IMPLIED_ANNOTATIONS]``:
   propagation puts one all-to-all before the experts and one after, 4 per layer per step with backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.fx
import torch.nn.functional as F
from torch import Tensor

from autoshard import meta as M

__all__ = ["FOUND", "Block", "find_blocks", "swapped"]

#: ``gm.meta`` key: what :func:`swapped` found in the traced model (a :class:`Found`)
FOUND = M.HF_MOE_BLOCKS

#: activation name -> function; an experts module's ``act_fn`` is identified by its values on a probe
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
}
_ROUTER_NAMES = ("gate", "router")


@dataclasses.dataclass(frozen=True)
class Block:
    """One recognised sparse-MoE block: its path, the router and experts children, and the experts' layout."""

    path: str
    router: str  # child name of the router (gate / router)
    experts: int  # E
    top_k: int
    activation: str
    has_gate: bool  # gate_up_proj (gated) or up_proj
    transposed: bool  # weights stored [E, in, out] rather than [E, out, in]
    concatenated: bool  # gate_up = [gate; up] (else interleaved gate0, up0, gate1, ...)
    has_bias: bool
    #: DBRX: every expert's weights in flat 2-D parameters of ``experts.mlp`` (``w1`` gate, ``v1`` up, ``w2`` down,
    #: each ``[E·f, h]``), the router's weight in ``router.layer``, and ``[batch, seq, h]`` hidden states; the
    #: static forward views them as the stacked layout the other fields describe (``gate_up [E, 2f, h]``,
    #: ``down [E, h, f]``)
    flat: bool = False


@dataclasses.dataclass(frozen=True)
class Found:
    """What :func:`swapped` saw: the model class, the recognised blocks, and near misses with the reason."""

    model: str
    blocks: tuple[Block, ...]
    rejected: tuple[tuple[str, str], ...]  # (path, why not)


# ---- recognition ---------------------------------------------------------------------------------------------
def _activation(fn) -> str | None:
    probe = torch.linspace(-6, 6, 97)
    try:
        with torch.no_grad():
            got = fn(probe)
    except (TypeError, ValueError, RuntimeError, AttributeError):
        return None
    for name, ref in ACTIVATIONS.items():
        if isinstance(got, Tensor) and got.shape == probe.shape and torch.allclose(got, ref(probe), atol=1e-6):
            return name
    return None


def _param3(module, name):
    p = getattr(module, name, None)
    return p if isinstance(p, torch.nn.Parameter) and p.dim() == 3 else None


def _routed_signature(experts: torch.nn.Module) -> bool:
    """Whether the experts' forward takes ``(hidden_states, top_k_index, top_k_weights)`` (the experts interface)."""
    import inspect

    try:
        params = inspect.signature(experts.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)


def _param2(module, name):
    p = getattr(module, name, None)
    return p if isinstance(p, torch.nn.Parameter) and p.dim() == 2 else None


def _recognise_flat(path: str, module: torch.nn.Module) -> Block | str:
    """DBRX's layout: ``experts.mlp.{w1, v1, w2}`` each ``[E·f, h]`` (gate, up, and down stored ``[f, h]`` per
    expert), E = ``experts.num_experts``, a router ``router.layer`` (a Linear ``[E, h]``) and ``top_k`` on the
    block."""
    experts = module.experts
    mlp = getattr(experts, "mlp", None)
    w1, v1, w2 = (_param2(mlp, n) for n in ("w1", "v1", "w2"))
    n = getattr(experts, "num_experts", None)
    if not isinstance(n, int) or n < 1 or not all(w is not None and w.shape == w1.shape for w in (w1, v1, w2)) \
            or w1.shape[0] % n:
        return ("its `experts` child has neither stacked 3-D `gate_up_proj`/`up_proj` and `down_proj` parameters "
                "(transformers' experts interface) nor flat 2-D `mlp.w1`/`mlp.v1`/`mlp.w2` of [experts * ffn, "
                "hidden] with `num_experts` (DBRX)")
    layer = getattr(getattr(module, "router", None), "layer", None)
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[0] != n or \
            getattr(layer, "bias", None) is not None:
        return f"flat experts (DBRX) without a router `router.layer` with a weight [{n}, hidden] and no bias"
    top_k = getattr(module, "top_k", None)
    if not isinstance(top_k, int) or not 1 <= top_k <= n:
        return f"flat experts (DBRX) without a top_k in [1, {n}] on the block"
    activation = _activation(getattr(mlp, "activation_fn", None))
    if activation is None:
        return (f"an activation {type(getattr(mlp, 'activation_fn', None)).__name__} not among "
                f"{sorted(ACTIVATIONS)}")
    return Block(path, "router.layer", n, top_k, activation, True, False, True, False, flat=True)


def _recognise(path: str, module: torch.nn.Module) -> Block | str:
    """The :class:`Block` ``module`` is, or why it is not one (it has an ``experts`` child)."""
    experts = module.experts
    if not _routed_signature(experts):
        # Llama-4: the router's scores multiply the input before the experts, whose forward takes that routed
        # input alone and runs every expert on it (a static batched matmul): torch.export traces it as it is
        return ("its experts' forward takes no (hidden_states, top_k_index, top_k_weights): it runs every expert "
                "on inputs routed before it (as Llama-4's does) and is traced as it is")
    if _param3(experts, "gate_up_proj") is None and _param3(experts, "up_proj") is None \
            and getattr(experts, "mlp", None) is not None:
        return _recognise_flat(path, module)
    has_gate = bool(getattr(experts, "has_gate", True))
    up = _param3(experts, "gate_up_proj" if has_gate else "up_proj")
    down = _param3(experts, "down_proj")
    if up is None or down is None:
        return ("its `experts` child has no stacked 3-D `gate_up_proj`/`up_proj` and `down_proj` parameters "
                "(transformers' experts interface)")
    n = up.shape[0]
    router = next((r for r in _ROUTER_NAMES if isinstance(getattr(module, r, None), torch.nn.Module)
                   and isinstance(getattr(getattr(module, r), "weight", None), Tensor)
                   and getattr(module, r).weight.dim() == 2 and getattr(module, r).weight.shape[0] == n), None)
    if router is None:
        return f"no router child ({' or '.join(_ROUTER_NAMES)}) with a weight [{n}, hidden]"
    top_k = getattr(getattr(module, router), "top_k", None) or getattr(module, "top_k", None)
    if not isinstance(top_k, int) or not 1 <= top_k <= n:
        return f"router `{router}` has no top_k in [1, {n}]"
    if getattr(experts, "has_post_expert_norm", False):
        return "experts with a post-expert norm"
    apply_gate = getattr(type(experts), "_apply_gate", None)
    if has_gate and apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate":
        return f"a custom gating function {type(experts).__name__}._apply_gate"
    activation = _activation(getattr(experts, "act_fn", None))
    if activation is None:
        return f"an activation {type(getattr(experts, 'act_fn', None)).__name__} not among {sorted(ACTIVATIONS)}"
    has_bias = bool(getattr(experts, "has_bias", False))
    if has_bias and (getattr(experts, "gate_up_proj_bias" if has_gate else "up_proj_bias", None) is None
                     or getattr(experts, "down_proj_bias", None) is None):
        return "has_bias without the bias parameters"
    if down.shape[0] != n:
        return f"{up.shape[0]} in-projections but {down.shape[0]} down projections"
    return Block(path, router, n, top_k, activation, has_gate, bool(getattr(experts, "is_transposed", False)),
                 bool(getattr(experts, "is_concatenated", True)), has_bias)


def find_blocks(model: torch.nn.Module) -> Found:
    """Every sparse-MoE block of ``model`` (modules with an ``experts`` child), recognised or not."""
    blocks, rejected = [], []
    for path, module in model.named_modules():
        if isinstance(getattr(module, "experts", None), torch.nn.Module) and not isinstance(
                module.experts, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            got = _recognise(path, module)
            (blocks if isinstance(got, Block) else rejected).append(got if isinstance(got, Block) else (path, got))
        elif isinstance(getattr(module, "experts", None), torch.nn.ModuleList):
            rejected.append((path, "experts as a ModuleList of per-expert modules (transformers 4 layout)"))
    return Found(type(model).__name__, tuple(blocks), tuple(rejected))


# ---- the static-shape experts op (trace time) ------------------------------------------------------------------
def _route(top_k_index: Tensor, top_k_weights: Tensor, expert_offset: int, n_local: int):
    """The (token, choice) pairs routed to the experts held here (``expert_offset`` to ``expert_offset + n_local -
    1``), sorted by expert, stably (token order within an expert): their tokens, routing weights and local expert
    ids, and the number of pairs of each local expert."""
    k = top_k_index.shape[1]
    local = top_k_index.reshape(-1) - expert_offset
    pairs = ((local >= 0) & (local < n_local)).nonzero().squeeze(1)
    experts, order = torch.sort(local[pairs], stable=True)
    pairs = pairs[order]
    counts = torch.bincount(experts, minlength=n_local)
    return pairs // k, top_k_weights.reshape(-1)[pairs], experts, counts


def _matmul_dtype(x: Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: under ``torch.autocast`` its dtype (autocast casts a matmul's
    floating operands but float64 to it, as it does eager's per-expert linears), else ``x``'s."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point() and x.dtype != torch.float64:
        return torch.get_autocast_dtype(device)
    return x.dtype


@functools.cache
def _grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs, forward and backward, and gives the right product, on ``device`` in
    ``dtype``: tried once per device and dtype (on CPU float32, bfloat16 and float16 do, float64 does not)."""
    try:
        with torch.inference_mode(False), torch.autocast(device.type, enabled=False), torch.enable_grad():
            x = torch.ones(4, 8, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(2, 8, 8, device=device, dtype=dtype, requires_grad=True)
            y = torch._grouped_mm(x, w, offs=torch.tensor([1, 4], device=device, dtype=torch.int32))
            y.backward(torch.ones_like(y))
        return bool((y == 8).all()) and bool((w.grad == torch.tensor([1, 3], device=device).view(2, 1, 1)).all())
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return False


def _grouped_mm_fits(x: Tensor, w: Tensor) -> bool:
    """Whether one ``torch._grouped_mm`` computes ``x @ w[e]`` for each expert's rows: it runs on this device and
    dtype, and every row of ``x``, ``w`` and the product is a multiple of 16 bytes at a 16-byte-aligned address
    (the kernel refuses other strides: bfloat16 with 7 features does)."""
    size = x.element_size()
    return (x.dtype == w.dtype and all(d * size % 16 == 0 for d in (x.shape[1], w.shape[2]))
            and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0 and _grouped_mm_runs(x.device, x.dtype))


def _grouped_linear(x: Tensor, w: Tensor, bias: Tensor | None, experts: Tensor, counts: Tensor) -> Tensor:
    """``x[r] @ w[experts[r]] (+ bias[experts[r]])`` for rows ``x`` sorted by expert (``counts[e]`` rows of expert
    ``e``), ``w`` ``[E, in, out]``: one grouped GEMM where :func:`_grouped_mm_fits`, else one matmul per expert
    over its contiguous rows. In :func:`_matmul_dtype`, as autocast would run a batched matmul."""
    dtype = _matmul_dtype(x)
    x, w = x.to(dtype), w.to(dtype)
    if _grouped_mm_fits(x, w):
        y = torch._grouped_mm(x, w, offs=counts.cumsum(0, dtype=torch.int32))
    else:
        rows = x.split(counts.tolist())
        y = torch.cat([r @ w[e] for e, r in enumerate(rows)])
    return y if bias is None else y + bias.to(dtype).index_select(0, experts)


def _sparse_ffn(x: Tensor, up: Tensor, down: Tensor, up_bias, down_bias, act: str, has_gate: bool,
                transposed: bool, concatenated: bool, experts: Tensor, counts: Tensor) -> Tensor:
    """Each row of ``x`` (sorted by expert) through its own expert: ``[N, h]``, the arithmetic of
    :func:`_expert_ffn` on those rows only."""
    w1 = up if transposed else up.transpose(1, 2)  # [E, h, out]
    w2 = down if transposed else down.transpose(1, 2)  # [E, f, h]
    gu = _grouped_linear(x, w1, up_bias, experts, counts)
    hid = ACTIVATIONS[act](gu) if not has_gate else _gated(gu, act, concatenated)
    return _grouped_linear(hid, w2, down_bias, experts, counts)


def _combine(y: Tensor, weights: Tensor, tokens: Tensor, n_tokens: int) -> Tensor:
    """``Σ_pairs weight · y`` into each pair's token: ``[T, h]``. The products in the dtype ``y * weight`` has (as
    the dense form's), summed in at least float32 (as a reduction over bfloat16 sums), rounded once by the caller."""
    contrib = y * weights.unsqueeze(1)
    acc = torch.promote_types(contrib.dtype, torch.float32)
    return contrib.new_zeros(n_tokens, contrib.shape[1], dtype=acc).index_add(0, tokens, contrib.to(acc))


def experts_reference(hidden, top_k_index, top_k_weights, up, down, up_bias, down_bias, act, has_gate, transposed,
                      concatenated, expert_offset: int = 0) -> Tensor:
    """Dropless: ``Σ_c w[t, c] · expert_{i[t, c]}(x[t])``, each token through its top-k experts only (the op's eager
    form, forward and recomputed backward; static output shape ``[T, h]``).

    ``up``/``down`` may hold a slice of the experts (sharded on the expert dim): experts ``expert_offset`` to
    ``expert_offset + len(up) - 1``; choices of other experts then add nothing here (this rank's share of a sum).
    The routed rows are gathered by expert, run through :func:`_sparse_ffn` and added back weighted: ``T·k`` rows
    of work at most (those of the experts held here), not ``E·T``."""
    tokens, weights, experts, counts = _route(top_k_index, top_k_weights, expert_offset, up.shape[0])
    y = _sparse_ffn(hidden.index_select(0, tokens), up, down, up_bias, down_bias, act, has_gate, transposed,
                    concatenated, experts, counts)
    return _combine(y, weights, tokens, hidden.shape[0]).to(hidden.dtype)


def _expert_ffn(x: Tensor, up: Tensor, down: Tensor, up_bias, down_bias, act: str, has_gate: bool,
                transposed: bool, concatenated: bool) -> Tensor:
    """Every expert on every token: ``[E, T, h]`` (the dense oracle's arithmetic, batched over experts)."""
    w1 = up if transposed else up.transpose(1, 2)  # [E, h, out]
    w2 = down if transposed else down.transpose(1, 2)  # [E, f, h]
    xe = x.unsqueeze(0).expand(w1.shape[0], *x.shape)
    gu = torch.bmm(xe, w1) if up_bias is None else torch.baddbmm(up_bias.unsqueeze(1), xe, w1)
    hid = ACTIVATIONS[act](gu) if not has_gate else _gated(gu, act, concatenated)
    return torch.bmm(hid, w2) if down_bias is None else torch.baddbmm(down_bias.unsqueeze(1), hid, w2)


def _gated(gu: Tensor, act: str, concatenated: bool) -> Tensor:
    if concatenated:
        gate, up = gu.chunk(2, dim=-1)
    else:
        gate, up = gu[..., 0::2], gu[..., 1::2]
    return ACTIVATIONS[act](gate) * up


def experts_dense_reference(hidden, top_k_index, top_k_weights, up, down, up_bias, down_bias, act, has_gate,
                            transposed, concatenated, expert_offset: int = 0) -> Tensor:
    """The test oracle of :func:`experts_reference`: every expert on every token, ``[E, T, h]``, then each token's
    outputs weighted by its routing (``E/k`` times the work; exact, simple, no gather). Same arguments."""
    y = _expert_ffn(hidden, up, down, up_bias, down_bias, act, has_gate, transposed, concatenated)  # [E, T, h]
    experts = torch.arange(y.shape[0], device=hidden.device) + expert_offset
    weight = ((top_k_index.unsqueeze(0) == experts.view(-1, 1, 1)) * top_k_weights.unsqueeze(0)).sum(-1)  # [E, T]
    return (y * weight.unsqueeze(-1)).sum(0).to(hidden.dtype)


@torch.library.custom_op("autoshard::hf_experts", mutates_args=())
def hf_experts(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, up: Tensor, down: Tensor,
               up_bias: Tensor | None, down_bias: Tensor | None, act: str, has_gate: bool, transposed: bool,
               concatenated: bool, expert_offset: int = 0) -> Tensor:
    with torch.no_grad():
        return experts_reference(hidden, top_k_index, top_k_weights, up, down, up_bias, down_bias, act, has_gate,
                                 transposed, concatenated, expert_offset)


@hf_experts.register_fake
def _(hidden, top_k_index, top_k_weights, up, down, up_bias, down_bias, act, has_gate, transposed, concatenated,
      expert_offset=0):
    return torch.empty_like(hidden)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*(t for t in inputs[:7] if t is not None))
    ctx.present = tuple(t is not None for t in inputs[:7])
    ctx.static = inputs[7:]
    # The op has no autocast kernel: under torch.autocast its forward's aten ops are autocast one by one (bf16
    # batched matmuls, as eager's per-expert linears). The backward recomputes them, so it recomputes them under
    # the forward's autocast state, not the backward's (outside the region, as users call it): the gradient is
    # then the gradient of what the forward computed, in eager autocast's dtypes.
    # A device autocast does not know (meta: a model built on the meta device, traced for its plan) has none.
    device_type = inputs[0].device.type
    known = torch.amp.is_autocast_available(device_type)
    ctx.autocast = (device_type, known and torch.is_autocast_enabled(device_type),
                    torch.get_autocast_dtype(device_type) if known else None)


def _backward(ctx, grad):
    saved = iter(ctx.saved_tensors)
    tensors = [next(saved) if p else None for p in ctx.present]
    diff = [i for i, t in enumerate(tensors) if t is not None and t.is_floating_point()]
    device_type, autocast, dtype = ctx.autocast
    # (the forward's state, off included: a backward called inside an autocast region recomputes as the forward ran)
    region = contextlib.nullcontext() if dtype is None else torch.autocast(device_type, dtype=dtype, enabled=autocast)
    with torch.enable_grad(), region:
        leaves = [t.detach().requires_grad_(i in diff) if t is not None else None for i, t in enumerate(tensors)]
        out = experts_reference(*leaves, *ctx.static)
        grads = torch.autograd.grad(out, [leaves[i] for i in diff], grad, allow_unused=True)
    result = [None] * 7
    for i, g in zip(diff, grads):
        result[i] = g
    return (*result, *(None,) * len(ctx.static))


hf_experts.register_autograd(_backward, setup_context=_setup)


def _static_forward(module: torch.nn.Module, block: Block):
    if block.flat:
        return _static_flat_forward(module, block)

    def forward(hidden_states, top_k_index, top_k_weights):
        up = module.gate_up_proj if block.has_gate else module.up_proj
        up_bias = (module.gate_up_proj_bias if block.has_gate else module.up_proj_bias) if block.has_bias else None
        down_bias = module.down_proj_bias if block.has_bias else None
        return torch.ops.autoshard.hf_experts(hidden_states, top_k_index, top_k_weights, up, module.down_proj,
                                              up_bias, down_bias, block.activation, block.has_gate,
                                              block.transposed, block.concatenated)

    return forward


def _static_flat_forward(module: torch.nn.Module, block: Block):
    """DBRX's experts: the flat ``[E·f, h]`` weights viewed as the stacked layout (``gate_up = [w1; v1]`` per
    expert, ``down = w2ᵀ`` per expert), the ``[batch, seq, h]`` hidden states as tokens ``[T, h]`` and back."""

    def forward(hidden_states, top_k_index, top_k_weights):
        mlp = module.mlp
        h = hidden_states.shape[-1]
        e = block.experts
        w1, v1, w2 = (w.view(e, -1, h) for w in (mlp.w1, mlp.v1, mlp.w2))  # [E, f, h]
        up = torch.cat([w1, v1], dim=1)  # [E, 2f, h]: gate rows, then up rows
        down = w2.transpose(1, 2)  # [E, h, f]
        out = torch.ops.autoshard.hf_experts(hidden_states.reshape(-1, h), top_k_index, top_k_weights, up, down,
                                             None, None, block.activation, True, False, True)
        return out.view(hidden_states.shape)

    return forward


@contextlib.contextmanager
def swapped(model: torch.nn.Module):
    """While exporting: each recognised block's experts run :func:`hf_experts` (an instance ``forward``); the
    model is restored on exit, whatever happened. Yields the :class:`Found`."""
    found = find_blocks(model)
    patched = []
    try:
        for block in found.blocks:
            experts = model.get_submodule(block.path).experts if block.path else model.experts
            had = experts.__dict__.get("forward", _MISSING)
            experts.forward = _static_forward(experts, block)
            patched.append((experts, had))
        for path, why in found.rejected:
            experts = model.get_submodule(path).experts if path else model.experts
            if isinstance(experts, torch.nn.Module) and not isinstance(
                    experts, (torch.nn.ModuleList, torch.nn.ModuleDict)) and _routed_signature(experts):
                had = experts.__dict__.get("forward", _MISSING)
                experts.forward = _explained_forward(experts.forward, path, why)
                patched.append((experts, had))
        yield found
    finally:
        for experts, had in reversed(patched):
            if had is _MISSING:
                experts.__dict__.pop("forward", None)
            else:
                experts.forward = had


_MISSING = object()


def _explained_forward(forward, path: str, why: str):
    """An experts forward autoshard did not replace (a block it does not recognise) run as it is; if it does not
    trace (the usual per-expert loop over the tokens routed to each: data-dependent shapes), a TraceError naming
    the block, why it was not recognised and what to do, with torch.export's error as its cause."""
    from autoshard.errors import TraceError

    def run(*args, **kwargs):
        try:
            return forward(*args, **kwargs)
        except Exception as e:
            where = f"`{path}`" if path else "at the top level"
            raise TraceError(
                f"sparse-MoE block {where} could not be traced: autoshard did not recognise it ({why}), so its "
                "experts ran their own forward, whose loop over the tokens routed to each expert has data-dependent "
                "shapes. Store the experts as transformers' experts interface does (stacked 3-D gate_up_proj/"
                "up_proj and down_proj, a router `gate`/`router` with weight [E, hidden] and top_k), or write the "
                "experts' forward with static shapes.") from e

    return run
