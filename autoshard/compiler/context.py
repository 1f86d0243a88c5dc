"""What every pass receives besides the graph: the mesh, the user's options, and the report of decisions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autoshard.mesh import Mesh
from autoshard.placements import Spec


@dataclass(frozen=True)
class Options:
    """User options of ``autoshard.compile`` that the passes read.

    ``annotations`` maps glob patterns over parameter FQNs (or exact input names) to specs; later patterns
    override earlier ones. ``data_axis`` is the axis the batch dim of inputs is sharded on by default.
    """

    annotations: tuple[tuple[str, Spec], ...] = ()
    data_axis: str = "data"
    on_unsupported: str = "replicate"  # replicate (default: unsupported ops run replicated, one warning) | error
    planner: str = "greedy"  # greedy (fewest bytes, op by op) | search (ILP over the cost model; reports its gap)
    profile: Any = "cpu-gloo"  # hardware profile name, path or HardwareProfile
    memory_limit: float | None = None  # bytes per rank
    optimizer: str = "adam"  # for the optimizer-state term of the memory model
    #: planner="search": seconds for the whole search (None: 120, passes/plan_search DEFAULT_TIME_LIMIT); when it
    #: runs out the best plan found is used, with its gap warned about. A memory_limit no plan meets is refused
    #: before the search's walk, in seconds (passes/plan_search/lagrangian.py PROOF_SECONDS), whatever this is.
    search_time_limit: float | None = None
    #: planner="search": a plan this close to the lower bound (a fraction) is taken without the exact ILP (None:
    #: PlanSearch.accept_gap, 0.01)
    search_accept_gap: float | None = None
    #: greedy planner: among strategies of equal communication, prefer the output with fewer replicated axes
    #: (norms, residuals, dropout sharded along the sequence: Megatron's sequence parallelism)
    sequence_parallel: bool = False
    moe: Any = None  # autoshard.MoE: dense FFNs to rewrite as Mixture-of-Experts layers (passes/expert_rewrite.py)
    #: ZeRO/FSDP storage of parameters over the data axis (passes/shard_storage.py): 0 | 1 | 2 | 3 for every
    #: parameter (a plan with :class:`Pinned` storage keeps each parameter's stage instead), or "auto" (planner="search"
    #: picks a stage per parameter under memory_limit; compile's default when the search has a memory_limit:
    #: autoshard.api.sharded_module.memory_defaults)
    zero: int | str = 0
    #: activation recomputation (passes/recompute.py): None (only the model's own torch.utils.checkpoint regions),
    #: a glob over module paths ("model.layers.*"), or "auto" (planner="search" picks the layers; compile's default
    #: when the search has a memory_limit)
    recompute: str | None = None
    #: autoshard.MixedPrecision(param_dtype, reduce_dtype, output_dtype) or None (the model's own dtypes)
    precision: Any = None
    #: autoshard.ContextParallel (plan's ``context_parallel``): the sequence sharded on that axis, attention
    #: context-parallel (passes/context_parallel.py); None: only where annotations or the search shard it
    context_parallel: Any = None


@dataclass(frozen=True)
class Pinned:
    """The parameter layouts of another plan that a plan keeps, so that its program shares that plan's tensors (the
    program of a ShardedModule's other training mode, or of inputs of new shapes): an input of :func:`build_plan`
    beside the user's options, never folded into them.

    ``layouts``: (exact parameter name, compute spec): laid out as given, as an annotation lays a parameter out, but
    gathered or sliced for compute where this plan's ops need another layout (an annotated parameter never is).
    ``storage``: (exact parameter name, ZeRO stage): each parameter stored as the other plan stores it (passes/
    shard_storage.py reads it in place of ``Options.zero``)."""

    layouts: tuple[tuple[str, Spec], ...] = ()
    storage: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of_plan(cls, plan) -> "Pinned":
        """Every parameter and buffer of ``plan`` (a :class:`~autoshard.compiler.plan.Plan`) in its compute layout,
        stored at the plan's ZeRO stage: a layout, not an annotation, since a searched plan may gather a parameter
        for compute (an annotated one never is)."""
        specs = plan.param_specs()
        storage = plan.param_storage()
        compute = {name: storage[name].compute if name in storage else spec for name, spec in specs.items()}
        return cls(layouts=tuple(compute.items()), storage=tuple((name, st.stage) for name, st in storage.items()))


def zero_axis(options: Options, mesh: Mesh) -> str:
    """The mesh axis ZeRO stores parameters sharded over: the data axis; where context parallelism runs on a mesh
    without a data axis of size > 1, the context axis (its ranks hold the same parameters and sum their gradients,
    as torchtitan's FSDP shards over ``dp_shard × cp``)."""
    cp = options.context_parallel
    return zero_axis_of(mesh, options.data_axis, cp.axis if cp is not None else None)


def zero_axis_of(mesh: Mesh, data_axis: str, context_axis: str | None) -> str:
    """:func:`zero_axis` from the axis names: ``context_axis`` where it is on ``mesh`` and ``data_axis`` is not (or
    has size 1), else ``data_axis``."""
    if context_axis is not None and context_axis in mesh.names and not (
            data_axis in mesh.names and mesh.axis_size(data_axis) > 1):
        return context_axis
    return data_axis


def searches(options: Options, pinned: Pinned | None = None, training: bool = True) -> bool:
    """Whether the plan search lays a plan out: where the options ask for it (``planner="search"``), except for the
    eval-mode program of another plan (``pinned``, ``training`` false). There every parameter and buffer is pinned
    and nothing is saved for backward, so memory is the pinned weights' plus one layer's activations: propagation
    lays the activations out op by op in a fraction of the search's time (a generation loop plans a new length per
    token). Read by the pass list and by the plan's memory check, so both agree."""
    return options.planner == "search" and (pinned is None or training)


@dataclass
class Context:
    """The mesh, the options, the report and the warnings. Passes hand decisions to each other only through
    ``node.meta`` keys (:mod:`autoshard.meta`), never through fields here."""

    mesh: Mesh
    options: Options = field(default_factory=Options)
    report: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    #: ``once(decide)``: the value of ``decide()`` as the whole job sees it — computed on rank 0 and received by every
    #: rank when this plan is made by every rank of a job at once (:func:`autoshard.runtime.agreement.decide_once`),
    #: else ``decide()`` here. Passes whose result may depend on time or load (the time-limited search) decide
    #: through it, so every rank runs one plan.
    once: Any = None
    #: the layouts of another plan this one keeps (:class:`Pinned`), or None
    pinned: Pinned | None = None

    def decide_once(self, decide):
        return decide() if self.once is None else self.once(decide)

    def warn(self, message: str) -> None:
        """Note ``message`` in the report, and warn about it on rank 0 (:func:`autoshard.runtime.notices.notice`): every
        rank of a job makes the same plan."""
        from autoshard.runtime.notices import notice

        self.warnings.append(message)
        notice(message, stacklevel=4)
