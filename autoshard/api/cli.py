"""The ``autoshard`` command line: inspect a plan without writing a script, and calibrate the machine.

    $ autoshard show examples.models:gpt --mesh data=2,model=2 --megatron          # summary: repeated layers
    $ autoshard show examples.models:gpt --mesh model=2 --megatron --code --rank 1  # rank 1's generated code
    $ autoshard show examples.models:mlp --mesh data=2 --json                       # the plan as JSON
    $ autoshard show examples.models:llama3_8b_meta --mesh data=2,model=4 --megatron  # summary (fits COLUMNS)
    $ autoshard show examples.models:llama3_8b_meta --mesh model=4 --megatron --nodes # every node
    $ autoshard show mypkg.models:build --mesh model=2 --plan plan.toml --factory-arg layers=1
    $ autoshard plan examples.models:llama3_8b_meta --mesh data=2,model=4 --profile gpu-8x-nvlink \
          --factory-arg layers=2 --symbolic                                     # search + explain
    $ autoshard show examples.models:gpt --mesh pipe=2,model=2 --megatron --pipeline microbatches=4,schedule=1f1b
    $ autoshard calibrate --world-size 2 -o calibrated.toml                         # measure alpha-beta

``show`` imports ``MODULE`` (the current directory is put on ``sys.path`` first, so ``examples.models`` works
from the repository root), calls ``FACTORY(**factory_args)`` to get ``(model, args, kwargs)`` or
``(model, args)``, compiles the model on the mesh with the given annotations, and prints the plan. A plan file
holds ``{glob: [placement per mesh axis]}`` as JSON, or the same under a ``[plan]`` table as TOML.

Everything a user can get wrong (a bad ``MODULE:FACTORY``, a missing or malformed plan file, any
:class:`~autoshard.errors.AutoshardError` from the compiler) is reported as one red ``error: ...`` line on
stderr with exit code 2, never a traceback. ``rich`` colours only that line; the formatters stay plain text.

A model with repeated layers (or over 300 nodes) prints :func:`autoshard.compiler.report.format_overview` (module kinds
with repeated layers folded, parameter placements, collectives per layer, memory and step time); ``--nodes`` (the
default for other models) prints every node (:func:`autoshard.compiler.report.format_nodes`). Both fit the terminal's
width (``COLUMNS`` when set, 80 when piped): cells wrap, no name is cut. ``--code`` wraps long lines inside
brackets (:func:`autoshard.compiler.report.wrap_code`). ``--json`` gives JSON with every subcommand and mode
(``--pipeline``: the stages): numbers as numbers, placements as objects, a ``schema`` version. The defaults of
the options that ``compile`` also takes are read from ``compile``'s signature, so the two agree. Building,
compiling and searching show a spinner on stderr when they take over a second on a terminal, nothing when piped.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autoshard.errors import AutoshardError

#: Exit code of every user error (the code argparse uses for bad usage).
USAGE_ERROR = 2


class CliError(AutoshardError):
    """A mistake in the command line itself: the factory path, a plan file, a factory argument."""


# ---- argument parsing ---------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The ``autoshard`` parser with its ``show`` and ``calibrate`` subcommands."""
    parser = argparse.ArgumentParser(prog="autoshard", description="Inspect sharding plans without writing a "
                                     "script, and calibrate the machine.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    show = sub.add_parser("show", help="compile a model factory on a mesh and print its plan or generated code",
                          description="Compile MODULE:FACTORY on a mesh and print the plan (default), the "
                                      "generated code of one rank (--code) or the plan as JSON (--json).")
    _add_plan_arguments(show, planner="greedy")
    plan = sub.add_parser("plan", help="search the best plan for a model factory and explain it",
                          description="Compile MODULE:FACTORY with the plan search and print every node's "
                                      "strategy, cost and best rejected alternative, and the plan's estimated step "
                                      "time, memory and bytes per axis (--symbolic: the collectives' formulas).")
    _add_plan_arguments(plan, planner="search", mesh_required=False)
    plan.add_argument("--symbolic", action="store_true",
                      help="print each collective's bytes and time as formulas of the shapes and mesh sizes")
    plan.add_argument("--devices", type=int, default=None, metavar="N",
                      help="choose the configuration for N ranks instead of --mesh: every pipe x data x model "
                           "factorisation, with the pipeline's microbatches and schedule, is planned and priced, "
                           "the cheapest chosen (autoshard.api.cluster)")
    plan.add_argument("--no-pipelines", action="store_true",
                      help="with --devices: only data x model meshes (no pipe axis)")
    plan.add_argument("--context", action="store_true",
                      help="with --devices: also data x context x model meshes (and pipelines over them), the "
                           "sequence of attention sharded on `context` (context parallelism, head-tail balanced)")
    plan.add_argument("--gpus-per-node", type=int, default=None, metavar="G",
                      help="with --devices: ranks per node; the model axis stays inside a node (at most G)")
    plan.add_argument("--top", type=int, default=3, metavar="K",
                      help="with --devices: how many planned candidates to print (default 3)")
    plan.add_argument("--save", type=Path, default=None, metavar="FILE",
                      help="write the plan to FILE (JSON; autoshard.load_plan(FILE, model, inputs) applies it on "
                           "every rank without searching)")

    # calibrate's own parser reads its arguments; this entry only lists it in --help.
    sub.add_parser("calibrate", add_help=False, help="measure alpha-beta, FLOP/s and bandwidth of this machine "
                                                     "(see autoshard calibrate --help)")
    return parser


def compile_default(name: str) -> Any:
    """The default of ``autoshard.compile``'s keyword ``name`` (the CLI's flags take the same defaults)."""
    from autoshard.api.entry import compile as compile_

    return inspect.signature(compile_).parameters[name].default


def _add_plan_arguments(show: argparse.ArgumentParser, planner: str, mesh_required: bool = True) -> None:
    show.add_argument("factory", metavar="MODULE:FACTORY",
                      help="a function returning (model, args, kwargs), e.g. examples.models:gpt")
    show.add_argument("--mesh", required=mesh_required, help="logical mesh as NAME=SIZE,..., e.g. data=2,model=2"
                      + ("" if mesh_required else " (or --devices N: the mesh chosen)"))
    show.add_argument("--plan", metavar="FILE", type=Path,
                      help='annotations: JSON {"glob": ["R", "S(0)"]} or TOML with a [plan] table of the same')
    show.add_argument("--megatron", action="store_true",
                      help="annotate with examples.models.megatron(mesh, FACTORY) (Megatron tensor parallelism)")
    show.add_argument("--rank", type=int, default=0, help="rank whose code --code prints (default 0)")
    out = show.add_mutually_exclusive_group()
    out.add_argument("--code", action="store_true", help="print the generated Python code of --rank")
    out.add_argument("--json", action="store_true", help="print the plan as JSON (with --pipeline: its stages)")
    out.add_argument("--nodes", action="store_true", help="print the full per-node table (the default for "
                     "models without repeated layers, up to 300 nodes; others get the summary)")
    out.add_argument("--summary", action="store_true", help="print the summary (module kinds with repeated "
                     "layers folded, parameter placements, collectives per layer, memory and step time)")
    show.add_argument("--factory-arg", metavar="KEY=VALUE", action="append", default=[], dest="factory_args",
                      help="keyword argument of FACTORY (int, float or str), repeatable, e.g. layers=1")
    unsupported = compile_default("on_unsupported")
    show.add_argument("--on-unsupported", choices=("error", "replicate"), default=unsupported,
                      help=f"what to do with ops that have no sharding rule (default: {unsupported})")
    data_axis = compile_default("data_axis")
    show.add_argument("--data-axis", default=data_axis,
                      help=f"mesh axis the batch is split over (default: {data_axis})")
    show.add_argument("--pipeline", metavar="OPTIONS",
                      help="pipeline over the mesh's pipe axis and print its stages, e.g. "
                           "microbatches=4,schedule=1f1b,split=auto (split: auto or module paths joined by +)")
    show.add_argument("--planner", choices=("greedy", "search"), default=planner,
                      help=f"greedy propagation or the exact cost-model search (default: {planner})")
    profile = compile_default("profile")
    show.add_argument("--profile", default=profile,
                      help=f"hardware profile: cpu-gloo, gpu-8x-nvlink, multi-node or a TOML file (default {profile})")
    show.add_argument("--memory-limit", default=None, help="per-rank memory limit for the search, e.g. 2GiB")
    show.add_argument("--search-time-limit", type=float, default=None, metavar="SECONDS",
                      help="seconds for the search (default 120, with --devices 30 per candidate; the best plan "
                           "found by then is used, its gap warned about); a --memory-limit no plan meets is refused in "
                           "seconds whatever this is")
    # left out, --zero and --recompute are compile's defaults: auto when the search has a --memory-limit
    show.add_argument("--zero", default=compile_default("zero"), choices=("0", "1", "2", "3", "auto"),
                      help="ZeRO stage of parameter storage over the data axis; auto: the search picks (default: "
                           "auto for the search with --memory-limit, else 0)")
    show.add_argument("--recompute", default=compile_default("recompute"), metavar="GLOB|auto|none",
                      help="recompute these modules' activations in backward (glob over module paths), auto, or "
                           "none (default: auto for the search with --memory-limit, else none)")
    show.add_argument("--precision", default=None, metavar="PARAM[,REDUCE]",
                      help="mixed precision: compute dtype and gradient-reduce dtype, e.g. bfloat16,float32")
    show.add_argument("--moe", metavar="OPTIONS", default=None,
                      help="rewrite FFNs as Mixture-of-Experts layers, e.g. layers=blocks.*.mlp,every=2,num_experts=8,"
                           "top_k=2,capacity_factor=1.25 (see autoshard.MoE)")


def parse_precision(text: str | None):
    """``--precision bfloat16[,float32]`` → ``autoshard.MixedPrecision(param_dtype, reduce_dtype)``; None → None."""
    if not text:
        return None
    import torch

    from autoshard.frontend.precision import MixedPrecision

    names = [t.strip() for t in text.split(",")]
    dtypes = []
    for name in names:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype) or len(names) > 2:
            raise AutoshardError(f"--precision {text!r}: expected PARAM_DTYPE[,REDUCE_DTYPE] with torch dtype names, "
                                 "e.g. bfloat16 or bfloat16,float32.")
        dtypes.append(dtype)
    return MixedPrecision(*dtypes)


def main(argv: list[str] | None = None) -> int:
    """Run the ``autoshard`` command line; returns the exit code (0 ok, 2 user error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["calibrate"]:
        return calibrate(argv[1:])
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse already printed usage and the reason
        return e.code if isinstance(e.code, int) else USAGE_ERROR
    try:
        return show(args)
    except AutoshardError as e:
        print_error(str(e))
        return USAGE_ERROR


def calibrate(argv: list[str]) -> int:
    """``autoshard calibrate`` (its own parser, in autoshard.cost_models.calibrate); ``--json`` prints the profile
    it wrote as JSON instead of the fit table. A spinner shows on a terminal while the processes measure."""
    import contextlib
    import io

    from autoshard.cost_models.calibrate import main as calibrate_main
    from autoshard.progress import slow_step

    want_json = "--json" in argv
    rest = [a for a in argv if a != "--json"]
    if "-h" in rest or "--help" in rest:
        return calibrate_main(rest)
    with slow_step("autoshard: calibrating this machine (spawning processes)"):
        if not want_json:
            return calibrate_main(rest)
        with contextlib.redirect_stdout(io.StringIO()):
            code = calibrate_main(rest)
    if code:
        return code
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("-o", "--output", default="calibrated.toml")
    path = Path(where.parse_known_args(rest)[0].output)
    profile = _toml_module().loads(path.read_text())
    sys.stdout.write(json.dumps({"profile_file": str(path), "profile": profile}, indent=1, default=str) + "\n")
    return 0


def print_error(message: str) -> None:
    """One red ``error: ...`` line on stderr (not wrapped, so it stays one line when piped)."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, highlight=False).print(f"[bold red]error:[/bold red] {escape(message)}", soft_wrap=True)


# ---- show -----------------------------------------------------------------------------------------------------
def show(args: argparse.Namespace) -> int:
    """The ``show``/``plan`` subcommands: compile and print the table (the summary for graphs over
    ``SUMMARY_NODES`` nodes), the code of ``args.rank`` or the JSON (``--pipeline``: the stages)."""
    import autoshard
    from autoshard.progress import slow_step
    from autoshard.compiler.report import format_nodes, format_overview, format_symbolic, plan_document, stages_json
    from autoshard.compiler.report import fit_text, wants_summary, wrap_code

    devices = getattr(args, "devices", None)
    if (args.mesh is None) == (devices is None):
        raise CliError("autoshard plan needs either --mesh NAME=SIZE,... (plan that mesh) or --devices N (choose "
                       "the mesh for N ranks), not both and not neither.")
    if devices is None and getattr(args, "gpus_per_node", None) is not None:
        raise CliError("--gpus-per-node shapes the meshes --devices N chooses among, but --mesh was given: drop one.")
    if devices is not None:
        return plan_devices(args)
    mesh = autoshard.Mesh.parse(args.mesh)
    factory, name = load_factory(args.factory)
    with slow_step(f"autoshard: building the model ({args.factory})"):
        model, example_args, example_kwargs = call_factory(factory, args.factory,
                                                           parse_factory_args(args.factory_args))
    annotations: dict[str, Any] = {}
    if args.megatron:
        annotations.update(megatron_plan(mesh, name))
    if args.plan is not None:
        annotations.update(load_plan(args.plan, mesh.names))
    with slow_step(f"autoshard: compiling {type(model).__name__} on {mesh}"):
        sm = autoshard.compile(model, mesh, example_args, example_kwargs, annotations=annotations,
                               data_axis=args.data_axis, on_unsupported=args.on_unsupported, planner=args.planner,
                               profile=args.profile, memory_limit=args.memory_limit,
                               pipeline=autoshard.Pipeline.parse(args.pipeline) if args.pipeline else None,
                               moe=autoshard.MoE.parse(args.moe) if getattr(args, "moe", None) else None,
                               zero=_zero(args.zero), recompute=_recompute(args.recompute),
                               precision=parse_precision(args.precision), **_search_options(args))
    symbolic = getattr(args, "symbolic", False)
    if args.pipeline:  # the stages (or --rank's program of its stage)
        if args.json:
            doc = stages_json(sm.plan)
            doc.update(pipeline_figures(sm.plan))
            sys.stdout.write(json.dumps(doc, indent=1, default=str) + "\n")
        else:
            sys.stdout.write(wrap_code(sm.code(args.rank), _width()) if args.code else fit_text(sm.format(), _width()))
        return 0
    plan = sm.plan
    if getattr(args, "save", None) is not None:
        plan.save(args.save)
    if args.code:
        sys.stdout.write(wrap_code(plan.code(args.rank), _width()))
    elif args.json:
        doc = plan_document(plan)
        cost = plan.cost()
        doc.update(pipeline=None, step_time_s=cost.step_time, memory_per_rank_bytes=float(cost.memory_per_rank))
        if symbolic:
            doc["symbolic"] = format_symbolic(plan).splitlines()[1:]
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    else:
        summary = args.summary or (not args.nodes and wants_summary(plan))
        sys.stdout.write(format_overview(plan, width=_width()) if summary else format_nodes(plan, width=_width()))
        if symbolic:
            sys.stdout.write(fit_text(format_symbolic(plan), _width()))
    return 0


def pipeline_figures(pplan) -> dict:
    """``pipeline`` (its options), ``step_time_s`` (:meth:`PipelinePlan.cost`) and ``memory_per_rank_bytes`` (the
    largest rank's :meth:`PipelinePlan.rank_memory`: the sum of :meth:`PipelinePlan.stage_memory` over its stages)
    of a pipelined plan, for ``--json``."""
    import dataclasses

    p = pplan.pipeline
    options = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
    return {"pipeline": options, "step_time_s": pplan.cost().step_time,
            "memory_per_rank_bytes": float(pplan.memory_per_rank())}


def plan_devices(args: argparse.Namespace) -> int:
    """``autoshard plan --devices N``: every candidate mesh planned and priced (:mod:`autoshard.api.cluster`); the
    chosen one's figures and the best ``--top`` candidates as JSON (``--json``) or a table, the chosen plan saved
    with ``--save``."""
    import autoshard
    from autoshard.api.cluster import describe, plan_cluster
    from autoshard.progress import slow_step

    for flag, bad in (("--megatron", args.megatron), ("--plan", args.plan is not None),
                      ("--pipeline", bool(args.pipeline)), ("--code", args.code), ("--symbolic", args.symbolic)):
        if bad:
            raise CliError(f"{flag} needs one mesh, but --devices chooses among several: give --mesh instead.")
    if args.planner != "search":
        raise CliError("--devices compares the plans of the search (--planner search), not the greedy planner's.")
    factory, _ = load_factory(args.factory)
    with slow_step(f"autoshard: building the model ({args.factory})"):
        model, example_args, example_kwargs = call_factory(factory, args.factory,
                                                           parse_factory_args(args.factory_args))
    zero, recompute = _zero(args.zero), _recompute(args.recompute)  # left out: Search's "auto", as compile's
    search = autoshard.Search(profile=args.profile, memory_limit=args.memory_limit,
                              zero="auto" if zero is None else zero,
                              recompute="auto" if recompute is None else recompute,
                              time_limit=getattr(args, "search_time_limit", None))
    with slow_step(f"autoshard: planning {type(model).__name__} on every mesh of {args.devices} devices"):
        chosen = plan_cluster(model, example_args, example_kwargs, devices=args.devices,
                              gpus_per_node=args.gpus_per_node, search=search, data_axis=args.data_axis,
                              pipelines=not args.no_pipelines, context_axis="context" if args.context else None,
                              on_unsupported=args.on_unsupported, precision=parse_precision(args.precision),
                              moe=autoshard.MoE.parse(args.moe) if args.moe else None)
    best = chosen.best  # no plan at all: a PlanError naming each mesh's reason
    if args.save is not None:
        best.plan.save(args.save)
    if args.json:
        sys.stdout.write(json.dumps(chosen.as_json(args.top), indent=1) + "\n")
        return 0
    lines = [f"autoshard plan: {type(model).__name__} on {args.devices} devices"
             + (f", {args.gpus_per_node} per node" if args.gpus_per_node else "") + f", profile {args.profile}",
             f"{'configuration':<36} {'step time':>12} {'memory/rank':>14}  note"]
    for c in chosen.candidates:
        mesh = describe(c)
        step = "-" if c.step_time_s is None else f"{c.step_time_s * 1e3:.4g} ms"
        memory = "-" if c.memory_per_rank_bytes is None else f"{c.memory_per_rank_bytes / 2**20:.4g} MiB"
        note = "chosen" if c is best else (c.pruned or c.failed or "")
        lines.append(f"{mesh:<36} {step:>12} {memory:>14}  {note}")
    sys.stdout.write(fit_lines(lines) + "\n")
    return 0


def fit_lines(lines: list[str]) -> str:
    """``lines`` with each note cut to the terminal's width (the reasons of pruned meshes are long)."""
    width = _width()
    return "\n".join(ln if len(ln) <= width else ln[:width - 1] + "…" for ln in lines)


def _search_options(args: argparse.Namespace) -> dict:
    """compile's keywords for the search's own flags given on the command line (left out: compile's defaults)."""
    limit = getattr(args, "search_time_limit", None)
    return {} if limit is None else {"search_time_limit": limit}


def _zero(text: str | None) -> int | str | None:
    """``--zero``: None (left out: compile's default), "auto", or a stage."""
    return text if text in (None, "auto") else int(text)


def _recompute(text: str | None) -> str | bool | None:
    """``--recompute``: None (left out: compile's default), ``none`` (False: no recomputation), a glob or auto."""
    return False if text is not None and text.lower() == "none" else text


def _width() -> int:
    """The terminal's width (``COLUMNS`` when set); 80 when piped."""
    return max(40, shutil.get_terminal_size((80, 24)).columns)


def load_factory(spec: str) -> tuple[Callable[..., Any], str]:
    """``"pkg.mod:name"`` → (the callable, ``name``); the current directory is importable."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"factory {spec!r} is not MODULE:FACTORY. Write e.g. examples.models:gpt.")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        missing = getattr(e, "name", None)
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise CliError(f"factory {spec!r} names module `{module_name}`, but it cannot be imported ({e}). "
                           f"Run from the directory that contains it (now {cwd}) or install its package.") from e
        raise CliError(f"importing module `{module_name}` for factory {spec!r} failed: {e}. Install what it "
                       "needs.") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        found = sorted(n for n, v in vars(module).items()
                       if inspect.isfunction(v) and v.__module__ == module.__name__ and not n.startswith("_"))
        what = "has no attribute" if factory is None else "has a non-callable attribute"
        raise CliError(f"module `{module_name}` {what} `{attr}`, but FACTORY must be a function of it. "
                       f"Functions it defines: {', '.join(found) or 'none'}.")
    return factory, attr


def parse_factory_args(items: list[str]) -> dict[str, int | float | str]:
    """``["layers=1", "lr=0.1", "name=x"]`` → ``{"layers": 1, "lr": 0.1, "name": "x"}``."""
    out: dict[str, int | float | str] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise CliError(f"--factory-arg {item!r} is not KEY=VALUE. Write e.g. --factory-arg layers=1.")
        out[key] = _scalar(text.strip())
    return out


def _scalar(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def call_factory(factory: Callable[..., Any], spec: str, kwargs: dict) -> tuple[Any, tuple, dict]:
    """Call the factory and normalise its result to ``(model, args, kwargs)``."""
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as e:
        raise CliError(f"factory {spec!r} does not accept the arguments {kwargs}: {e}. It takes "
                       f"{inspect.signature(factory)}; pass them as --factory-arg KEY=VALUE.") from e
    except ValueError:  # no signature (a builtin): let the call itself check
        pass
    result = factory(**kwargs)
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise CliError(f"factory {spec!r} returned {type(result).__name__}, but must return (model, args, kwargs) "
                       "or (model, args).")
    model, args = result[0], result[1]
    kw = result[2] if len(result) == 3 else {}
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    return model, args, dict(kw or {})


def megatron_plan(mesh, name: str) -> dict:
    """The Megatron annotations of ``examples.models`` for factory ``name`` on ``mesh``."""
    try:
        models = importlib.import_module("examples.models")
    except ImportError as e:
        raise CliError(f"--megatron needs the module `examples.models` ({e}). Run from the repository root, or "
                       "give the annotations with --plan FILE.") from e
    if name not in models.MEGATRON:
        raise CliError(f"--megatron has no plan for factory `{name}`, but only for {sorted(models.MEGATRON)}. "
                       "Give the annotations with --plan FILE instead.")
    return models.megatron(mesh, name)


def load_plan(path: Path, axes: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """Read ``{glob: [placement per axis]}`` from a JSON file, or from the ``[plan]`` table of a TOML file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CliError(f"plan file {str(path)!r} does not exist. Check the path given to --plan.") from None
    except OSError as e:
        raise CliError(f"plan file {str(path)!r} cannot be read: {e.strerror}.") from None
    if path.suffix.lower() == ".toml":
        toml = _toml_module()
        try:
            data = toml.loads(text)
        except toml.TOMLDecodeError as e:
            raise CliError(f"plan file {str(path)!r} is not valid TOML: {e}.") from None
        if not isinstance(data.get("plan"), dict):
            raise CliError(f"plan file {str(path)!r} has no [plan] table, but a TOML plan needs one, e.g. "
                           f'[plan] "fc1.weight" = {_example_spec(axes)}.')
        data = data["plan"]
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise CliError(f"plan file {str(path)!r} is not valid JSON: {e.msg} at line {e.lineno} column "
                           f"{e.colno}. Fix it, or use a .toml file with a [plan] table.") from None
        if not isinstance(data, dict):
            raise CliError(f"plan file {str(path)!r} holds a JSON {type(data).__name__}, but must hold an object "
                           f'{{"glob": {_example_spec(axes)}, ...}}.')
    plan = {}
    for glob, spec in data.items():
        if not isinstance(spec, list) or not all(isinstance(p, str) for p in spec):
            raise CliError(f"plan file {str(path)!r} has {glob!r} = {spec!r}, but each entry must be a list of "
                           f"placements, one per mesh axis {list(axes)}, e.g. {_example_spec(axes)}.")
        plan[glob] = tuple(spec)
    return plan


def _toml_module():
    try:
        import tomllib

        return tomllib
    except ImportError:  # Python 3.10: the same parser as a package
        try:
            import tomli

            return tomli
        except ImportError:
            raise CliError("a TOML plan file needs Python 3.11 or the tomli package (pip install tomli). "
                           "Or write the plan as JSON.") from None


def _example_spec(axes: tuple[str, ...]) -> str:
    return json.dumps(["R"] * (len(axes) - 1) + ["S(0)"])
