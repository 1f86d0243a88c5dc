"""Pipeline split: cut the annotated global graph into ``p`` stages balanced by the cost model.

Two passes of the plan phase, the last ones of the pass list when a pipeline is asked for. They run after
:class:`~autoshard.passes.insert_collectives.InsertCollectives`, on the graph planned over the mesh *without* its
pipeline axis (so every stage carries its own data/model sharding and collectives):

* :class:`PipelineSplit` (``pipeline_split``) is an analysis: it leaves the graph unchanged and stores a
  :class:`StageSplit` on ``gm.meta[autoshard.meta.STAGE_SPLIT]`` (and in the plan report's ``"pipeline_split"``,
  ``gm.meta[autoshard.meta.PLAN_REPORT]``);
* :class:`BuildStages` (``build_stages``) is the structural rewrite: one global GraphModule per stage
  (:func:`build_stage_graphs`, copying ``node.meta`` and the graph's own metadata), stored as a tuple of
  :class:`StageGraph` on ``gm.meta[autoshard.meta.STAGE_GRAPHS]``. The driver verifies every stage graph after it;
  each stage's rank programs are then made from it by the rank phase (``Plan.rank_program(rank, stage=s)``).

Formulation. Nodes fall in two kinds:

* *recomputable*: functions of the parameters alone (the data-axis gradient sync of a tied embedding, a bias
  scaled for a Partial output, ``arange``), and values no gradient flows through whose inputs are inputs of the
  model, parameters or other recomputable nodes (causal masks, rotary tables, views of the labels). Every stage
  that reads one recomputes it, so they never cross a stage boundary (integer tensors, which
  ``torch.distributed.pipelining`` cannot send with a gradient, stay local; a weight used by two stages is held
  by both, its gradients summed after the backward);
* the others, in graph order ``v_0 .. v_{N-1}`` (:func:`_analyse`). A cut at position ``i`` puts ``v_0..v_{i-1}``
  before it; the tensors *crossing* it are those produced before ``i`` and read at or after ``i``: besides the
  hidden state, a residual stream or any skip connection is simply one more crossing tensor, and a tensor
  crossing several cuts passes through the stages in between.

Cut candidates are the positions where the module *unit* changes (the path up to the first numbered
component, ``transformer.h.3``, else the innermost module path) and every crossing value is a floating tensor.
A stage ``[a, b)`` costs, per microbatch, ``C(a, b) = Σ (seconds of its nodes) + T(a) + T(b)``, each node priced
as ``plan.cost()`` prices it (:func:`autoshard.cost_models.plan_cost.node_time`: forward + backward, a recomputed
op's or collective's forward again, a collective's time on its axes), where ``T(i)`` sends the crossing tensors
forward and their gradients back over the pipe link (``2 · (α · count + β · bytes)``, zero at the ends). A
parameter's gradient sync that the stage programs leave to the runner (once per step, ``bucket_grads``) and its
optimizer step are not per microbatch: they are the stage's ``once`` seconds. Embeddings, the LM head and the loss
are nodes like any other, so they are part of the balance. The split minimises ``max_k C(stage k)`` (then the
total transfer) by dynamic programming over the candidates (:func:`_best_cuts`):
``D[k][j] = min_{i<j} max(D[k-1][i], C(c_i, c_j))``, exact for this chain of cut points. Manual cut points
(module paths, each starting a stage) replace the search (:func:`_manual_cuts`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.fx

from autoshard import meta as M
from autoshard.compiler.context import Context
from autoshard.errors import PlanError
from autoshard.mesh import Mesh
from autoshard.placements import local_shape

REPORT_KEY = "pipeline_split"


@dataclass(frozen=True)
class Boundary:
    """The tensors crossing one cut: node names, local shapes (per microbatch, on one rank), dtypes, bytes."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    nbytes: int


@dataclass(frozen=True)
class StageSplit:
    """Where the graph is cut and what each stage costs (seconds per microbatch, forward + backward)."""

    cuts: tuple[int, ...]  # positions in ``order`` where stages 1..p-1 start
    order: tuple[str, ...]  # the cuttable (non-recomputable) nodes in graph order
    boundaries: tuple[Boundary, ...]  # one per cut
    compute: tuple[float, ...]  # per stage: compute and communication seconds per microbatch (forward + backward)
    transfer: tuple[float, ...]  # per stage: seconds sending/receiving its boundaries
    modules: tuple[tuple[str, ...], ...]  # per stage: the module units it holds, in order
    manual: bool = False
    #: per stage: seconds once per step — its parameters' gradient syncs left to the runner and optimizer steps
    once: tuple[float, ...] = ()

    @property
    def stages(self) -> int:
        return len(self.cuts) + 1

    @property
    def costs(self) -> tuple[float, ...]:
        return tuple(c + t for c, t in zip(self.compute, self.transfer))

    @property
    def imbalance(self) -> float:
        """max / mean stage cost (1.0 is perfect balance)."""
        costs = self.costs
        mean = sum(costs) / len(costs)
        return max(costs) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class PipelineSplit:
    """Cut into ``stages`` stages: ``split="auto"`` searches, a tuple of module paths cuts there."""

    stages: int
    split: str | tuple[str, ...] = "auto"
    profile: str = "cpu-gloo"
    pipe_axis: str = "pipe"
    #: the pipeline the plan search bounded each stage's memory of (its PipelineOptions; None: it bounded the whole
    #: model's): ``split="auto"`` then cuts where the search fixed the stages (the layers dealt out evenly,
    #: :func:`autoshard.passes.plan_search.staged_cuts`), so that the stages are those it priced
    staged: object = None
    name: str = "pipeline_split"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        from autoshard.passes.plan_search import staged_cuts

        cuts = staged_cuts(gm, self.staged) if self.split == "auto" and self.staged is not None else None
        split = split_graph(gm, ctx.mesh, self.stages, self.split if cuts is None else cuts, self.profile,
                            self.pipe_axis, ctx.options.optimizer, manual=self.split != "auto")
        gm.meta[M.STAGE_SPLIT] = split
        M.plan_report(gm)[REPORT_KEY] = split
        return gm


@dataclass(frozen=True)
class BuildStages:
    """One global GraphModule per stage of the split ``pipeline_split`` stored on ``gm`` (:func:`build_stage_graphs`),
    kept on ``gm.meta[autoshard.meta.STAGE_GRAPHS]``; ``gm`` itself is unchanged."""

    name: str = "build_stages"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        gm.meta[M.STAGE_GRAPHS] = tuple(build_stage_graphs(gm, stage_split_of(gm)))
        return gm


def stage_split_of(gm: torch.fx.GraphModule) -> StageSplit:
    """The :class:`StageSplit` the pipeline_split pass stored on ``gm``."""
    return gm.meta[M.STAGE_SPLIT]


def stage_graphs_of(gm: torch.fx.GraphModule) -> tuple[StageGraph, ...]:
    """The :class:`StageGraph` of every stage, as the build_stages pass stored them on ``gm`` (empty: no pipeline)."""
    return gm.meta.get(M.STAGE_GRAPHS, ())


# ---- analysis ---------------------------------------------------------------------------------------------
@dataclass
class Analysis:
    """Everything the search needs, computed once (:func:`analyse`)."""

    order: list[torch.fx.Node]
    recomputable: set[torch.fx.Node]
    node_cost: list[float]  # per order position: seconds per microbatch
    candidates: list[int]  # valid cut positions, increasing
    crossing: list[list[torch.fx.Node]]  # crossing[i] for i in 0..N
    transfer: list[float]  # T(i) for i in 0..N (0 at both ends)
    units: list[str]
    mesh: Mesh
    also: list[list[str]]  # per order position: units of the recomputed nodes it is the first to read
    once: list[float] | None = None  # per order position: seconds once per step (gradient syncs, optimizer steps)
    reads_param: list[bool] | None = None  # per order position: it (or a recomputed node it runs) reads a parameter

    @property
    def n(self) -> int:
        return len(self.order)

    def prefix(self) -> list[float]:
        out = [0.0]
        for c in self.node_cost:
            out.append(out[-1] + c)
        return out

    def stage_cost(self, prefix: list[float], a: int, b: int) -> float:
        return prefix[b] - prefix[a] + self.transfer[a] + self.transfer[b]

    def holds_params(self, a: int, b: int) -> bool:
        """Whether a stage over order positions ``[a, b)`` reads a parameter (holds one to train)."""
        return self.reads_param is None or any(self.reads_param[a:b])

    def costs_of(self, cuts) -> list[float]:
        """Per-stage cost of a split given by its cut positions (what the search minimises the max of)."""
        prefix = self.prefix()
        edges = [0, *cuts, self.n]
        return [self.stage_cost(prefix, a, b) for a, b in itertools.pairwise(edges)]


def unit_of(node: torch.fx.Node) -> str:
    """The module unit of a node: its path up to the first numbered component, else its innermost path."""
    path = M.module_path(node)
    if not path and M.COLLECTIVE in node.meta and node.users:
        return unit_of(next(iter(node.users)))  # inserted collectives belong with their consumer
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return path


def _local_bytes(node: torch.fx.Node, mesh: Mesh) -> tuple[tuple[int, ...], int]:
    val = node.meta["val"]
    spec = node.meta.get(M.SPEC)
    shp = tuple(local_shape(val.shape, spec, mesh)) if spec else tuple(val.shape)
    return shp, math.prod(shp) * val.element_size()


def _node_time(node: torch.fx.Node, mesh: Mesh, profile, rerun=frozenset()) -> tuple[float, float]:
    """(per microbatch, per step) seconds of one node, as ``plan.cost()`` prices it
    (:func:`autoshard.cost_models.plan_cost.node_time`): the gradient sync of a parameter that the stage programs
    leave to the runner's sync once per step (``bucket_grads``: the parameters
    :func:`autoshard.passes.bucket_grad_sync.param_of_sync`) per step, everything else per microbatch."""
    from autoshard.cost_models.plan_cost import node_time
    from autoshard.passes.bucket_grad_sync import param_of_sync

    t = sum(node_time(node, mesh, profile, rerun))
    return (0.0, t) if param_of_sync(node) is not None else (t, 0.0)


def analyse(gm: torch.fx.GraphModule, mesh: Mesh, profile, pipe_link=None, optimizer: str = "adam") -> Analysis:
    """The cut-point problem of ``gm`` planned over ``mesh`` (the non-pipe axes), priced by ``profile`` as
    ``plan.cost()`` prices it (``optimizer``: the optimizer step of each parameter, once per step); stage transfers
    go over ``pipe_link`` (default: the profile's link)."""
    from autoshard.cost_models.plan_cost import parameter_optimizer_time, rerun_nodes

    pipe_link = pipe_link or profile.link
    recomputable: set[torch.fx.Node] = set()
    weights_only: set[torch.fx.Node] = set()  # functions of parameters alone (a grad sync of a tied weight)
    order: list[torch.fx.Node] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if all(x.op == "get_attr" or x in weights_only for x in node.all_input_nodes):
            weights_only.add(node)
            recomputable.add(node)
            continue
        leaves_ok = all(x.op in ("placeholder", "get_attr") or x in recomputable for x in node.all_input_nodes)
        if leaves_ok and not node.meta.get(M.REQUIRES_GRAD):
            recomputable.add(node)
        else:
            order.append(node)
    pos = {n: i for i, n in enumerate(order)}
    n = len(order)
    last_use: dict[torch.fx.Node, int] = {}
    for node in order:
        uses = [pos.get(u, n) for u in node.users if u.op != "call_function" or u in pos]
        last_use[node] = max(uses, default=pos[node])
    crossing: list[list[torch.fx.Node]] = []
    live: list[torch.fx.Node] = []
    for i in range(n + 1):
        if i > 0:
            live.append(order[i - 1])
        live = [v for v in live if last_use[v] >= i]
        crossing.append(list(live) if 0 < i < n else [])
    transfer = []
    for i, cross in enumerate(crossing):
        nbytes = sum(_local_bytes(v, mesh)[1] for v in cross if isinstance(v.meta.get("val"), torch.Tensor))
        transfer.append(2 * (pipe_link.alpha * len(cross) + pipe_link.beta * nbytes) if cross else 0.0)
    rerun = rerun_nodes(gm)
    times = {v: _node_time(v, mesh, profile, rerun) for v in gm.graph.nodes if v.op == "call_function"}
    node_cost = [times[v][0] for v in order]
    once = [times[v][1] for v in order]
    units = [unit_of(v) for v in order]
    # A recomputed node (an embedding of positions, a mask) is priced and listed with its first reader, so
    # embeddings and heads stay part of the balance and of the report (one read by no cut node, with the last:
    # what the step runs is priced once, as plan.cost() prices it).
    also: list[list[str]] = [[] for _ in order]
    first: dict[torch.fx.Node, int] = {}
    for r in reversed([v for v in gm.graph.nodes if v in recomputable]):
        uses = [pos[u] if u in pos else first.get(u, n) for u in r.users if u in pos or u in recomputable]
        first[r] = min(uses, default=n)
        if first[r] < n and unit_of(r):
            also[first[r]].append(unit_of(r))
        if n:
            node_cost[min(first[r], n - 1)] += times[r][0]
            once[min(first[r], n - 1)] += times[r][1]
    reads_param = [False] * n
    for p in gm.graph.nodes:  # each parameter's optimizer step, with its first reader's stage
        if p.op == "get_attr" and n:
            readers = [pos[u] if u in pos else first.get(u, n) for u in p.users]
            once[min(min(readers, default=n), n - 1)] += parameter_optimizer_time(p, mesh, profile, optimizer)
            for r in readers:
                reads_param[min(r, n - 1)] = True
    candidates = [i for i in range(1, n) if units[i] != units[i - 1] and _cuttable(crossing[i])]
    return Analysis(order, recomputable, node_cost, candidates, crossing, transfer, units, mesh, also, once,
                    reads_param)


def _cuttable(cross: list[torch.fx.Node]) -> bool:
    if not cross:
        return False
    for v in cross:
        val = v.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point or not v.meta.get(M.REQUIRES_GRAD):
            return False
    return True


# ---- search -----------------------------------------------------------------------------------------------
def _best_cuts(a: Analysis, stages: int) -> list[int]:
    """Exact DP over the candidate cuts minimising (max stage cost, total transfer), every stage holding a parameter
    (a stage of parameter-free ops alone, such as the loss after a head, idles its ranks' optimizer: torch's
    optimizers refuse an empty parameter list)."""
    prefix = a.prefix()
    points = [0, *a.candidates, a.n]
    m = len(points)
    inf = (math.inf, math.inf)
    # best[j] for k stages covering [0, points[j]); back[k][j] the previous point index
    best = [(a.stage_cost(prefix, 0, points[j]), a.transfer[points[j]]) if j > 0 and a.holds_params(0, points[j])
            else inf for j in range(m)]
    back: list[list[int]] = [[0] * m]
    for _k in range(1, stages):
        new = [inf] * m
        arg = [0] * m
        for j in range(1, m):
            for i in range(1, j):
                prev = best[i]
                if prev[0] == math.inf or not a.holds_params(points[i], points[j]):
                    continue
                c = a.stage_cost(prefix, points[i], points[j])
                cand = (max(prev[0], c), prev[1] + a.transfer[points[j]])
                if cand < new[j]:
                    new[j], arg[j] = cand, i
        best = new
        back.append(arg)
    if best[m - 1][0] == math.inf:
        raise PlanError(f"the model cannot be cut into {stages} pipeline stages that each hold a parameter: use a "
                        "smaller pipe axis or a model with more layers.")
    cuts = []
    j = m - 1
    for k in range(stages - 1, 0, -1):
        j = back[k][j]
        cuts.append(points[j])
    return sorted(cuts)


def _manual_cuts(a: Analysis, split: tuple[str, ...], stages: int) -> list[int]:
    if len(split) != stages - 1:
        raise PlanError(f"pipeline split has {len(split)} cut points {list(split)}, but the pipe axis has {stages} "
                        f"stages, which needs {stages - 1} cut points (each names the module that starts a stage).")
    cuts = []
    paths = [M.module_path(v) for v in a.order]
    for name in split:
        hit = next((i for i, p in enumerate(paths) if p == name or p.startswith(name + ".")), None)
        if hit is None:
            known = sorted(dict.fromkeys(u for u in a.units if u))[:8]
            raise PlanError(f"pipeline cut point {name!r} names no module of the model, but each cut point must be "
                            f"a module path such as {known}.")
        if hit == 0:
            raise PlanError(f"pipeline cut point {name!r} starts at the first op of the model, so stage 0 would "
                            "be empty: name a later module.")
        if not _cuttable(a.crossing[hit]):
            names = [v.name for v in a.crossing[hit]]
            raise PlanError(f"pipeline cut point {name!r} has {names} crossing it, but every tensor crossing a "
                            "cut must be a floating tensor that carries a gradient: cut at another module.")
        cuts.append(hit)
    if cuts != sorted(set(cuts)):
        raise PlanError(f"pipeline cut points {list(split)} are not in the order the model runs them (or repeat "
                        "one): list them in execution order.")
    return cuts


def split_graph(gm: torch.fx.GraphModule, mesh: Mesh, stages: int, split="auto", profile="cpu-gloo",
                pipe_axis: str = "pipe", optimizer: str = "adam", manual: bool | None = None) -> StageSplit:
    """The split of ``gm`` into ``stages`` (see the module docstring); ``manual``: whether cut points ``split`` are the
    user's (the report says so; default: any given)."""
    from autoshard.cost_models.profile import HardwareProfile, load_profile

    prof = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
    a = analyse(gm, mesh, prof, prof.link_for(pipe_axis), optimizer)
    if stages < 1:
        raise PlanError(f"pipeline has {stages} stages, but needs at least 1.")
    if split != "auto":
        cuts = _manual_cuts(a, tuple([split] if isinstance(split, str) else split), stages)
        edges = [0, *cuts, a.n]
        for k, (lo, hi) in enumerate(itertools.pairwise(edges)):
            if not a.holds_params(lo, hi):
                raise PlanError(f"pipeline split {split!r}: stage {k} holds no parameter (torch's optimizers refuse "
                                "an empty parameter list, and its ranks would only pass activations on): cut so "
                                "that every stage holds a layer.")
    else:
        if len(a.candidates) < stages - 1:
            raise PlanError(f"the model has {len(a.candidates)} points where it can be cut into pipeline stages, "
                            f"but {stages} stages need {stages - 1}: use a smaller pipe axis or a model with more "
                            "layers.")
        cuts = _best_cuts(a, stages)
    return _describe(a, cuts, split != "auto" if manual is None else manual)


def _describe(a: Analysis, cuts: list[int], manual: bool) -> StageSplit:
    prefix = a.prefix()
    edges = [0, *cuts, a.n]
    compute = tuple(prefix[e] - prefix[s] for s, e in itertools.pairwise(edges))
    once = tuple(math.fsum(a.once[s:e]) for s, e in itertools.pairwise(edges)) if a.once is not None else ()
    transfer = tuple(a.transfer[s] + a.transfer[e] for s, e in itertools.pairwise(edges))
    bounds = []
    for c in cuts:
        cross = a.crossing[c]
        info = [_local_bytes(v, a.mesh) for v in cross]
        bounds.append(Boundary(tuple(v.name for v in cross), tuple(s for s, _ in info),
                               tuple(v.meta["val"].dtype for v in cross), sum(b for _, b in info)))
    modules = tuple(tuple(dict.fromkeys(u for i in range(s, e) for u in (*a.also[i], a.units[i]) if u))
                    for s, e in itertools.pairwise(edges))
    return StageSplit(tuple(cuts), tuple(v.name for v in a.order), tuple(bounds), compute, transfer, modules, manual,
                      once)


# ---- structural rewrite: one GraphModule per stage -------------------------------------------------------
@dataclass(frozen=True)
class StageGraph:
    """Stage ``index``'s global annotated graph: positional placeholders ``acts`` (received activations) then
    ``inputs`` (the model inputs it reads, passed by name); returns ``outputs`` (a tuple of tensors)."""

    index: int
    gm: torch.fx.GraphModule
    acts: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: tuple[str, ...]  # get_attr targets (parameter FQNs) this stage holds


def build_stage_graphs(gm: torch.fx.GraphModule, split: StageSplit) -> list[StageGraph]:
    """One GraphModule per stage of ``split``: the nodes of its span of ``split.order``, the recomputable nodes they
    read, the activations it receives as placeholders; ``node.meta`` and ``gm.meta`` (the graph-level results of
    the passes, e.g. a context-parallel layout, that the rank phase reads) copied."""
    nodes = {n.name: n for n in gm.graph.nodes}
    order = [nodes[name] for name in split.order]
    pos = {n: i for i, n in enumerate(order)}
    edges = [0, *split.cuts, len(order)]
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    crossing = [[]] + [[nodes[x] for x in b.names] for b in split.boundaries] + [[]]
    stages = []
    for k in range(split.stages):
        lo, hi = edges[k], edges[k + 1]
        last = k == split.stages - 1
        acts = crossing[k]
        outs: list = list(crossing[k + 1]) if not last else list(out_node.args[0])
        wanted: set[torch.fx.Node] = set(order[lo:hi])
        stack = [x for x in outs if isinstance(x, torch.fx.Node)] + list(order[lo:hi])
        act_set = set(acts)
        while stack:
            v = stack.pop()
            for x in v.all_input_nodes:
                if x in wanted or x in act_set:
                    continue
                if x in pos:
                    raise PlanError(f"stage {k} reads `{x.name}` from another stage without it crossing the cut "
                                    "(internal error of the pipeline split).")
                wanted.add(x)
                stack.append(x)
        for x in outs:
            if isinstance(x, torch.fx.Node) and x not in act_set and x not in wanted:
                wanted.add(x)
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for v in acts:
            env[v] = graph.placeholder(v.name)
            env[v].meta = dict(v.meta)
        inputs = []
        for v in gm.graph.nodes:
            if v.op == "placeholder" and v in wanted:
                env[v] = graph.placeholder(v.name)
                env[v].meta = dict(v.meta)
                inputs.append(v.name)
        params = []
        for v in gm.graph.nodes:
            if v.op in ("placeholder", "output") or v not in wanted:
                continue
            env[v] = graph.node_copy(v, env.__getitem__)
            env[v].meta = dict(v.meta)
            if v.op == "get_attr":
                params.append(str(v.target))
        graph.output(tuple(env[x] if isinstance(x, torch.fx.Node) else x for x in outs))
        graph.lint()
        sgm = torch.fx.GraphModule(gm, graph, class_name=f"Stage{k}")
        sgm.meta.update({key: v for key, v in gm.meta.items() if key != M.STAGE_GRAPHS})
        stages.append(StageGraph(k, sgm, tuple(v.name for v in acts), tuple(inputs),
                                 tuple(x.name if isinstance(x, torch.fx.Node) else repr(x) for x in outs),
                                 tuple(params)))
    return stages


__all__ = ["Boundary", "BuildStages", "PipelineSplit", "StageGraph", "StageSplit", "analyse", "build_stage_graphs",
           "split_graph", "stage_graphs_of", "stage_split_of", "unit_of"]
