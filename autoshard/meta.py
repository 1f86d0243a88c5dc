"""Every ``node.meta`` key autoshard writes, and the frozen values stored under them.

Passes communicate only through these keys: no pass reads another pass's private state or writes the context's
report (what a pass records for the user goes to :data:`PLAN_REPORT`), and nothing is hung on nodes or modules as
ad-hoc attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autoshard.placements import Spec

#: Output spec of a node: a ``Spec`` (one placement per mesh axis) or, for multi-output ops, a tuple of them.
SPEC = "autoshard.spec"
#: The chosen :class:`Strategy` of a call_function node (what each tensor input must look like).
STRATEGY = "autoshard.strategy"
#: Why the strategy was chosen: a :class:`Decision`.
DECISION = "autoshard.decision"
#: On nodes inserted by the collectives pass: a :class:`CollectiveInfo`.
COLLECTIVE = "autoshard.collective"
#: On get_attr nodes: the parameter/buffer's fully-qualified name in the original model.
PARAM = "autoshard.param"
#: On get_attr nodes: every name the tensor has in the original model (tied weights have several).
ALIASES = "autoshard.aliases"
#: On ``gm.meta``: the names of the passes that made this graph, in order (passes/manager.py).
PASSES_RUN = "autoshard.passes_run"
#: On ``gm.meta``: the pipeline split's result, a ``StageSplit`` (passes/pipeline_split.py).
STAGE_SPLIT = "autoshard.stage_split"
#: On ``gm.meta``: one global GraphModule per pipeline stage, a tuple of ``StageGraph`` (passes/pipeline_split.py,
#: the ``build_stages`` pass); each stage's rank programs are made from it by the rank phase.
STAGE_GRAPHS = "autoshard.stage_graphs"
#: On ``gm.meta``: the expert rewrite's result, an :class:`autoshard.compiler.moe.MoERewrite`
#: (passes/expert_rewrite.py).
MOE_REWRITE = "autoshard.moe_rewrite"
#: On ``gm.meta``: annotations implied by a pass for parameters it created, a tuple of ``(pattern, Spec)`` (the
#: expert rewrite's ``Shard(0)`` on the expert axis). Propagation seeds them before the user's annotations, which
#: may override them; the user's options are never rewritten.
IMPLIED_ANNOTATIONS = "autoshard.implied_annotations"
#: bool: whether autograd will produce a gradient for this value (decides where backward collectives go).
REQUIRES_GRAD = "autoshard.requires_grad"
#: On nodes whose spec the user annotated (parameters and inputs): the annotation's pattern (a str). An annotated
#: parameter is a hard constraint for both planners: every consumer takes it in exactly that layout.
ANNOTATED = "autoshard.annotated"
#: On call_function nodes: the :class:`Strategy` decided before propagation (by the plan search, or by a test
#: that forces one); propagation applies it instead of choosing. A strategy the node's rule does not allow is refused.
PLANNED = "autoshard.planned_strategy"
#: Who wrote :data:`PLANNED` (a str, the pass name): ``"plan_search"`` drew it from the node's own rule options
#: (:func:`passes.propagate.node_strategies`), so propagation does not enumerate them again to check it.
PLANNED_BY = "autoshard.planned_by"
#: On get_attr nodes of parameters: the ZeRO stage chosen for the parameter's storage (an int 0-3), written by the
#: plan search under ``zero="auto"`` and read by the ``shard_storage`` pass (which applies ``Options.zero`` otherwise).
PLANNED_ZERO = "autoshard.planned_zero"
#: On get_attr nodes of parameters, after ``shard_storage``: a :class:`Storage` (stage, compute spec, stored spec).
STORAGE = "autoshard.storage"
#: On call_function nodes: the id (a str, the module path) of the recomputation region the node belongs to; its
#: activations are recomputed in backward, not saved (passes/recompute.py). Written by trace (the model's own
#: torch.utils.checkpoint regions), by the ``recompute=`` glob and by the plan search under ``recompute="auto"``.
RECOMPUTE = "autoshard.recompute"
#: On the cast nodes of mixed precision (passes/mixed_precision.py): True on ``_to_copy(master, dtype=param_dtype)``
#: after a parameter or floating input; the ZeRO pass moves a parameter's data-axis storage shard through it.
PRECISION_CAST = "autoshard.precision_cast"
#: On op nodes inlined from a ``torch.autocast`` region (passes/mixed_precision.py): the casts autocast applies to
#: the op's parameter inputs, ``((flat argument index, dtype), ...)``, inserted after propagation (the parameter,
#: not a cast of it, is what the planners see the op consume).
AUTOCAST_CASTS = "autoshard.autocast_casts"
#: On a parameter node that mixed precision never casts (passes/mixed_precision.py ``casts``): True on the router
#: weight of an MoE layer autoshard builds (passes/expert_rewrite.py), which computes in float32 under every policy.
KEEP_DTYPE = "autoshard.keep_dtype"
#: On call_function nodes with no sharding rule, under ``on_unsupported="replicate"``: where the op is (a str),
#: written when its strategies are enumerated (``passes.propagate.node_strategies``, whichever pass does it first);
#: such an op runs replicated, and propagation lists every one in one warning and in the report's ``"unsupported"``.
NO_RULE = "autoshard.no_rule"
#: On ``gm.meta`` of the plan: ``{section: plain data}``, what the plan phase's passes record for the user — each
#: pass its own section (its name; propagation also ``"axis_use"`` and ``"unsupported"``), written, never read, by
#: passes (:func:`plan_report`). ``build_plan`` makes the plan's report (``Plan.context.report``) from it.
PLAN_REPORT = "autoshard.plan_report"

# ---- graph-module keys (``gm.meta``) and annotation keys of the trace and the runtime --------------------------
#: ``gm.meta`` of a traced graph: container path -> [traced layer index, copied layer indices...]
#: (autoshard/frontend/layer_reuse.py; absent when every layer was exported).
REUSED_LAYERS = "autoshard.reused_layers"
#: Key in a node's ``meta["custom"]`` (``torch.fx.traceback.annotate``) while tracing: the number of the model's
#: ``torch.utils.checkpoint`` call that made the op; the trace turns it into :data:`RECOMPUTE`.
CHECKPOINT_CALL = "autoshard.checkpoint_call"
#: ``gm.meta`` of a traced graph: the Hugging Face sparse-MoE blocks found while tracing, and why other candidates
#: were not taken (an :class:`autoshard.frontend.hf_blocks.Found`).
HF_MOE_BLOCKS = "autoshard.hf_moe_blocks"
#: ``gm.meta`` of a rank program: ``((parameter attribute name, axes), ...)`` whose gradient sync codegen left out
#: of the graph, for the runtime's bucketed all-reduce (autoshard/runtime/buckets.py).
GRAD_SYNC = "autoshard.grad_sync"
#: ``gm.meta`` of a rank program, cached by the runtime: whether it gathers ZeRO-3 parameters that are resharded
#: after forward (autoshard/runtime/zero.py).
RESHARDS = "autoshard.reshards"


@dataclass(frozen=True)
class Storage:
    """How a parameter is stored apart from how it is computed with (ZeRO/FSDP): ``stage`` 0 stores it in its
    compute layout; 1-3 store it additionally sharded over the data axis (``stored``) and all-gather it to
    ``compute`` for use — 1: gradient all-reduced then sliced; 2: gradient reduce-scattered, gathered copy kept from
    forward to backward; 3: as 2, but the gathered copy is freed after forward use and gathered again in backward."""

    stage: int
    compute: tuple
    stored: tuple
    axis: str = "data"


@dataclass(frozen=True)
class Strategy:
    """One way to run an op: the spec every tensor input must have and the spec of the output.

    ``input_specs`` lists specs for the node's tensor inputs in ``flat_tensor_inputs`` order (None where an
    input is not a tensor). ``grad_sync`` lists, per tensor input, the mesh axes on which the input is
    replicated while the op's result is not: the backward of such an input must be all-reduced over those axes.
    """

    input_specs: tuple[Spec | None, ...]
    output_spec: Spec | tuple[Spec, ...]
    grad_sync: tuple[tuple[str, ...], ...] = ()
    note: str = ""


@dataclass(frozen=True)
class Decision:
    """What the planner chose for a node, its estimated cost and the best alternative it rejected."""

    cost: float
    alternative: Strategy | None = None
    alternative_cost: float | None = None
    reason: str = ""


@dataclass(frozen=True)
class CollectiveInfo:
    """An inserted redistribution: ``kind`` on mesh ``axis`` (tensor dims involved in ``dims``)."""

    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all | local_slice | grad_all_reduce
    axes: tuple[str, ...]
    dims: tuple[int, ...] = ()
    src: Spec | None = None
    dst: Spec | None = None
    bytes_forward: int = 0
    bytes_backward: int = 0
    extra: tuple = field(default_factory=tuple)


def plan_report(gm) -> dict:
    """``gm.meta[PLAN_REPORT]``, made empty if absent: where a pass records its section of the plan report."""
    return gm.meta.setdefault(PLAN_REPORT, {})


def module_path(node) -> str:
    """Innermost module path of a node (from ``nn_module_stack``), '' at the top level."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return clean_path(path)


def clean_path(path: str) -> str:
    # torch.export writes paths like "L['self'].transformer.h[0].mlp" or "transformer.h.0.mlp" by version.
    path = path.replace("L['self'].", "").replace("L['self']", "")
    out = []
    for part in path.replace("]", "").replace("[", ".").split("."):
        part = part.strip("'\"")
        if part:
            out.append(part)
    return ".".join(out)

#: The file that commits an autoshard checkpoint directory (written last; a directory without it is incomplete).
CHECKPOINT_MARKER = "autoshard.json"

#: On ``gm.meta``: the context-parallel layout of the sequence (passes/context_parallel.py), a :class:`ContextLayout`.
CONTEXT = "autoshard.compiler.context"


@dataclass(frozen=True)
class ContextLayout:
    """The sequence sharded on ``axis``: head-tail chunks when ``balance``; ``attention`` the local form asked for
    (None: the planner's choice); ``inputs``: the input names cut along the sequence in the program."""

    axis: str
    balance: bool
    attention: str | None
    inputs: tuple[str, ...] = ()

#: On a rank program's ``GraphModule.meta``: whether it changes nothing outside its outputs before its first
#: collective, so the per-call agreement check may run during that compute (a bool, cached by
#: :func:`autoshard.runtime.agreement.quiet_until_collective`).
QUIET_UNTIL_COLLECTIVE = "autoshard.quiet_until_collective"

#: On a rank program's ``GraphModule.meta``: whether the per-call agreement check is carried by the program's first
#: collective (a small host all-reduce), cached by :mod:`autoshard.runtime.agreement`.
FIRST_COLLECTIVE_CARRIES = "autoshard.first_collective_carries"
