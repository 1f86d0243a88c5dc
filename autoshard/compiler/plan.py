"""The compiled artifact: the annotated global graph plus what it takes to make each rank's program.

A :class:`Plan` is produced ahead of time in one process by :func:`build_plan` (trace → passes) and answers
questions about itself without any process group: ``show()``, ``format()``, ``code(rank)``,
``rank_program(rank)``, ``collectives()``, ``param_specs()``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import gc
from dataclasses import dataclass, field

import torch
import torch.fx

from autoshard import meta as M
from autoshard.compiler.rank_programs import param_specs_of, program_copy, rank_program
from autoshard.compiler.context import Context, Options, Pinned, searches
from autoshard.compiler.plan_file import tied_groups
from autoshard.errors import AutoshardError, PlanError
from autoshard.mesh import Mesh
from autoshard.passes.manager import PipelineOptions, collective_signature, pass_list, run_passes
from autoshard.placements import Spec, assemble, shard_tensor
from autoshard.frontend.precision import trace_with_precision
from autoshard.frontend.trace import trace
from autoshard.runtime.torch_state import RANK_THREADS


@dataclass
class Plan:
    graph_module: torch.fx.GraphModule
    mesh: Mesh
    context: Context
    model_name: str = "model"
    #: (stage, bucket_grads) -> (rank, collective signature) of the first rank program made (see _check_signature)
    _signatures: dict = field(default_factory=dict, repr=False, compare=False)
    #: the mode (``model.training``) the graph was traced in: dropout and batch-norm statistics follow it
    training: bool = True
    #: the global example inputs it was planned for, ``(args, kwargs)``
    examples: tuple = field(default=((), {}), repr=False, compare=False)
    #: {state-dict name: (shape, dtype)} of the model planned: what :meth:`check_model` compares a model with
    model_signature: dict = field(default_factory=dict, repr=False, compare=False)
    #: what each decision made once for the job returned (:attr:`Context.once`: the search's ``Decided``), in order:
    #: replayed, they give this plan again without a search (:meth:`save`, :func:`autoshard.load_plan`)
    decisions: list = field(default_factory=list, repr=False, compare=False)
    #: the names of each tensor the model planned holds under several names (tied weights; plan_file.tied_groups)
    tied: list = field(default_factory=list, repr=False, compare=False)

    # ---- the model it applies to ------------------------------------------------------------------------
    def check_model(self, model: torch.nn.Module) -> None:
        """Raise a :class:`PlanError` naming every parameter or buffer in which ``model`` differs from the model
        planned (missing, extra, another shape or dtype): a plan applies only to the model it was made for."""
        mine = self.model_signature
        theirs = signature_of(model)
        diffs = [f"`{k}` missing from the model" for k in mine if k not in theirs]
        diffs += [f"`{k}` not in the plan's model" for k in theirs if k not in mine]
        diffs += [f"`{k}` is {list(theirs[k][0])} {theirs[k][1]} in the model, {list(mine[k][0])} {mine[k][1]} in "
                  "the plan" for k in mine if k in theirs and theirs[k] != mine[k]]
        if diffs:
            more = f" (and {len(diffs) - 5} more)" if len(diffs) > 5 else ""
            raise PlanError(f"this plan was made for another model than the {type(model).__name__} it is applied to: "
                            + "; ".join(diffs[:5]) + more + ". Plan the model you apply it to (autoshard.plan).")

    def save(self, path) -> None:
        """Write this plan to ``path`` (JSON, :mod:`autoshard.compiler.plan_file`): its mesh, options and the search's
        decisions, with what it was made for (the model's parameter and buffer names, shapes and dtypes, the example
        input shapes, the plan's digest). ``autoshard.load_plan(path, model, example_inputs)`` makes it again on any
        rank without searching, checking the model and inputs first (a difference is a PlanError naming it)."""
        from autoshard.compiler.plan_file import write_plan_file

        write_plan_file(self, path)

    def bind_weights(self, model: torch.nn.Module) -> None:
        """Give this plan's graph ``model``'s own tensors (by the names the model gives them), so that applying the
        plan shards ``model`` (a plan keeps the tensors of the model it was made from until a rank's shards are
        made; tensors the compiler created, such as MoE experts, stay the plan's)."""
        from torch.fx.graph_module import _assign_attr

        state = dict(model.named_parameters(remove_duplicate=False))
        state.update(model.named_buffers(remove_duplicate=False))
        for n in self.graph_module.graph.nodes:
            if n.op != "get_attr":
                continue
            for name in n.meta.get(M.ALIASES, (str(n.target),)):
                if name in state:
                    _assign_attr(state[name], self.graph_module, n.target)
                    break

    # ---- per-rank programs ------------------------------------------------------------------------------
    def rank_program(self, rank: int, weights: torch.nn.Module | None = None, bucket_grads: bool = False,
                     local_weights: torch.nn.Module | None = None, stage: int | None = None,
                     check_inputs: bool = True) -> torch.fx.GraphModule:
        """Rank ``rank``'s program by the rank phase of the pass list, its collectives checked against the first
        rank program this plan made (``local_weights``: share that program's tensors, see
        :func:`autoshard.compiler.rank_programs.rank_program`; ``stage``: the program of that pipeline stage, checked
        against the stage's first one). The only way to a rank program of a plan: a plain GraphModule holding only
        ``rank``'s parameter shards. ``check_inputs``: every call is checked against the plan's local input shapes first
        (a wrong shape is a RuntimeShapeError; the ShardedModule checks its calls itself and asks for False).

        ``bucket_grads=True`` leaves the parameters' gradient all-reduces out of the program and lists them in
        ``module.meta[autoshard.runtime.buckets.GRAD_SYNC]``: attach a
        :class:`~autoshard.runtime.buckets.GradBucketer` to run them bucketed and overlapped with backward."""
        module = rank_program(self.graph_module, self.mesh, rank, self.context.options, weights, bucket_grads,
                              local_weights, stage)
        self._check_signature(module, rank, bucket_grads, stage)
        if check_inputs and stage is None:
            from autoshard.frontend.inputs import install_check

            module = install_check(module, self.expected_inputs(), rank)  # wrong shapes: RuntimeShapeError, not raw
        return module

    def expected_inputs(self) -> list:
        """The tensor inputs the plan was compiled for: name, global and local shape, dtype
        (:class:`autoshard.frontend.inputs.ExpectedInput`)."""
        from autoshard.frontend.inputs import expected_inputs

        return expected_inputs(self.graph_module, self.mesh)

    def release_weights(self) -> None:
        """Replace every tensor the global program holds by a meta tensor of the same shape and dtype: the plan
        then keeps nothing of the model alive (a rank that made its program needs no full weight again; later
        ``rank_program`` calls give meta tensors, to be filled by init or a checkpoint)."""
        gm = self.graph_module
        metas: dict[int, torch.Tensor] = {}  # one meta tensor per tensor: tied names stay tied
        for module in gm.modules():
            for table in (module._parameters, module._buffers):
                for name, t in list(table.items()):
                    if t is None or t.is_meta:
                        continue
                    if id(t) not in metas:
                        meta = torch.empty_like(t, device="meta")
                        metas[id(t)] = torch.nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(
                            t, torch.nn.Parameter) else meta
                    table[name] = metas[id(t)]
            for name, t in list(vars(module).items()):  # plain tensor attributes (constants)
                if isinstance(t, torch.Tensor) and not t.is_meta:
                    setattr(module, name, torch.empty_like(t, device="meta"))

    def _check_signature(self, module: torch.fx.GraphModule, rank: int, bucket_grads: bool,
                         stage: int | None = None) -> None:
        """Every rank's program (of one stage) must issue the same collectives in the same order as the first one
        made."""
        signature = collective_signature(module)
        first = self._signatures.setdefault((stage, bucket_grads), (rank, signature))
        if first[1] != signature:
            which = "" if stage is None else f" of stage {stage}"
            raise AutoshardError(f"the rank passes made rank {rank}'s program{which} issue collectives {signature}, "
                                 f"but rank {first[0]}'s issues {first[1]}: ranks would wait on each other forever. "
                                 "This is a bug in autoshard's rank passes (passes/manager.py); please report it.")

    def code(self, rank: int = 0) -> str:
        """The generated Python source of ``rank``'s module."""
        return self.rank_program(rank).code.strip() + "\n"

    def shard_inputs(self, rank: int, args=(), kwargs=None) -> tuple[tuple, dict]:
        """Cut global example inputs into ``rank``'s local inputs (by the specs of the graph's placeholders)."""
        from torch.fx._pytree import tree_flatten_spec
        from torch.utils import _pytree as pytree

        gm = self.graph_module
        kwargs = dict(kwargs or {})
        leaves = tree_flatten_spec((tuple(args), kwargs), gm._in_spec)
        holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        local = [shard_tensor(x, h.meta[M.SPEC], self.mesh, rank) if isinstance(x, torch.Tensor) else x
                 for x, h in zip(leaves, holders)]
        a, k = pytree.tree_unflatten(local, gm._in_spec)
        return tuple(a), dict(k)

    def simulate(self, args=(), kwargs=None, backward: bool = True, timeout: float = 120.0,
                 train: bool | None = None) -> Simulation:
        """Run every rank in this process (one thread each): outputs per rank, assembled gradients, collective logs.

        ``args``/``kwargs`` are the global inputs (each rank's share is cut here). ``train``: the mode the plan was
        traced in (None) — the program of the other mode is the ShardedModule's to make (``sharded.simulate``). The loss
        is the output itself, its ``.loss`` (Hugging Face outputs), or its first element.
        """
        mode = self.training if train is None else train
        if not isinstance(mode, bool):
            raise AutoshardError(f"Plan.simulate got train={train!r}, but train is True, False or None (the "
                                 "mode the plan was traced in).")
        if mode != self.training:
            raise PlanError(f"Plan.simulate(train={mode}) needs the {_mode_name(mode)}-mode program, but this plan "
                            f"was traced in {_mode_name(self.training)} mode: call sharded.simulate(...) on the "
                            "ShardedModule (it runs the program of its own mode), or plan the model in "
                            f"{_mode_name(mode)} mode.")
        from autoshard.frontend.inputs import check_inputs, tensor_leaves
        from autoshard.runtime.communicator import current
        from autoshard.runtime.sim import SimWorld
        from autoshard.runtime.zero import running

        check_inputs(self.expected_inputs(), tensor_leaves(args, kwargs), local=False, where="Plan.simulate")
        world = SimWorld(self.mesh, timeout=timeout)

        def body(rank):
            module = self.rank_program(rank).train(mode)
            a, k = self.shard_inputs(rank, args, kwargs)
            with running(module):
                out = module(*a, **k)
            if backward:
                loss_of(out).backward()
            grads = {n: p.grad for n, p in module.named_parameters()}
            return out, grads, list(current().log)

        results = world.run(body)
        specs = self.param_specs()
        grads = {}
        if backward:
            for name in results[0][1]:
                per_rank = [r[1][name] for r in results]
                if all(g is not None for g in per_rank):
                    grads[name] = assemble(per_rank, specs[name], self.mesh)
        return Simulation([r[0] for r in results], grads, [r[2] for r in results])

    def with_weights_of(self, other: Plan) -> Plan:
        """Give this plan's graph the tensors of ``other``'s under the same attribute names (the plan of the other
        mode, traced from a skeleton, gets the real weights); returns self."""
        from torch.fx.graph_module import _assign_attr

        from autoshard.frontend.trace import fetch_attr

        for n in self.graph_module.graph.nodes:
            if n.op == "get_attr":
                try:
                    t = fetch_attr(other.graph_module, n.target)
                except AttributeError:
                    continue
                if isinstance(t, torch.Tensor):
                    _assign_attr(t, self.graph_module, n.target)
        return self

    # ---- questions --------------------------------------------------------------------------------------
    def public_names(self) -> dict[str, str]:
        """{program attribute: the model's first name of that tensor} (a tied weight is known by the name
        ``model.named_parameters()`` gives it)."""
        return {str(n.target): n.meta.get(M.ALIASES, (str(n.target),))[0] for n in self.graph_module.graph.nodes
                if n.op == "get_attr"}

    def param_specs(self) -> dict[str, Spec]:
        """{parameter FQN, as the rank programs name it: the spec it is stored in} (a tied weight under the name the
        trace kept; :meth:`public_names` maps it to the model's first name)."""
        return param_specs_of(self.graph_module)

    def param_storage(self) -> dict[str, M.Storage]:
        """{parameter FQN: its :class:`~autoshard.meta.Storage`} of every parameter stored apart from its compute
        layout (ZeRO stage > 0)."""
        return {n.meta.get(M.PARAM, n.target): n.meta[M.STORAGE] for n in self.graph_module.graph.nodes
                if n.op == "get_attr" and M.STORAGE in n.meta}

    def layout(self) -> dict[str, str]:
        """{node: its placements, stored placements and recomputed region}, for every node of the plan's graph in
        graph order: what every rank's program is made from, as text (``digest`` hashes it; ranks compare it)."""
        out = {}
        for n in self.graph_module.graph.nodes:
            target = n.target if isinstance(n.target, str) else torch.fx.node._get_qualified_name(n.target)
            parts = [n.op, target, str(n.meta.get(M.SPEC))]
            if M.STORAGE in n.meta:
                parts.append(str(n.meta[M.STORAGE]))
            if M.RECOMPUTE in n.meta:
                parts.append(f"recompute {n.meta[M.RECOMPUTE]}")
            if M.COLLECTIVE in n.meta:
                parts.append(str(n.meta[M.COLLECTIVE]))
            out[n.meta.get(M.PARAM, n.name) if n.op == "get_attr" else n.name] = " ".join(parts)
        return out

    def digest(self) -> str:
        """A hash of :meth:`layout` and the mesh: equal on two ranks exactly when they run programs of one plan."""
        import hashlib

        text = repr((str(self.mesh), self.training, sorted(self.layout().items())))
        return hashlib.sha256(text.encode()).hexdigest()

    def cost(self, profile=None, optimizer: str | None = None):
        """Estimated step time (compute + communication), memory per rank (``.memory``: by kind — parameters,
        gradients, optimizer state, buffers, activations, gathered copies — and the step's peak) and bytes per axis
        of this plan, for ``profile`` (default: the one the plan was made for)."""
        from autoshard.cost_models.plan_cost import plan_cost
        from autoshard.cost_models.profile import HardwareProfile, load_profile

        profile = profile or self.context.options.profile
        profile = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
        precision = self.context.options.precision
        return plan_cost(self.graph_module, self.mesh, profile, optimizer or self.context.options.optimizer,
                         precision.param_dtype if precision is not None else None)

    def collectives(self) -> list[tuple[str, M.CollectiveInfo]]:
        """(node name, info) of every inserted collective, in graph order."""
        return [(n.name, n.meta[M.COLLECTIVE]) for n in self.graph_module.graph.nodes if M.COLLECTIVE in n.meta]

    def format(self, rank: int | None = None) -> str:
        from autoshard.compiler.report import format_plan

        return format_plan(self)

    def show(self, console=None, nodes: bool | None = None) -> None:
        """Print the summary for a model with repeated layers, else every node (``nodes`` forces either), at the
        console's width."""
        from autoshard.compiler.report import show_plan

        show_plan(self, console, nodes)


@dataclass
class Simulation:
    outputs: list  # per rank, as its module returned them
    grads: dict[str, torch.Tensor]  # parameter FQN -> global gradient reassembled from every rank's shard
    logs: list  # per rank: the CollectiveRecords it executed


def _mode_name(training: bool) -> str:
    return "training" if training else "eval"


def loss_of(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if getattr(out, "loss", None) is not None:
        return out.loss
    if isinstance(out, (tuple, list)):
        return out[0]
    raise AutoshardError(f"output of type {type(out).__name__} has no loss: return a scalar tensor, a tuple whose "
                         "first element is the loss, or an object with a .loss attribute.")


@contextlib.contextmanager
def _gc_paused():
    """Python's cyclic garbage collector off while planning: tracing and the plan search allocate millions of
    small objects next to an FX graph full of fake tensors, and the collections this triggers cost the Llama-3-8B
    search half of its problem-building time (bench/search_plans.py). Restored as it was afterwards; garbage made
    meanwhile is collected at the next collection."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def signature_of(model: torch.nn.Module) -> dict:
    """{state-dict name: (shape, dtype)} of every parameter and buffer of ``model`` (tied names each listed)."""
    out = {n: (tuple(t.shape), str(t.dtype)) for n, t in model.named_parameters(remove_duplicate=False)}
    out.update((n, (tuple(t.shape), str(t.dtype))) for n, t in model.named_buffers(remove_duplicate=False))
    return out


def build_plan(model: torch.nn.Module, mesh: Mesh, args: tuple, kwargs: dict | None, options: Options,
               pipeline: PipelineOptions | None = None, once=None, pinned: Pinned | None = None,
               device: torch.device | None = None) -> Plan:
    """The plan of ``model`` on ``mesh``: trace, then the plan phase of the one pass list. The one way to a plan:
    ``compile``, the other mode's plan of a ShardedModule and the pipelined plan (``pipeline``: the split and
    stage-building passes enabled, the stage graphs left on ``gm.meta``; :mod:`autoshard.compiler.pipeline.plan`) all
    come here. ``once``: how a decision that may differ between processes is made once for the job
    (:attr:`autoshard.compiler.context.Context.once`). ``pinned``: another plan's parameter layouts to keep
    (:class:`autoshard.compiler.context.Pinned`). ``device``: the device the program will run on, for a model on the
    meta device (traced as FakeTensors there: :func:`autoshard.frontend.trace.trace`)."""
    decisions: list = []

    def recorded(decide):  # every decision made once for the job, as the job saw it: what a plan file replays
        decisions.append(decide() if once is None else once(decide))
        return decisions[-1]

    # one trace and its passes at a time where ranks are threads of one process (the simulator)
    replans = options.memory_limit is not None and pipeline is None and searches(options, pinned, model.training)
    with RANK_THREADS.exclusive(), _gc_paused(), reused_traces() if replans else contextlib.nullcontext():
        target = options.memory_limit
        for attempt in range(1 + SEARCH_REPLANS):
            key, gm = _kept_trace(model, args, kwargs, options.precision, device)
            if gm is None:  # (the trace called here: an untraceable model's error stays a few frames long)
                gm = _keep_trace(key, model, trace(model, args, kwargs, device=device) if options.precision is None
                                 else trace_with_precision(model, args, kwargs, options.precision, device))
            ctx = Context(mesh, options, once=recorded, pinned=pinned)
            planned = options if target == options.memory_limit else dataclasses.replace(options, memory_limit=target)
            gm = run_passes(gm, ctx, pass_list(planned, pipeline=pipeline, pinned=pinned,
                                                  training=model.training)["plan"])
            ctx.report.update(gm.meta.get(M.PLAN_REPORT, {}))  # the plan's report: what its passes recorded
            peak = _searched_peak(gm, mesh, options, pipeline, searches(options, pinned, model.training))
            if peak is None or peak <= options.memory_limit:
                break
            if attempt == SEARCH_REPLANS:
                ctx.warn(f"plan search: the plan needs {peak / 2**20:.4g} MiB per rank by plan.cost(), over "
                         f"memory_limit={options.memory_limit / 2**20:.4g} MiB after {SEARCH_REPLANS} re-plans (the "
                         "search's memory of recomputed layers is a little below plan.cost()'s): lower memory_limit "
                         "by the difference, or pass recompute=False.")
                break
            # the search priced its plan below what plan.cost() counts (e.g. recomputed regions' inputs): plan
            # again for a limit that many bytes below what the search counted for this plan, so the plan fits by
            # the model the user reads
            searched = ctx.report["plan_search"]["memory_per_rank"]
            target = min(target, searched) - (peak - options.memory_limit) * (1 + 1e-3) - 1
        if target != options.memory_limit:
            ctx.report["plan_search"].update(memory_limit=options.memory_limit, searched_limit=target,
                                             replans=attempt)
    return Plan(gm, mesh, ctx, type(model).__name__, training=model.training,
                examples=(tuple(args), dict(kwargs or {})), model_signature=signature_of(model), decisions=decisions,
                tied=tied_groups(model))


#: the traces of the innermost reused_traces() block: trace key -> (model, its traced program); None outside one
_TRACES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("autoshard_reused_traces", default=None)


@contextlib.contextmanager
def reused_traces():
    """Within the block, :func:`build_plan` traces each model once per inputs (shapes, dtypes, devices,
    ``requires_grad``, non-tensor values), mode, device and precision policy, and plans a copy of that program every
    further time (:func:`traced_copy`): the search's re-plans and ``plan_cluster``'s candidate meshes trace the model
    once (Llama-3.1-405B on meta: 3.3 s a trace). Only within one call that plans a model it does not change: the
    copy is of the model as it was traced (a parameter replaced meanwhile would not be seen). Blocks nest: an inner
    one shares the outer one's traces."""
    token = _TRACES.set({} if _TRACES.get() is None else _TRACES.get())
    try:
        yield
    finally:
        _TRACES.reset(token)


def _kept_trace(model: torch.nn.Module, args: tuple, kwargs: dict | None, precision, device
                ) -> tuple[tuple | None, torch.fx.GraphModule | None]:
    """``(key, program)``: a copy of the enclosing :func:`reused_traces` block's trace of ``model`` with these inputs,
    mode, device and precision policy (the compute copy's graph under one: frontend/precision.py), or None where it
    has none yet (then :func:`_keep_trace` the new trace under ``key``; key None: outside any block)."""
    traces = _TRACES.get()
    if traces is None:
        return None, None
    key = (id(model), model.training, str(device), repr(precision), _inputs_key(args, kwargs))
    return key, traced_copy(traces[key][1]) if key in traces else None


def _keep_trace(key: tuple | None, model: torch.nn.Module, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` kept as traced under ``key`` (with the model: its id is not reused while the block lasts) and a copy
    of it for the passes to rewrite; ``gm`` itself outside a block."""
    if key is None:
        return gm
    _TRACES.get()[key] = (model, gm)
    return traced_copy(gm)


def _inputs_key(args, kwargs) -> tuple:
    """What of the example inputs the trace depends on: their structure, each tensor's shape, strides, dtype,
    device and ``requires_grad``, every other leaf's value (aliasing inputs are traced as copies: trace's
    ``unaliased``)."""
    from torch.utils import _pytree as pytree

    leaves, spec = pytree.tree_flatten((tuple(args) if isinstance(args, (tuple, list)) else (args,),
                                        dict(kwargs or {})))
    sig = tuple((tuple(x.shape), x.stride(), x.dtype, str(x.device), x.requires_grad, type(x))
                if isinstance(x, torch.Tensor) else (type(x), repr(x)) for x in leaves)
    return str(spec), sig


def traced_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a traced program for the plan passes to rewrite: :func:`program_copy`'s (the graph and every node's
    metadata copied, the module tree new, its tensors shared), with every parameter and buffer of ``gm`` at its
    path (a tensor no node reads too; non-persistent buffers stay so) and export's input checks
    (``validate_inputs``, ``range_constraints``)."""
    from torch.fx.graph_module import _assign_attr

    copy = program_copy(gm)
    present = {*dict(copy.named_parameters(remove_duplicate=False)), *dict(copy.named_buffers(remove_duplicate=False))}
    for name, t in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
        if name not in present:  # (a tensor no node reads: program_copy takes only what the graph reads)
            _assign_attr(t, copy, name)
    for name, _ in gm.named_buffers(remove_duplicate=False):  # registering a buffer makes it persistent
        owner, _, leaf = name.rpartition(".")
        if leaf in gm.get_submodule(owner)._non_persistent_buffers_set:
            copy.get_submodule(owner)._non_persistent_buffers_set.add(leaf)
    for name in ("validate_inputs", "range_constraints"):
        if name in gm.__dict__:
            copy.__dict__[name] = gm.__dict__[name]
    return copy


#: how often build_plan plans again when the searched plan's peak by plan.cost() exceeds the memory limit
SEARCH_REPLANS = 2


def _searched_peak(gm: torch.fx.GraphModule, mesh: Mesh, options: Options, pipeline, searched: bool
                   ) -> float | None:
    """The per-rank peak of a searched plan under a memory limit by :meth:`Plan.cost`'s model (None: nothing to
    check — no search (``searched`` false), no limit, or a pipeline, whose stages are priced per stage)."""
    if not searched or options.memory_limit is None or pipeline is not None:
        return None
    from autoshard.cost_models.memory import plan_memory

    precision = options.precision
    return plan_memory(gm, mesh, options.optimizer, precision.param_dtype if precision is not None else None).peak
