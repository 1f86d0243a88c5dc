"""Plan, then apply: a plan is a value made by one call and applied to the model by another.

    >>> plan = autoshard.plan(model, mesh, (ids,), search=autoshard.Search(memory_limit="20GiB"))
    >>> plan.show()                                       # inspect, price (plan.cost()), simulate, before running
    >>> sharded = autoshard.apply(model, plan, device="cuda", bucket_cap_mb=25)

:func:`plan` answers *what to shard and how to choose*; its keywords are grouped by question:

* what to shard: ``annotations`` (hard placements by glob), ``data_axis``, ``moe``, ``context_parallel``,
  ``pipeline``, ``on_unsupported``;
* explicit choices: ``zero`` (a ZeRO stage for every parameter), ``recompute`` (a glob of modules), ``precision``
  (:class:`autoshard.MixedPrecision` or torch's ``MixedPrecisionPolicy``), ``sequence_parallel`` (greedy planner);
* how to choose: ``search=None`` plans op by op, fewest bytes first (the greedy planner);
  ``search=`` :class:`Search` chooses every free strategy by the plan search under its cost model, and only there
  do ``zero="auto"`` and ``recompute="auto"`` exist (the search picks them under its memory limit).

:func:`apply` answers *how to run it here*: ``device``, ``comm``, ``timeout``, ``bucket_cap_mb``, ``new_shapes``. It
never plans again: the model is checked against the plan (every parameter and buffer name, shape and dtype; a
difference is an error naming it) and sharded as planned. ``autoshard.compile(...)`` is the one-line form of both.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from autoshard.compiler.context import Options
from autoshard.compiler.plan import Plan, build_plan
from autoshard.errors import AutoshardError, PlanError
from autoshard.mesh import Mesh, as_mesh
from autoshard.placements import parse_placement

__all__ = ["Search", "job_communicator", "load_plan", "make_options", "memory_defaults", "parse_bytes", "plan",
           "plan_once", "plan_options", "with_moe"]


@dataclasses.dataclass(frozen=True)
class Search:
    """How the plan search chooses: ``autoshard.plan(..., search=autoshard.Search(...))``.

    ``profile``: the hardware the cost model prices (a preset name such as "cpu-gloo", "gpu-8x-nvlink",
    "multi-node", a TOML path written by ``autoshard calibrate``, or a HardwareProfile). ``memory_limit``: bytes per
    rank (an int or text like "20GiB"); None: no limit. ``optimizer``: whose state the memory model counts (adam,
    adamw, sgd, sgd_momentum). ``zero``: "auto" (the search picks a ZeRO stage per parameter to meet the limit; 0
    without a limit, where sharded storage only adds communication) or a stage 0-3 for every parameter.
    ``recompute``: "auto" (the search picks the layers to recompute to meet the limit; none without one), False
    (none) or a glob of module paths. ``time_limit``: seconds the search may run (None: 120); when it runs out the
    best plan found is taken and its gap to the lower bound warned about. ``accept_gap``: a plan this close to the
    lower bound (a fraction; None: 0.01) is taken without the exact ILP.
    """

    profile: Any = "cpu-gloo"
    memory_limit: float | str | None = None
    optimizer: str = "adam"
    zero: int | str = "auto"
    recompute: str | bool = "auto"
    time_limit: float | None = None
    accept_gap: float | None = None



def check_number(name: str, value, lo: float, hi: float | None = None, *, above: bool = False) -> float:
    """``value`` as a float where it is a number in [lo, hi] (``above``: greater than ``lo``), else a PlanError
    naming option ``name``."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or (value <= lo if above else value < lo) or (hi is not None and value > hi):
        bound = f"{'>' if above else '>='} {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise PlanError(f"option {name} is {value!r}, but must be a number {bound}.")
    return float(value)


def as_precision(precision):
    """``autoshard.MixedPrecision`` as given, or torch's FSDP2 ``MixedPrecisionPolicy`` read as one (its
    ``param_dtype``, ``reduce_dtype`` and ``output_dtype``; ``cast_forward_inputs`` is what autoshard does anyway)."""
    if precision is None:
        return None
    from autoshard.frontend.precision import MixedPrecision

    if isinstance(precision, MixedPrecision):
        return precision
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    except ImportError:  # pragma: no cover - every torch this project supports has it
        MixedPrecisionPolicy = ()
    if isinstance(precision, MixedPrecisionPolicy):
        if precision.param_dtype is None:
            raise PlanError("option precision is a MixedPrecisionPolicy with param_dtype=None, but autoshard casts "
                            "parameters for compute: give param_dtype (e.g. torch.bfloat16), or precision=None to "
                            "keep the model's own dtypes.")
        return MixedPrecision(param_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype,
                              output_dtype=precision.output_dtype)
    raise PlanError(f"option precision has type {type(precision).__name__}, but must be autoshard.MixedPrecision("
                    "param_dtype=..., reduce_dtype=...), torch.distributed.fsdp.MixedPrecisionPolicy, or None.")


def plan_options(mesh, *, annotations=None, data_axis: str = "data", search: Search | None = None, zero: int = 0,
                 recompute=None, precision=None, moe=None, context_parallel=None, sequence_parallel: bool = False,
                 on_unsupported: str = "replicate") -> Options:
    """The passes' :class:`Options` of :func:`plan`'s keywords, checked: a :class:`PlanError` names the option."""
    mesh = as_mesh(mesh)
    if search is not None and not isinstance(search, Search):
        raise PlanError(f"option search has type {type(search).__name__}, but must be autoshard.Search(profile=..., "
                        "memory_limit=..., ...) or None (the greedy planner).")
    if search is None:
        for name, value in (("zero", zero), ("recompute", recompute)):
            if value == "auto":
                raise PlanError(f"option {name}='auto' lets the plan search choose, but no search runs: pass "
                                f"search=autoshard.Search({name}='auto', memory_limit=...), or give {name} "
                                "explicitly.")
        options = make_options(annotations, data_axis, on_unsupported, mesh, "greedy", zero=zero,
                               recompute=False if recompute is None else recompute,
                               sequence_parallel=sequence_parallel, precision=as_precision(precision))
    else:
        if zero != 0 or recompute is not None:
            raise PlanError("options zero/recompute were given beside search=Search(...): with a search, give them "
                            "inside it (Search(zero=3) fixes a stage, Search(zero='auto') lets the search choose).")
        if sequence_parallel:
            raise PlanError("option sequence_parallel=True steers the greedy planner, but search=Search(...) was "
                            "given: the search weighs sequence-parallel layouts by their cost itself. Drop one.")
        s_zero = None if search.zero == "auto" else search.zero
        s_recompute = None if search.recompute == "auto" else search.recompute
        options = make_options(annotations, data_axis, on_unsupported, mesh, "search", search.profile,
                               search.memory_limit, search.optimizer, zero=s_zero, recompute=s_recompute,
                               precision=as_precision(precision))
        changes = {}
        if search.time_limit is not None:
            changes["search_time_limit"] = check_number("Search.time_limit", search.time_limit, 0, above=True)
        if search.accept_gap is not None:
            changes["search_accept_gap"] = check_number("Search.accept_gap", search.accept_gap, 0.0, 1.0)
        options = dataclasses.replace(options, **changes)
    if context_parallel is not None:
        from autoshard.compiler.context_parallel import as_context_parallel

        options = dataclasses.replace(options, context_parallel=as_context_parallel(context_parallel, mesh))
    if moe is not None:
        options = with_moe(options, moe)
    return options


def examples_of(example_inputs, example_kwargs) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of the example inputs (one tensor, a tuple or list of them, and keywords)."""
    args = () if example_inputs is None else (
        tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,))
    return args, dict(example_kwargs or {})


def plan(model: torch.nn.Module, mesh, example_inputs=None, example_kwargs: dict | None = None, *,
         annotations: dict | None = None, data_axis: str = "data", search: Search | None = None, zero: int = 0,
         recompute=None, precision=None, moe=None, context_parallel=None, sequence_parallel: bool = False,
         pipeline=None, on_unsupported: str = "replicate", comm=None):
    """The sharding plan of ``model`` on ``mesh`` for global ``example_inputs`` (see the module docstring for the
    keywords): a :class:`autoshard.compiler.plan.Plan` (or, with ``pipeline=``, a
    :class:`autoshard.compiler.pipeline.PipelinePlan`) to inspect, price and simulate, and to :func:`apply`.

    Under ``torchrun`` (torch.distributed initialised) every rank calls this together: rank 0 plans and every rank
    replays its decisions, so each rank holds the same plan even where the search is stopped by its time limit.
    ``comm``: the communicator to agree on (default: torch.distributed's, when initialised)."""
    if example_inputs is None and not example_kwargs:
        raise PlanError("autoshard.plan needs example inputs (global: the whole batch, as one device would see it), "
                        "e.g. autoshard.plan(model, mesh, (input_ids,)); autoshard.compile without them plans on "
                        "the first call instead.")
    if not isinstance(model, torch.nn.Module):
        raise PlanError(f"model has type {type(model).__name__}, but autoshard plans torch.nn.Module instances.")
    mesh = as_mesh(mesh)
    options = plan_options(mesh, annotations=annotations, data_axis=data_axis, search=search, zero=zero,
                           recompute=recompute, precision=precision, moe=moe, context_parallel=context_parallel,
                           sequence_parallel=sequence_parallel, on_unsupported=on_unsupported)
    args, kwargs = examples_of(example_inputs, example_kwargs)
    if pipeline is not None:
        from autoshard.compiler.pipeline import build_pipeline_plan

        return build_pipeline_plan(model, mesh, args, kwargs, options, pipeline)
    return plan_once(job_communicator(mesh, comm), model, mesh, args, kwargs, options)


def load_plan(path, model: torch.nn.Module, example_inputs=None, example_kwargs: dict | None = None, *, mesh=None,
              comm=None, loss_fn=None):
    """The plan :meth:`Plan.save` wrote to ``path``, made again for ``model`` without searching: the file's mesh and
    options, the search's decisions replayed (:mod:`autoshard.compiler.plan_file`). A file of
    :meth:`PipelinePlan.save <autoshard.compiler.pipeline.PipelinePlan.save>` gives the pipelined plan again (its
    pipeline options and stages as saved, checked); ``loss_fn``: the ``Pipeline``'s loss function, which a file cannot
    hold (required when the saved pipeline had one). Every rank of a job may load it
    on its own (no rank searches, none waits for another); the result is the saved plan (its digest is checked).

    Checked first, each difference a :class:`PlanError` naming it: ``mesh`` (when given) against the file's, the
    job's world size (under torchrun; ``comm``: its mesh) against the mesh's, ``model``'s parameters and buffers (names,
    shapes, dtypes) and mode against the model planned, and the global ``example_inputs`` (shapes, dtypes) against
    those planned for. Then ``autoshard.apply(model, plan, ...)`` as for a plan made here.

        >>> plan = autoshard.plan(model, autoshard.Mesh(data=2, model=2), (ids,), search=autoshard.Search())
        >>> plan.save("plan.json")                                   # once, anywhere
        >>> plan = autoshard.load_plan("plan.json", model, (ids,))   # on every rank: no search
        >>> sharded = autoshard.apply(model, plan)
    """
    from autoshard.compiler.plan import signature_of
    from autoshard.compiler.plan_file import read_plan_file

    if not isinstance(model, torch.nn.Module):
        raise PlanError(f"model has type {type(model).__name__}, but autoshard.load_plan needs a torch.nn.Module: "
                        "pass the model the plan was made for, autoshard.load_plan(path, model, example_inputs).")
    saved = read_plan_file(path)
    if mesh is not None:
        saved.check_mesh(as_mesh(mesh))
    if comm is not None:
        saved.check_mesh(comm.mesh)
    elif _world_size() is not None:
        saved.check_world(_world_size())
    saved.check_model(model, signature_of(model))
    args, kwargs = examples_of(example_inputs, example_kwargs)
    saved.check_inputs(args, kwargs)
    if saved.pipeline is None and loss_fn is not None:
        raise PlanError(f"load_plan got loss_fn, but the plan in {saved.path} has no pipeline: drop loss_fn.")
    replay = iter(saved.decisions)

    def replayed(decide):
        try:
            return next(replay)
        except StopIteration:
            raise PlanError(f"planning the model asked for more decisions than the plan in {saved.path} holds: the "
                            "model traces to another program here than where the plan was saved. Save the plan "
                            "again with the versions this job runs.") from None

    pipeline = None
    if saved.pipeline is not None:
        from autoshard.compiler.pipeline import Pipeline

        fields = dict(saved.pipeline)
        if fields.pop("loss_fn") and loss_fn is None:
            raise PlanError(f"the plan in {saved.path} is a pipeline planned with a loss_fn, which a plan file does "
                            "not hold: pass it again, autoshard.load_plan(path, model, inputs, loss_fn=...).")
        pipeline = Pipeline(**fields, loss_fn=loss_fn)
    try:
        if pipeline is None:
            plan = build_plan(model, saved.mesh, args, kwargs, saved.options, once=replayed)
        else:
            from autoshard.compiler.pipeline import build_pipeline_plan

            plan = build_pipeline_plan(model, saved.mesh, args, kwargs, saved.options, pipeline, once=replayed,
                                       submesh_options=True)
    except PlanError as e:
        fix = "" if saved.path in str(e) else (" For a loaded plan: the model traces here to another program than "
                                               "where the plan was saved (or the file was edited); save the plan "
                                               "again with the versions this job runs.")
        raise PlanError(f"the plan in {saved.path} does not replay on this model: {e}{fix}") from e
    left = sum(1 for _ in replay)
    if left:
        raise PlanError(f"planning the model used {len(saved.decisions) - left} of the {len(saved.decisions)} "
                        f"decisions the plan in {saved.path} holds: the model traces to another program here than "
                        "where the plan was saved. Save the plan again with the versions this job runs.")
    if pipeline is None:
        saved.check_digest(plan)
        return plan
    saved.check_digest(plan.microbatch_plan)
    saved.check_split(plan)
    return plan


def _world_size() -> int | None:
    """torch.distributed's world size when it is initialised, else None (one process: any mesh may be simulated)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None


def with_moe(options: Options, moe) -> Options:
    """``options`` with the MoE rewrite ``moe`` (an :class:`autoshard.MoE`), checked."""
    import dataclasses

    from autoshard.compiler.moe import MoE

    if not isinstance(moe, MoE):
        raise PlanError(f"option moe is {type(moe).__name__}, but must be an autoshard.MoE(layers=..., "
                        "num_experts=..., ...).")
    return dataclasses.replace(options, moe=moe)


def parse_bytes(value) -> float | None:
    """2_000_000, "2GiB", "512MB", "1.5 GB" -> bytes."""
    if value is None or isinstance(value, (int, float)) and not isinstance(value, bool):
        return None if value is None else float(value)
    units = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
             "tib": 2**40}
    text = str(value).strip().lower().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number):]
    try:
        return float(number) * units[unit]
    except (KeyError, ValueError):
        raise PlanError(f"memory_limit is {value!r}, but must be a number of bytes or text like "
                        "'2GiB', '512MB'.") from None


def memory_defaults(planner: str, memory_limit, zero=None, recompute=None) -> tuple[int | str, str | None]:
    """``(zero, recompute)`` as the passes read them: a value left out (None) is ``"auto"`` when the search has a
    memory limit (a user who sets a limit expects the search to use what it needs to meet it), else 0 / no
    recomputation; ``recompute=False`` is an explicit "none" (stored as None)."""
    limited = planner == "search" and memory_limit is not None
    if zero is None:
        zero = "auto" if limited else 0
    if recompute is None:
        recompute = "auto" if limited else None
    elif recompute is False:
        recompute = None
    return zero, recompute


def make_options(annotations, data_axis: str, on_unsupported: str, mesh: Mesh, planner: str = "greedy",
                 profile="cpu-gloo", memory_limit=None, optimizer: str = "adam",
                 sequence_parallel: bool = False, zero: int | str | None = None, recompute: str | bool | None = None,
                 precision=None) -> Options:
    """The :class:`Options` of ``compile``'s keywords, checked (a :class:`PlanError` names the bad option); ``zero``
    and ``recompute`` left out get :func:`memory_defaults`."""
    if planner not in ("search", "greedy"):
        raise PlanError(f"option planner is {planner!r}, but must be 'search' or 'greedy'.")
    if optimizer not in ("adam", "adamw", "sgd", "sgd_momentum"):
        raise PlanError(f"option optimizer is {optimizer!r}, but must be one of adam, adamw, sgd, sgd_momentum.")
    if on_unsupported not in ("error", "replicate"):
        raise PlanError(f"option on_unsupported is {on_unsupported!r}, but must be 'error' or 'replicate'.")
    if not isinstance(data_axis, str):
        raise PlanError(f"option data_axis is {data_axis!r}, but must be a mesh axis name such as 'data'.")
    parsed = []
    for pattern, spec in (annotations or {}).items():
        if isinstance(spec, str) or not isinstance(spec, (tuple, list)):
            raise PlanError(f"annotation {pattern!r} has {spec!r}, but must be a tuple with one placement per "
                            f"mesh axis {list(mesh.names)}, e.g. (Replicate(), Shard(0)).")
        parsed.append((pattern, tuple(parse_placement(p) if isinstance(p, str) else p for p in spec)))
    if isinstance(zero, bool) or zero not in (None, 0, 1, 2, 3, "auto"):
        raise PlanError(f"option zero is {zero!r}, but must be 0, 1, 2, 3 or 'auto' (or None: 'auto' when "
                        "planner='search' has a memory_limit, else 0).")
    if recompute is not None and recompute is not False and not isinstance(recompute, str):
        raise PlanError(f"option recompute is {recompute!r}, but must be False (none), a glob over module paths "
                        "such as 'model.layers.*', 'auto', or None ('auto' when planner='search' has a "
                        "memory_limit, else none).")
    zero, recompute = memory_defaults(planner, memory_limit, zero, recompute)
    for name, value in (("zero", zero), ("recompute", recompute)):
        if value == "auto" and planner != "search":
            raise PlanError(f"option {name}='auto' lets the plan search choose, but planner is {planner!r}: pass "
                            f"planner='search' (with a memory_limit), or give {name} explicitly.")
    _check_profile(profile)
    if precision is not None:
        from autoshard.frontend.precision import MixedPrecision

        if not isinstance(precision, MixedPrecision):
            raise PlanError(f"option precision has type {type(precision).__name__}, but must be "
                            "autoshard.MixedPrecision(param_dtype=..., reduce_dtype=...) or None.")
    return Options(annotations=tuple(parsed), data_axis=data_axis, on_unsupported=on_unsupported,
                   planner=planner, profile=profile, memory_limit=parse_bytes(memory_limit), optimizer=optimizer,
                   sequence_parallel=bool(sequence_parallel), zero=zero, recompute=recompute, precision=precision)


def _check_profile(profile) -> None:
    """An unknown hardware profile is an error at compile, not at the first ``plan.cost()``."""
    from autoshard.cost_models.profile import HardwareProfile, list_profiles, load_profile

    if isinstance(profile, HardwareProfile):
        return
    if not isinstance(profile, (str, os.PathLike)):
        raise PlanError(f"option profile has type {type(profile).__name__}, but must be a preset name "
                        f"{list_profiles()}, the path of a profile TOML file, or an autoshard HardwareProfile.")
    try:
        load_profile(profile)
    except PlanError as e:
        raise PlanError(f"option profile={str(profile)!r}: {e}") from None


def job_communicator(mesh: Mesh, comm=None):
    """The communicator every rank of the job plans together on: ``comm`` (default: torch.distributed's, when it is
    initialised) when it runs one rank per process or is the calling simulator rank's own, else None (each process
    plans alone)."""
    if mesh.size == 1:
        return None
    from autoshard.runtime.communicator import current

    if comm is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        from autoshard.runtime.dist import DistCommunicator

        comm = DistCommunicator(mesh)
    if not comm.one_rank_per_process:
        try:
            if current() is not comm:
                return None
        except AutoshardError:
            return None
    return comm


def plan_once(comm, model, mesh: Mesh, args: tuple, kwargs: dict, options: Options, pinned=None,
              device=None) -> Plan:
    """:func:`build_plan` of ``model`` on ``mesh``, made so that every rank of a job runs the same one, when every
    rank plans at this point together (``comm``: :func:`job_communicator`; None: this process plans alone): rank 0
    plans, recording each decision that may differ between processes (``once``, :attr:`Context.once`: the
    time-limited search), and hands them to every rank, which plans again replaying them (a failure on rank 0 is
    raised on every rank). Without such a communicator each process plans alone, and every call compares plans
    (:func:`autoshard.runtime.agreement.check_call`). ``device``: where the program will run, for a model on the
    meta device (:func:`build_plan`)."""
    if comm is None:
        return build_plan(model, mesh, args, kwargs, options, pinned=pinned, device=device)
    from autoshard.runtime.agreement import decide_once

    if comm.rank == 0:
        decisions: list = []

        def record(decide):
            decisions.append(decide())
            return decisions[-1]

        try:
            plan = build_plan(model, mesh, args, kwargs, options, once=record, pinned=pinned, device=device)
        except Exception as e:  # every rank waits for rank 0's plan: each must hear that there is none
            failure = ("error", type(e).__name__, str(e))
            decide_once(comm, lambda: failure)
            raise
        decide_once(comm, lambda: ("plan", decisions))
        return plan
    kind, *rest = decide_once(comm, None)  # rank 0 plans meanwhile; no lock held while waiting
    if kind == "error":
        from autoshard import errors

        cls = getattr(errors, rest[0], None)
        cls = cls if isinstance(cls, type) and issubclass(cls, AutoshardError) else AutoshardError
        raise cls(f"rank 0 failed to plan ({rest[0]}): {rest[1]}")
    replay = iter(rest[0])

    def replayed(decide):
        try:
            return next(replay)
        except StopIteration:
            raise PlanError(f"rank {comm.rank} asked for more planning decisions than rank 0 made: its "
                            "model, options or example shapes differ from rank 0's. Compile the same model "
                            "with the same options on every rank.") from None

    return build_plan(model, mesh, args, kwargs, options, once=replayed, pinned=pinned, device=device)
