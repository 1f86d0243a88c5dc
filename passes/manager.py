"""The one pass list, from the traced graph to each rank's program, and the driver that runs and checks it.

Every step of compilation is a pass: a frozen dataclass whose fields are its options, with a ``name``, a
``phase`` and ``run(gm, ctx) -> gm``. :func:`pass_list` says, in one place, which passes run in which order for
given options::

    plan phase (once, on the global graph)            rank phase (per rank, on a copy of the global program)
    ─────────────────────────────────────             ──────────────────────────────────────────────────────
    expert_rewrite      (moe=...)                      fuse_gather_grad_sync
    mark_recompute      (recompute="<glob>")
    inline_autocast     (torch.autocast regions)
    functionalize       (in-place writes on activations as functional ops)
    seed_specs          (inputs and annotated parameters)
    cut_sequence        (context_axis=...)
    mark_requires_grad
    plan_search         (planner="search")             bucket_grad_sync      (bucket_grads=True)
    propagate                                          localize              (local shapes, local forms, shards)
                                                       balance_context       (head-tail layout, context_axis)
    mixed_precision     (precision=...)
    autocast_param_casts  (after inline_autocast)
    shard_storage       (zero=1|2|3|"auto")            follow_rank_device    (the program names no device)
    insert_collectives
    context_attention   (the context-parallel forms)
    reduce_precision    (precision reduce_dtype)
    pipeline_split      (pipeline=...)                 fuse_linears_grad_sync
    build_stages        (pipeline=...: stage graphs)   recompute             (regions → checkpointed child modules)
                                                       group_gathers         (ZeRO-3: a layer's gathers as one)

Passes exchange results only through namespaced node/graph metadata (:mod:`autoshard.meta`) — never through
another pass's state or the user's options. After every pass :func:`verify` checks autoshard's own invariants
(beyond ``graph.lint()``): once propagation has run every tensor node has a spec; once collectives are inserted
every consumer receives exactly the spec its strategy needs (in a rank program too, and in every stage graph of a
pipeline); and the rank programs of one plan (of one stage) issue the same collectives in the same order
(:func:`collective_signature`, compared across ranks by :class:`~autoshard.compiler.plan.Plan`). A failure names the
pass that broke it and the passes that ran before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.fx
from autoshard.passes.bucket_grad_sync import BucketGradSync
from autoshard.passes.insert_collectives import InsertCollectives
from autoshard.passes.context_parallel import BalanceContext, ContextAttention, CutSequence
from autoshard.passes.fuse_collectives import FuseGatherGradSync, FuseLinearsGradSync
from autoshard.passes.group_gathers import GroupGathers
from autoshard.passes.localize import Localize
from autoshard.passes.mixed_precision import (AutocastParamCasts, InlineAutocast, MixedPrecisionCasts,
                                              ReducePrecision)
from autoshard.passes.prepare import Functionalize, MarkRequiresGrad, SeedSpecs
from autoshard.passes.propagate import Propagate
from autoshard.passes.rank_device import FollowRankDevice
from autoshard.passes.recompute import MarkRecompute, Recompute
from autoshard.passes.shard_storage import ShardStorage
from torch.utils import _pytree as pytree

from autoshard import meta as M
from autoshard.compiler.collective_kinds import kind_of
from autoshard.compiler.context import Context, Options, Pinned, searches
from autoshard.errors import AutoshardError
from autoshard.frontend.graph_utils import is_tensor_node, node_leaves
from autoshard.placements import Placement

__all__ = ["Pass", "PipelineOptions", "ProgramOptions", "RankContext", "collective_signature", "pass_list",
           "run_passes", "verify"]


class Pass(Protocol):
    name: str

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule: ...


@dataclass
class RankContext(Context):
    """The context of the rank phase: the plan's context plus the rank whose program is made and the weights to
    shard (None: the global graph module's own) — or ``local_weights``, a program of this rank whose tensors the
    new program shares as they are."""

    rank: int = 0
    weights: torch.nn.Module | None = None
    bucket_grads: bool = False
    local_weights: torch.nn.Module | None = None


@dataclass(frozen=True)
class PipelineOptions:
    """What the pipeline split needs (from :class:`autoshard.compiler.pipeline.Pipeline`)."""

    stages: int
    split: Any = "auto"
    profile: Any = "cpu-gloo"
    axis: str = "pipe"
    #: what the plan search needs to bound each stage's memory (microbatches in flight under the schedule)
    microbatches: int = 1
    schedule: str = "1f1b"
    stages_per_rank: int = 1


@dataclass(frozen=True)
class ProgramOptions:
    """Options of the rank phase: ``bucket_grads`` leaves the parameters' data-parallel gradient syncs to the
    runtime's bucketer (:mod:`autoshard.passes.bucket_grad_sync`)."""

    bucket_grads: bool = False


def pass_list(options: Options, pipeline: PipelineOptions | None = None, program: ProgramOptions | None = None,
              pinned: Pinned | None = None, training: bool = True) -> dict[str, list[Pass]]:
    """The passes for these options, in order, by phase: ``{"plan": [...], "rank": [...]}`` (``pinned``: the
    layouts of another plan this one keeps, :class:`autoshard.compiler.context.Pinned`; ``training``: the mode the
    model is traced in — the search does not lay out the eval program of another plan,
    :func:`autoshard.compiler.context.searches`)."""
    from autoshard.passes.expert_rewrite import ExpertRewrite
    from autoshard.passes.pipeline_split import BuildStages, PipelineSplit
    from autoshard.passes.plan_search import PlanSearch

    program = program or ProgramOptions()
    mp = options.precision
    search = searches(options, pinned, training)
    # the search bounds each stage's memory where a memory limit binds it: its stages are fixed before it, and the
    # split cuts there (PlanSearch.pipeline, plan_search.staged_cuts)
    staged = search and pipeline is not None and options.memory_limit is not None
    plan = [
        ExpertRewrite() if getattr(options, "moe", None) is not None else None,
        MarkRecompute(options.recompute) if options.recompute not in (None, "auto") else None,
        InlineAutocast(),
        Functionalize(),
        SeedSpecs(),
        CutSequence() if options.context_parallel is not None else None,
        MarkRequiresGrad(),
        PlanSearch(profile=options.profile, memory_limit=options.memory_limit, optimizer=options.optimizer,
                   pipeline=pipeline if staged else None, **_search_time(options))
        if search else None,
        Propagate(),
        MixedPrecisionCasts(mp.param_dtype, mp.output_dtype) if mp else None,
        AutocastParamCasts(),
        ShardStorage() if options.zero != 0 or (pinned is not None and pinned.storage) else None,
        InsertCollectives(),
        ContextAttention(),
        ReducePrecision(mp.param_dtype, mp.grad_reduce_dtype) if mp else None,
        PipelineSplit(pipeline.stages, pipeline.split, pipeline.profile, pipeline.axis,
                      staged=pipeline if staged else None) if pipeline else None,
        BuildStages() if pipeline else None,
    ]
    rank = [
        FuseGatherGradSync(),
        BucketGradSync() if program.bucket_grads else None,
        Localize(),
        BalanceContext(),
        FollowRankDevice(),
        FuseLinearsGradSync(),
        Recompute(),
        GroupGathers(),
    ]
    return {"plan": [p for p in plan if p is not None], "rank": [p for p in rank if p is not None]}


def _search_time(options: Options) -> dict:
    """PlanSearch's ``time_limit`` and ``accept_gap`` where the options give them (left out otherwise: the pass's
    own defaults)."""
    out = {}
    if options.search_time_limit is not None:
        out["time_limit"] = float(options.search_time_limit)
    if options.search_accept_gap is not None:
        out["accept_gap"] = float(options.search_accept_gap)
    return out


def run_passes(gm: torch.fx.GraphModule, ctx: Context, passes: list[Pass], ran: tuple[str, ...] = ()
               ) -> torch.fx.GraphModule:
    """Run ``passes`` in order, verifying after each; errors name the pass and the ones before it."""
    done = list(ran)
    for p in passes:
        try:
            gm = p.run(gm, ctx)
            gm.graph.lint()
            verify(gm, done + [p.name])
        except AutoshardError:
            raise
        except Exception as e:
            raise AutoshardError(f"An error occurred when running the '{p.name}' pass after the following passes: "
                                 f"{done or 'none'}: {type(e).__name__}: {e}") from e
        done.append(p.name)
    gm.meta[M.PASSES_RUN] = tuple(done)
    return gm


# ---- the verifier -----------------------------------------------------------------------------------------
def verify(gm: torch.fx.GraphModule, ran: list[str]) -> None:
    """autoshard's invariants for a graph after the passes ``ran`` (the last one is blamed for a failure): the
    global program's, then a rank program's (after ``localize``), and every stage graph's (after ``build_stages``)."""
    last = ran[-1]
    if "propagate" in ran:
        for node in gm.graph.nodes:
            if (node.op in ("call_function", "get_attr", "placeholder")
                    and isinstance(node.meta.get("val"), torch.Tensor) and M.SPEC not in node.meta):
                raise AutoshardError(f"pass '{last}' left node `{node.name}` ({node.target}) without a spec "
                                         f"(after passes {ran}): every tensor node must have one.")
    # localize drops the global FakeTensors (their shapes are not this rank's) and keeps specs and strategies: in a
    # rank program the tensors are the nodes whose spec is one placement per axis (a multi-output op has a tuple).
    # A node reading a value made by an op's local form (``bias_once``: no spec of its own) is not checked.
    local = "localize" in ran
    if "insert_collectives" in ran:
        for node in gm.graph.nodes:
            strat = node.meta.get(M.STRATEGY)
            if strat is None or kind_of(node) is not None:
                continue
            if local and not all(M.SPEC in x.meta for x in node.all_input_nodes):
                continue
            leaves = [x for x in node_leaves(node) if (_has_tensor_spec(x) if local else is_tensor_node(x))]
            for i, (x, want) in enumerate(zip(leaves, strat.input_specs)):
                have = x.meta.get(M.SPEC)
                if want is not None and have != want:
                    raise AutoshardError(f"pass '{last}' left node `{node.name}` ({node.target}) reading input "
                                         f"{i} `{x.name}` as {have}, but its strategy needs {want} (after passes "
                                         f"{ran}).")
    for stage in gm.meta.get(M.STAGE_GRAPHS, ()):
        verify(stage.gm, ran)


def _has_tensor_spec(x) -> bool:
    spec = x.meta.get(M.SPEC) if isinstance(x, torch.fx.Node) else None
    return isinstance(spec, tuple) and all(isinstance(p, Placement) for p in spec) and bool(spec)


def collective_signature(gm: torch.fx.GraphModule) -> tuple:
    """The collectives a program issues, in order, as ``(kind, arguments but the tensors)``: equal on every rank of
    a plan, or ranks would wait on each other forever."""
    sig = []
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(region := getattr(gm, str(node.target), None), torch.fx.GraphModule):
            sig.extend(collective_signature(region))  # a recomputed region's collectives (passes/recompute.py)
        k = kind_of(node)
        if k is not None:
            sig.append((k.name, tuple(a for a in pytree.tree_leaves(node.args) if not isinstance(a, torch.fx.Node))))
    return tuple(sig)
