"""Formatters of plans: pure functions returning text (golden-file friendly) or JSON-ready data.

* :func:`format_plan` — every node in one table, as wide as it needs (the golden files keep it);
* :func:`format_nodes` — the same table fitted to a width: cells wrap, nothing is cut;
* :func:`format_overview` — the summary (repeated layers folded), fitted to a width; :func:`wants_summary` says
  when ``show`` prints it by default;
* :func:`plan_document` — the plan as data for ``--json`` (:data:`JSON_SCHEMA` versions its layout): numbers are
  numbers, placements are ``{"axis", "type", "dim"/"reduce_op"}`` objects;
* :func:`wrap_code` — generated code with long lines broken inside brackets (still valid Python).

``rich`` is used only by :func:`show_plan`, to print these texts on a console.
"""

from __future__ import annotations

import json
import math

import torch

from autoshard import meta as M
from autoshard.placements import format_spec


def _rows(plan):
    for n in plan.graph_module.graph.nodes:
        if n.op == "output":
            continue
        val = n.meta.get("val")
        shape = list(val.shape) if isinstance(val, torch.Tensor) else "-"
        spec = n.meta.get(M.SPEC)
        if isinstance(spec, tuple) and spec and isinstance(spec[0], tuple):
            spec_text = " ".join(format_spec(s) for s in spec)
        else:
            spec_text = format_spec(spec)
        coll = n.meta.get(M.COLLECTIVE)
        if coll is not None:
            op = f"{coll.kind}[{','.join(coll.axes)}]"
            comm = f"{coll.bytes_forward}/{coll.bytes_backward}"
        else:
            op = n.op if n.op != "call_function" else str(getattr(n.target, "__name__", n.target))
            comm = ""
        strat = n.meta.get(M.STRATEGY)
        dec = n.meta.get(M.DECISION)
        yield {"node": n.name, "op": op, "shape": shape, "spec": spec_text, "module": M.module_path(n),
               "comm_bytes": comm, "strategy": strat.note if strat is not None else "",
               "cost": _fmt_cost(dec.cost, dec) if dec else "",
               "alternative": (f"{dec.alternative.note} {_fmt_cost(dec.alternative_cost, dec)}"
                               if dec and dec.alternative is not None else "")}


def _fmt_cost(value, dec) -> str:
    if value is None:
        return ""
    if dec.reason.startswith("least estimated"):
        return f"{value * 1e6:.1f}us"
    return f"{value:.0f}B"


def format_plan(plan) -> str:
    """The annotated graph as a plain-text table: node, op, global shape, spec per mesh axis, collective bytes."""
    rows = list(_rows(plan))
    head = f"plan for {plan.model_name} on {plan.mesh}  (spec: one placement per axis {list(plan.mesh.names)})"
    cols = ["node", "op", "shape", "spec", "strategy", "cost", "alternative", "comm_bytes", "module"]
    table = [[str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) if table else len(c) for i, c in enumerate(cols)]
    lines = [head, "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(t, widths)).rstrip() for t in table]
    lines.append(format_summary(plan))
    moe = format_moe(plan)
    if moe:
        lines.append(moe)
    return "\n".join(lines) + "\n"


def format_summary(plan) -> str:
    counts: dict[str, int] = {}
    fwd = bwd = 0
    for _, info in plan.collectives():
        key = f"{info.kind}[{','.join(info.axes)}]"
        counts[key] = counts.get(key, 0) + 1
        fwd += info.bytes_forward
        bwd += info.bytes_backward
    parts = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "none"
    text = f"collectives: {parts}; bytes per rank forward {fwd}, backward {bwd}"
    cost = plan.cost()
    text += f"\nmemory per rank (estimated peak): {_bytes(cost.memory_per_rank)} = {_memory_text(memory_by_kind(cost))}"
    search = plan.context.report.get("plan_search")
    if search is not None:
        axes = ", ".join(f"{a} {b:.0f}B" for a, b in cost.comm_bytes.items())
        limit = search["memory_limit"]
        text += (f"\nestimated step time {_ms(cost.step_time)} ({_step_parts(cost)}) on profile {search['profile']}; "
                 f"bytes per axis: {axes}; memory per rank {cost.memory_per_rank / 2**20:.1f} MiB"
                 + (f" of {limit / 2**20:.1f} MiB allowed" if limit else "")
                 + f"; binding constraint: {search['binding']}; search: {search['decisions']} decisions "
                 "(repeated layers shared), "
                 + ("solved exactly" if search["optimal"] else f"within {search['gap']:.2%} of its lower bound"
                    + (" (stopped by its time limit)" if search.get("timed_out") else "")))
    return text


def _ms(t: float) -> str:
    """Seconds as milliseconds to 4 significant digits (within 0.05% of ``t``, whatever its size)."""
    return f"{t * 1e3:.4g} ms"


def _step_parts(cost) -> str:
    """What a :class:`~autoshard.cost_models.plan_cost.PlanCost`'s step time adds up: compute, communication, and
    the optimizer step and the profile's step overhead where the profile prices them."""
    parts = [f"compute {_ms(cost.compute_time)}", f"communication {_ms(cost.comm_time)}"]
    if getattr(cost, "optimizer_time", 0.0):
        parts.append(f"optimizer {_ms(cost.optimizer_time)}")
    if getattr(cost, "overhead_time", 0.0):
        parts.append(f"step overhead {_ms(cost.overhead_time)}")
    return ", ".join(parts)


def search_json(plan) -> dict | None:
    """What the plan search said of its plan (None: no search): its own estimate of the step time and memory per
    rank (equal to ``plan.cost()``'s), the memory limit, whether the limit changed the plan
    (``memory_limit_binding``: the least-time plan exceeds it; None: not known) and the binding constraint, how
    close to optimal it is."""
    search = plan.context.report.get("plan_search")
    if search is None:
        return None
    return {"step_time_s": search["step_time"], "memory_per_rank_bytes": search["memory_per_rank"],
            "memory_limit_bytes": search["memory_limit"], "memory_limit_binding": search.get("memory_limit_binding"),
            "binding": search["binding"], "optimal": search["optimal"], "gap": search["gap"],
            "profile": search["profile"], "decisions": search["decisions"]}


def memory_by_kind(cost) -> dict:
    """{kind: bytes per rank} of a :class:`~autoshard.cost_models.plan_cost.PlanCost` (its MemoryBreakdown), with
    the ZeRO stages as {stage: parameters}."""
    return cost.memory.as_dict() if cost.memory is not None else {"peak": cost.memory_per_rank}


def _memory_text(kinds: dict) -> str:
    parts = [f"{k} {_bytes(kinds[k])}" for k in ("parameters", "gradients", "optimizer", "activations", "gathered",
                                                  "temporaries", "buffers") if kinds.get(k)]
    stages = kinds.get("stages") or {}
    zero = ", ".join(f"{n} at {s}" for s, n in sorted(stages.items(), key=lambda kv: int(kv[0])) if n)
    return " + ".join(parts) + (f" (ZeRO stage: parameters {zero})" if zero and set(stages) != {0} else "")


#: Version of the layout of :func:`plan_document` (``autoshard show --json``); raised when a field changes meaning.
JSON_SCHEMA = 2


def placement_json(p, axis: str) -> dict:
    """One placement as data: ``{"axis": "model", "type": "Shard", "dim": 0}``, ``{"type": "Replicate"}``,
    ``{"type": "Partial", "reduce_op": "sum"}``."""
    if type(p).__name__ == "Shard" or hasattr(p, "dim") and not hasattr(p, "reduce_op"):
        return {"axis": axis, "type": "Shard", "dim": int(p.dim)}
    if hasattr(p, "reduce_op"):
        return {"axis": axis, "type": "Partial", "reduce_op": str(p.reduce_op)}
    return {"axis": axis, "type": "Replicate"}


def spec_json(spec, mesh) -> list | None:
    """A spec as a list of :func:`placement_json` (one per mesh axis); a multi-output node's specs as a list of
    those; None for a node without a spec."""
    if spec is None:
        return None
    if isinstance(spec, tuple) and spec and isinstance(spec[0], tuple):
        return [spec_json(s, mesh) for s in spec]
    return [placement_json(p, axis) for p, axis in zip(spec, mesh.names)]


def _cost_json(value, dec) -> dict | None:
    if value is None:
        return None
    unit = "s" if dec.reason.startswith("least estimated") else "bytes"
    return {"value": float(value), "unit": unit}


def node_json(n, mesh) -> dict:
    """One node of the plan as data (an entry of ``plan_document(plan)["nodes"]``)."""
    val = n.meta.get("val")
    spec = n.meta.get(M.SPEC)
    coll = n.meta.get(M.COLLECTIVE)
    strat = n.meta.get(M.STRATEGY)
    dec = n.meta.get(M.DECISION)
    op = n.op if n.op != "call_function" else str(getattr(n.target, "__name__", n.target))
    return {
        "node": n.name, "op": op, "kind": n.op,
        "shape": [int(d) for d in val.shape] if isinstance(val, torch.Tensor) else None,
        "dtype": str(val.dtype).replace("torch.", "") if isinstance(val, torch.Tensor) else None,
        "spec": spec_json(spec, mesh), "spec_text": _spec_text(spec) if spec is not None else None,
        "module": M.module_path(n),
        "collective": None if coll is None else {
            "kind": coll.kind, "axes": list(coll.axes), "dims": [int(d) for d in coll.dims],
            "src": spec_json(coll.src, mesh), "dst": spec_json(coll.dst, mesh),
            "bytes_forward": int(coll.bytes_forward), "bytes_backward": int(coll.bytes_backward)},
        "strategy": strat.note if strat is not None and strat.note else None,
        "cost": _cost_json(dec.cost, dec) if dec is not None else None,
        "alternative": None if dec is None or dec.alternative is None else {
            "strategy": dec.alternative.note, "cost": _cost_json(dec.alternative_cost, dec)},
    }


def plan_document(plan) -> dict:
    """The plan as JSON-ready data: ``schema`` (:data:`JSON_SCHEMA`), model, mesh, every node of the graph
    (:func:`node_json`; ``len(nodes) == overview["nodes"]``), the collectives' totals and the
    :func:`plan_overview`. Every number is an int or a float."""
    gm, mesh = plan.graph_module, plan.mesh
    nodes = [node_json(n, mesh) for n in gm.graph.nodes]
    colls = plan.collectives()
    counts: dict[str, int] = {}
    for _, info in colls:
        key = f"{info.kind}[{','.join(info.axes)}]"
        counts[key] = counts.get(key, 0) + 1
    return {"schema": JSON_SCHEMA, "model": plan.model_name, "mesh": dict(mesh.axes), "nodes": nodes,
            "collectives": {"count": len(colls), "by_kind": dict(sorted(counts.items())),
                            "bytes_forward": sum(int(c.bytes_forward) for _, c in colls),
                            "bytes_backward": sum(int(c.bytes_backward) for _, c in colls)},
            "overview": plan_overview(plan)}


def plan_json(plan) -> str:
    """:func:`plan_document` as JSON text."""
    return json.dumps(plan_document(plan), indent=1)


def has_repeated_layers(plan) -> bool:
    """Whether the graph has a container of repeated layers (``model.layers.0``, ``.1``, ... alike) to fold."""
    nodes = [(n, _owner(n)) for n in plan.graph_module.graph.nodes if n.op not in ("placeholder", "output")]
    return bool(_foldable(nodes))


def wants_summary(plan) -> bool:
    """``show`` prints the summary (:func:`format_overview`) by default for a model with repeated layers or over
    :data:`SUMMARY_NODES` nodes, and the per-node table (:func:`format_nodes`) otherwise."""
    return len(plan.graph_module.graph.nodes) > SUMMARY_NODES or has_repeated_layers(plan)


def format_nodes(plan, width: int = 80) -> str:
    """The per-node table of :func:`format_plan` fitted to ``width`` columns. When all columns do not fit, the
    table keeps node, op, shape, spec and collective bytes, and each node's strategy, cost, best rejected
    alternative and module follow on an indented line. Long cells wrap; no name is cut."""
    rows = list(_rows(plan))
    head = (f"autoshard plan: {plan.model_name} on {plan.mesh}, every node (spec: one placement per axis "
            f"{', '.join(plan.mesh.names)})")
    names = {"node": "node", "op": "op", "shape": "global shape", "spec": "spec", "strategy": "strategy",
             "cost": "cost", "alternative": "best rejected (cost)", "comm_bytes": "comm fwd/bwd", "module": "module"}
    cols = [c for c in names if c in ("node", "op", "spec") or any(r[c] not in ("", "-") for r in rows)]
    for r in rows:  # the overload name adds width, not information
        r["op"] = r["op"].removesuffix(".default")
    table = [[str(r[c]) for c in cols] for r in rows]
    natural = [max(len(names[c]), *(len(t[i]) for t in table)) if table else len(names[c])
               for i, c in enumerate(cols)]
    lines = _wrap_prose([head], width)
    if sum(natural) + 2 * (len(cols) - 1) <= width:
        lines += _table([names[c] for c in cols], table, set(), width)
    else:
        main = [c for c in cols if c in ("node", "op", "shape", "spec", "comm_bytes")]
        extra = [c for c in cols if c not in main]
        body: list[list[str]] = []
        details: list[str] = []
        for r in rows:
            body.append([str(r[c]) for c in main])
            details.append(", ".join(f"{names[c]} {r[c]}" for c in extra if r[c]))
        fitted = _table([names[c] for c in main], body, set(), width, groups=True)
        lines += fitted[0]
        for row_lines, detail in zip(fitted[1:], details):
            lines += row_lines
            if detail:
                lines += _wrap_prose(["    " + detail], width, indent="      ")
    lines += _wrap_prose(format_summary(plan).splitlines(), width)
    moe = format_moe(plan)
    if moe:
        lines += _wrap_prose(moe.splitlines(), width)
    return "\n".join(lines) + "\n"


def wrap_code(code: str, width: int = 80) -> str:
    """Generated Python code with every line over ``width`` characters broken after an opening bracket or a comma
    inside brackets (or at a space outside them, with a backslash), the continuation lines indented four more than
    the statement, and ``a; b`` split into two lines. The result is the same program (the same AST);
    a line with no place to break at stays as it is."""
    import io
    import tokenize

    def tokens_of(line: str):
        try:
            return list(tokenize.generate_tokens(io.StringIO(line + "\n").readline))
        except (tokenize.TokenError, SyntaxError):  # not one complete logical line: leave it
            return None

    lines = []
    for line in code.splitlines():  # `a = f(x);  y = None` -> one statement per line
        tokens = tokens_of(line) if len(line) > width and ";" in line else None
        semis = [t.start[1] for t in tokens or () if t.type == tokenize.OP and t.string == ";"]
        depth_zero = tokens is not None and all(
            sum(1 if t.string in "([{" else -1 for t in tokens if t.type == tokenize.OP and t.string in "()[]{}"
                and t.start[1] < c) == 0 for c in semis)
        if not semis or not depth_zero:
            lines.append(line)
            continue
        indent = line[:len(line) - len(line.lstrip())]
        for a, b in zip([-1, *semis], [*semis, len(line)]):
            if line[a + 1:b].strip():
                lines.append(indent + line[a + 1:b].strip())
    out = []
    for line in lines:
        if len(line) <= width:
            out.append(line)
            continue
        tokens = tokens_of(line)
        if tokens is None:
            out.append(line)
            continue
        cuts, depth, prev_end = [], 0, 0  # (column, needs a backslash): after "(" or ",", or at a space outside
        for tok in tokens:
            if tok.type in (tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER, tokenize.COMMENT):
                continue
            if depth == 0 and tok.start[1] > prev_end > 0:
                cuts.append((tok.start[1], True))
            if tok.type == tokenize.OP and tok.string in "([{":
                depth += 1
                cuts.append((tok.end[1], False))
            elif tok.type == tokenize.OP and tok.string in ")]}":
                depth -= 1
            elif tok.type == tokenize.OP and tok.string == "," and depth > 0:
                cuts.append((tok.end[1], False))
            prev_end = tok.end[1]
        indent = " " * (len(line) - len(line.lstrip()) + 4)
        start, prefix = 0, ""
        while len(prefix) + len(line) - start > width:
            later = [(c, bs) for c, bs in cuts if c > start and line[start:c].strip()]
            fits = [(c, bs) for c, bs in later if len(prefix) + c - start + (2 if bs else 0) <= width]
            cut = fits[-1] if fits else (later[0] if later else None)
            if cut is None:
                break
            col, backslash = cut
            out.append(prefix + line[start:col].rstrip() + (" \\" if backslash else ""))
            start, prefix = col + (len(line[col:]) - len(line[col:].lstrip())), indent
        out.append(prefix + line[start:])
    return "\n".join(out) + ("\n" if code.endswith("\n") else "")


def show_plan(plan, console=None, nodes: bool | None = None) -> None:
    """Print the plan on a ``rich`` console at its width: the summary (:func:`format_overview`) for a model with
    repeated layers (:func:`wants_summary`), else every node (:func:`format_nodes`); ``nodes`` forces either."""
    from rich.console import Console

    console = console or Console()
    width = max(40, console.width)
    summary = wants_summary(plan) if nodes is None else not nodes
    text = format_overview(plan, width=width) if summary else format_nodes(plan, width=width)
    console.print(text, markup=False, highlight=False, soft_wrap=True, end="")


def format_stages(pplan) -> str:
    """A pipelined plan's stages: modules, estimated time and memory, boundary tensors and their bytes, the
    imbalance (max / mean stage cost), the schedule's theoretical bubble fraction and the estimated step
    (:meth:`autoshard.compiler.pipeline.PipelinePlan.cost`, to 4 significant digits)."""
    split, p = pplan.split, pplan.pipeline
    estimate = pplan.cost()
    lines = [(f"pipeline for {pplan.model_name} on {pplan.mesh}: {split.stages} stages "
              f"({'manual' if split.manual else 'auto'} split), schedule {p.schedule}, {p.microbatches} microbatches "
              f"of {pplan.batch // p.microbatches} rows; stages run on {pplan.submesh} inside")]
    cols = ["stage", "ranks", "time/mb (ms)", "compute+comm", "transfer", "once/step", "memory (MiB)", "modules"]
    rows = []
    for s, cost in enumerate(estimate.microbatch):
        ranks = [r for r in range(pplan.mesh.size) if s in pplan.stages_of(r)]
        mods = list(split.modules[s])
        shown = ", ".join(mods if len(mods) <= 6 else [*mods[:3], "...", *mods[-2:]])
        rows.append([str(s), ",".join(map(str, ranks)), f"{cost * 1e3:.3f}", f"{split.compute[s] * 1e3:.3f}",
                     f"{split.transfer[s] * 1e3:.3f}", f"{estimate.once[s] * 1e3:.3f}",
                     f"{pplan.stage_memory(s, ranks[0]) / 2**20:.2f}", shown])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    for k, b in enumerate(split.boundaries):
        tensors = ", ".join(f"{n} {list(sh)} {str(dt).replace('torch.', '')}"
                            for n, sh, dt in zip(b.names, b.shapes, b.dtypes))
        lines.append(f"boundary {k}->{k + 1}: {tensors}; {b.nbytes} bytes per microbatch per rank")
    shared = pplan.shared_params()
    if shared:
        lines.append("shared parameters (gradients summed over their stages): "
                     + ", ".join(f"{n} (stages {', '.join(map(str, s))})" for n, s in shared))
    v = p.stages_per_rank if p.schedule == "interleaved" else 1
    formula = "(p-1)/(v*m+p-1)" if v > 1 else "(p-1)/(m+p-1)"
    lines.append(f"imbalance (max/mean stage cost): {split.imbalance:.3f}; theoretical bubble {formula}: "
                 f"{estimate.bubble:.3f}; estimated step: {_ms(estimate.step_time)} (slowest rank: "
                 f"microbatches x its stages' time/mb / (1 - bubble) + their once/step"
                 + (f" + step overhead {estimate.overhead * 1e3:.3f} ms" if estimate.overhead else "") + ")")
    return "\n".join(lines) + "\n"


def format_symbolic(plan) -> str:
    """Every inserted collective's bytes on the wire and time as formulas: shapes (b, s for the first input's
    dims, d<size> otherwise), mesh sizes n_<axis>, and the link's alpha/beta."""
    import sympy

    from autoshard.compiler.collective_kinds import KINDS
    from autoshard.cost_models.alpha_beta import collective_bytes_on_wire, time_expr

    names: dict[int, sympy.Symbol] = {}
    first = next((n for n in plan.graph_module.graph.nodes if n.op == "placeholder"
                  and isinstance(n.meta.get("val"), torch.Tensor)), None)
    if first is not None:
        for letter, size in zip("bs", first.meta["val"].shape):
            names.setdefault(int(size), sympy.Symbol(letter))

    def sym(size: int):
        return names.setdefault(int(size), sympy.Symbol(f"d{int(size)}"))

    lines = ["collective formulas (bytes on the wire per rank; time = steps*alpha + bytes*beta):"]
    for n in plan.graph_module.graph.nodes:
        info = n.meta.get(M.COLLECTIVE)
        if info is None:
            continue
        x = n.args[0]
        val = x.meta["val"]
        spec = info.src if info.kind != "all_gather" else info.dst
        nbytes = sympy.Integer(val.element_size())
        for d, size in enumerate(val.shape):
            term = sym(size)
            for axis, p in zip(plan.mesh.names, spec):
                if getattr(p, "dim", None) == d and type(p).__name__ == "Shard":
                    term = term / sympy.Symbol(f"n_{axis}")
            nbytes = nbytes * term
        row = KINDS[info.kind]
        kind = row.forward or row.backward  # the primitive it runs (local_slice, grad_all_reduce: in backward)
        for axis in info.axes:
            nsym = sympy.Symbol(f"n_{axis}")
            wire = sympy.simplify(collective_bytes_on_wire(kind, nbytes, nsym))
            t = time_expr(kind, nbytes, nsym)
            lines.append(f"  {n.name}: {info.kind} on {axis}: bytes {wire}; time {sympy.simplify(t)}")
    if len(lines) == 1:
        used = [a for a, (split, _) in plan.context.report.get("axis_use", {}).items() if split]
        lines.append("  none: this plan inserts no collective (" + (
            f"axes {', '.join(f'`{a}`' for a in used)} split work that needs no communication)" if used
            else "every rank runs the whole step on the same data)"))
    return "\n".join(lines) + "\n"


def format_moe(plan) -> str:
    """One line per MoE layer of the expert rewrite: experts and where they live, routing groups, capacity, the
    dispatch buffer and the all-to-all volume per step (empty text when the plan has no MoE layer)."""
    info = plan.context.report.get("expert_rewrite")
    if not info or not info["layers"]:
        return ""
    axis = info["expert_axis"]
    n = plan.mesh.axis_size(axis) if axis in plan.mesh.names else 1
    lines = []
    for layer in info["layers"]:
        path = layer["path"]
        mine = [(name, c) for name, c in plan.collectives() if c.kind == "all_to_all"
                and _node_path(plan, name).startswith(path)]
        fwd = sum(c.bytes_forward for _, c in mine)
        bwd = sum(c.bytes_backward for _, c in mine)
        e, g, cap, h = layer["experts"], layer["groups"], layer["capacity"], layer["hidden"]
        lines.append(
            f"MoE {path}: {e} experts{' (gated)' if layer['gated'] else ''}, top-{layer['top_k']}, "
            f"{e // n} per rank on `{axis}`; {g} routing groups x {layer['tokens_per_group']} tokens; capacity "
            f"{cap} per expert per group (factor {layer['capacity_factor']}); dispatch buffer [{e}, {g}, {cap}, {h}] "
            f"({layer['buffer_bytes']} bytes); all-to-all: {len(mine)} forward + {len(mine)} backward, "
            f"{fwd}/{bwd} bytes per rank fwd/bwd")
    return "\n".join(lines)


def _node_path(plan, name: str) -> str:
    for n in plan.graph_module.graph.nodes:
        if n.name == name:
            return M.module_path(n)
    return ""


# ---- the summary of a large plan ----------------------------------------------------------------------------
#: ``autoshard show`` prints :func:`format_overview` instead of the per-node table above this many nodes.
SUMMARY_NODES = 300


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _fold(path: str, foldable: set[str]) -> str:
    """``model.layers.7.mlp`` -> ``model.layers.*.mlp`` when ``model.layers`` holds identical layers (in
    ``foldable``): repeated layers share one kind; a Sequential's different children keep their indices."""
    parts = path.split(".") if path else []
    return ".".join("*" if p.isdigit() and ".".join(parts[:i]) in foldable else p for i, p in enumerate(parts))


def _foldable(nodes) -> set[str]:
    """Containers (module paths) whose numbered children are the same kind of layer: the same parameters (relative
    names, shapes, dtypes). Ops may differ (the first layer may slice a mask the others reuse)."""
    sigs: dict[str, dict[str, list]] = {}
    for n, path in nodes:
        parts = path.split(".") if path else []
        val = n.meta.get("val")
        for i, p in enumerate(parts):
            if p.isdigit():
                sig = sigs.setdefault(".".join(parts[:i]), {}).setdefault(p, [])
                if n.op == "get_attr" and isinstance(val, torch.Tensor):
                    name = str(n.meta.get(M.PARAM, n.target)).split(".")[i + 1:]
                    sig.append((".".join(name), tuple(val.shape), str(val.dtype)))
    return {container for container, members in sigs.items()
            if len(members) > 1 and len({tuple(sorted(sig)) for sig in members.values()}) == 1}


def _owner(n) -> str:
    """The module a node belongs to: its own module path, a parameter's module, a collective's operand's."""
    if n.op == "get_attr":
        return str(n.meta.get(M.PARAM, n.target)).rpartition(".")[0]
    path = M.module_path(n)
    if not path and M.COLLECTIVE in n.meta and n.args and hasattr(n.args[0], "op"):
        return _owner(n.args[0])
    return path


def _spec_text(spec) -> str:
    if isinstance(spec, tuple) and spec and isinstance(spec[0], tuple):
        return " ".join(format_spec(s) for s in spec)
    return format_spec(spec)


def plan_overview(plan) -> dict:
    """The plan summarised for a large model, as data (``--json`` gives it as is; :func:`format_overview` prints it).

    ``modules``: one entry per module kind (repeated layers folded: ``model.layers.*.mlp``) with its instances,
    ops, parameter bytes per rank and collective bytes per instance; ``groups``: each folded container with its
    indices; ``params``: one entry per parameter kind with shape, spec and bytes per rank; ``collectives``: per
    unit (a folded layer, or a module) and collective kind, the count and bytes per rank per instance;
    ``cost``: estimated step time and memory per rank (``plan.cost()``)."""
    from autoshard.placements import local_shape

    gm, mesh = plan.graph_module, plan.mesh
    modules: dict[str, dict] = {}
    params: dict[str, dict] = {}
    colls: dict[tuple[str, str], dict] = {}
    groups: dict[str, set] = {}
    total_params = 0
    nodes = [(n, _owner(n)) for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    foldable = _foldable(nodes)
    for n, path in nodes:
        kind = _fold(path, foldable)
        parts = path.split(".") if path else []
        for i, p in enumerate(parts):
            if p.isdigit() and ".".join(parts[:i]) in foldable:
                groups.setdefault(_fold(".".join(parts[:i + 1]), foldable), set()).add(int(p))
        m = modules.setdefault(kind, {"module": kind, "instances": set(), "ops": 0, "param_bytes": 0,
                                      "comm_bytes": 0})
        m["instances"].add(path)
        info = n.meta.get(M.COLLECTIVE)
        val = n.meta.get("val")
        if info is not None:
            m["comm_bytes"] += info.bytes_forward + info.bytes_backward
            unit = kind.rpartition("*")[0] + "*" if "*" in kind else kind
            key = f"{info.kind}[{','.join(info.axes)}]"
            c = colls.setdefault((unit, key), {"unit": unit, "collective": key, "count": 0, "bytes_forward": 0,
                                                "bytes_backward": 0, "in": set()})
            c["count"] += 1
            c["bytes_forward"] += info.bytes_forward
            c["bytes_backward"] += info.bytes_backward
            c["in"].add(".".join(parts[:len(unit.split("."))]))
        elif n.op == "get_attr" and isinstance(val, torch.Tensor):
            spec = n.meta.get(M.SPEC)
            local = local_shape(val.shape, spec, mesh) if spec is not None else tuple(val.shape)
            nbytes = math.prod(local) * val.element_size()
            total_params += val.numel()
            m["param_bytes"] += nbytes
            name = _fold(str(n.meta.get(M.PARAM, n.target)), foldable)
            storage = n.meta.get(M.STORAGE)
            p = params.setdefault(name, {"param": name, "count": 0, "shape": list(val.shape),
                                         "spec": spec_json(spec, mesh), "spec_text": _spec_text(spec),
                                         "local_shape": list(local),
                                         "bytes_per_rank": nbytes, "dtype": str(val.dtype).replace("torch.", ""),
                                         "zero_stage": storage.stage if storage is not None else 0,
                                         "compute_spec": spec_json(storage.compute if storage else spec, mesh),
                                         "compute_spec_text": _spec_text(storage.compute if storage else spec)})
            p["count"] += 1
        elif n.op == "call_function":
            m["ops"] += 1
    for m in modules.values():
        k = max(1, len(m["instances"]))
        m["instances"] = k
        m["ops"] //= k
        m["param_bytes"] //= k
        m["comm_bytes"] //= k
    for c in colls.values():  # per instance when every instance has it, else the total over those that do
        k = len(groups.get(c["unit"], ())) or 1
        c["instances"] = k
        c["in"] = len(c["in"])
        c["per_instance"] = c["in"] == k and c["count"] % k == 0
        if c["per_instance"]:
            for f in ("count", "bytes_forward", "bytes_backward"):
                c[f] //= k
    first = {}
    for name in modules:  # list each folded container's members together, in graph order
        first.setdefault(_top_fold(name), len(first))
    order = sorted(modules, key=lambda name: first[_top_fold(name)])
    modules = {name: modules[name] for name in order}
    coll_list = sorted(colls.values(), key=lambda c: first.get(_top_fold(c["unit"]), len(first)))
    cost = plan.cost()
    search = plan.context.report.get("plan_search")
    return {"model": plan.model_name, "mesh": dict(mesh.axes), "nodes": len(gm.graph.nodes),
            "parameters": total_params,
            "groups": {g: sorted(ix) for g, ix in groups.items()},
            "modules": list(modules.values()), "params": list(params.values()), "collectives": coll_list,
            "cost": {"step_time_s": cost.step_time, "compute_time_s": cost.compute_time,
                     "comm_time_s": cost.comm_time, "optimizer_time_s": getattr(cost, "optimizer_time", 0.0),
                     "overhead_time_s": getattr(cost, "overhead_time", 0.0),
                     "memory_per_rank_bytes": cost.memory_per_rank,
                     "param_bytes_per_rank": cost.parameter_bytes, "comm_bytes_per_axis": dict(cost.comm_bytes),
                     "memory_by_kind": memory_by_kind(cost),
                     "profile": str(plan.context.options.profile),
                     "memory_limit_bytes": search["memory_limit"] if search else None},
            "search": search_json(plan)}


def _top_fold(name: str) -> str:
    """The outermost folded container of a folded name (``model.layers.*``), or the name itself."""
    return name[:name.index("*") + 1] if "*" in name else name


def _indices(ix: list[int]) -> str:
    if ix == list(range(ix[0], ix[-1] + 1)):
        return f"{ix[0]}-{ix[-1]}" if len(ix) > 1 else str(ix[0])
    return ",".join(map(str, ix[:3])) + ("..." if len(ix) > 3 else "")


def _tree(names: list[str], groups: dict[str, list[int]]) -> list[tuple[str, str | None]]:
    """Display rows for folded names in order: a header row (text, None) before the first member of each folded
    container, then each name relative to its innermost container, indented by depth."""
    rows: list[tuple[str, str | None]] = []
    seen: set[str] = set()
    for name in names:
        parts = name.split(".") if name else []
        stars = [i for i, p in enumerate(parts) if p == "*"]
        depth, start = 0, 0
        for i in stars:
            prefix = ".".join(parts[:i + 1])
            if prefix not in seen:
                seen.add(prefix)
                ix = groups.get(prefix, [])
                label = ".".join(parts[start:i]) + (f".{_indices(ix)}" if ix else ".*")
                rows.append(("  " * depth + label + f" x{len(ix)}", None))
            depth, start = depth + 1, i + 1
        rows.append(("  " * depth + (".".join(parts[start:]) or "(its own ops)" if parts else "(top level)"), name))
    return rows


#: Characters after which a long cell or line may break (names break at their dots and underscores).
_BREAKS = " .,_/]"


def _wrap_cell(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters, broken after a dot, underscore, comma or space where
    possible; continuation lines are indented two more than the first. Nothing is dropped."""
    if len(text) <= width:
        return [text]
    indent = len(text) - len(text.lstrip(" "))
    cont = " " * (indent + 2) if width - indent - 2 >= 6 else ""
    out, rest, prefix = [], text, ""
    while len(prefix) + len(rest) > width:
        room = width - len(prefix)
        lead = len(rest) - len(rest.lstrip(" "))
        cut = max((rest.rfind(c, lead, room) for c in _BREAKS), default=-1) + 1
        if cut <= max(lead, room // 3):  # no break point worth using: cut the word
            cut = room
        out.append(prefix + rest[:cut].rstrip())
        rest, prefix = rest[cut:].lstrip(" "), cont
    out.append(prefix + rest)
    return out


def fit_text(text: str, width: int = 80) -> str:
    """Plain text with every line over ``width`` wrapped at spaces (continuations indented two)."""
    return "\n".join(_wrap_prose(text.splitlines(), width)) + ("\n" if text.endswith("\n") else "")


def _wrap_prose(lines: list[str], width: int, indent: str = "  ") -> list[str]:
    """Prose lines wrapped at spaces to ``width``; continuation lines start with ``indent``."""
    out = []
    for ln in lines:
        while len(ln) > width:
            cut = ln.rfind(" ", len(indent) + 1, width + 1)
            cut = cut if cut > len(indent) else width
            out.append(ln[:cut].rstrip())
            ln = indent + ln[cut:].lstrip()
        out.append(ln)
    return out


def _table(header: list[str], rows: list[list[str]], right: set[int], width: int, groups: bool = False):
    """Rows aligned in columns and fitted to ``width``: the widest left-aligned columns narrow (to 8 characters
    at least) and their cells wrap over several lines (:func:`_wrap_cell`). Returns the lines, or with
    ``groups`` one list of lines per row (the header first)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    over = sum(widths) + 2 * (len(widths) - 1) - width
    floor = [max(8, len(h)) if i not in right else widths[i] for i, h in enumerate(header)]
    while over > 0:
        i = max(range(len(widths)), key=lambda k: widths[k] - floor[k])
        if widths[i] <= floor[i]:
            break
        widths[i] -= 1
        over -= 1

    def render(r: list[str]) -> list[str]:
        cells = [_wrap_cell(v, widths[i]) if i not in right else [v] for i, v in enumerate(r)]
        out = []
        for k in range(max(map(len, cells))):
            parts = [(c[k] if k < len(c) else "") for c in cells]
            out.append("  ".join(v.rjust(widths[i]) if i in right else v.ljust(widths[i])
                                 for i, v in enumerate(parts)).rstrip())
        return out

    rendered = [render(r) for r in [header, *rows]]
    return rendered if groups else [ln for group in rendered for ln in group]


def format_overview(plan, width: int = 80, overview: dict | None = None) -> str:
    """A large plan in under a screen at ``width`` columns: per module kind (repeated layers folded, ``x32``) its
    ops, parameter and communication bytes per rank; each parameter kind's placement; the collectives per layer
    with bytes; memory per rank and the estimated step time; the MoE layers (:func:`format_moe`). ``autoshard show
    --nodes`` prints every node."""
    o = overview or plan_overview(plan)
    groups = o["groups"]
    lines = [f"plan for {o['model']} on {plan.mesh}: {o['nodes']} nodes, {o['parameters'] / 1e9:.2f}B parameters"
             if o["parameters"] >= 1e8 else
             f"plan for {o['model']} on {plan.mesh}: {o['nodes']} nodes, {o['parameters']:,} parameters",
             f"(repeated layers folded; spec: placement per axis {', '.join(plan.mesh.names)}; --nodes: all)",
             ""]
    mods = {m["module"]: m for m in o["modules"]}
    rows = []
    for text, name in _tree(list(mods), groups):
        if name is None:
            rows.append([text, "", "", "", ""])
            continue
        m = mods[name]
        rows.append([text, str(m["instances"]), str(m["ops"]), _bytes(m["param_bytes"]) if m["param_bytes"] else "",
                     _bytes(m["comm_bytes"]) if m["comm_bytes"] else ""])
    lines += _table(["module", "x", "ops", "params/rank", "comm/rank"], rows, {1, 2, 3, 4}, width)
    lines.append("")
    prm = {p["param"]: p for p in o["params"]}
    rows = []
    for text, name in _tree(list(prm), groups):
        if name is None:
            rows.append([text, "", "", "", ""])
            continue
        p = prm[name]
        rows.append([text, "[" + ", ".join(map(str, p["shape"])) + "]", p["spec_text"], str(p["zero_stage"]),
                     _bytes(p["bytes_per_rank"])])
    lines += _table(["parameter", "shape", "spec (stored)", "zero", "per rank"], rows, {3, 4}, width)
    lines.append("")
    rows = []
    last = None
    tot_n = tot_f = tot_b = 0
    for c in o["collectives"]:
        unit = c["unit"]
        label = ""
        if unit != last:
            ix = groups.get(unit)
            label = (unit[:-2] + f".{_indices(ix)} (each)") if ix else (unit or "(top level)")
            last = unit
        k = c["instances"] if c["per_instance"] else 1
        tot_n += c["count"] * k
        tot_f += c["bytes_forward"] * k
        tot_b += c["bytes_backward"] * k
        kind = c["collective"] + ("" if c["per_instance"] or c["instances"] == 1 else f" in {c['in']}/{c['instances']}")
        rows.append([label, kind, str(c["count"]), _bytes(c["bytes_forward"]) if c["bytes_forward"]
                     else "-", _bytes(c["bytes_backward"]) if c["bytes_backward"] else "-"])
    rows.append(["total per step", "", str(tot_n), _bytes(tot_f), _bytes(tot_b)])
    lines += _table(["collectives", "kind[axes]", "x", "fwd/rank", "bwd/rank"], rows, {2, 3, 4}, width)
    lines.append("")
    cost = o["cost"]
    limit = cost["memory_limit_bytes"]
    lines.append(f"memory per rank: {_bytes(cost['memory_per_rank_bytes'])} peak"
                 + (f" of {_bytes(limit)} allowed" if limit else "") + " = " + _memory_text(cost["memory_by_kind"]))
    extra = "".join(f" + {name} {_ms(cost[key])}" for name, key in (("optimizer", "optimizer_time_s"),
                                                                    ("step overhead", "overhead_time_s"))
                    if cost.get(key))
    lines.append(f"estimated step: {_ms(cost['step_time_s'])} = compute {_ms(cost['compute_time_s'])} + "
                 f"communication {_ms(cost['comm_time_s'])}{extra} ({cost['profile']})")
    search = o.get("search")
    if search is not None:
        lines.append(f"plan search: binding constraint: {search['binding']}; {search['decisions']} decisions, "
                     + ("solved exactly" if search["optimal"] else f"within {search['gap']:.2%} of its lower bound"))
    lines.append("bytes per step per axis: " + ", ".join(f"{a} {_bytes(b)}" for a, b in
                                                          cost["comm_bytes_per_axis"].items()))
    moe = format_moe(plan)
    if moe:
        lines += ["", *moe.splitlines()]
    return "\n".join(_wrap_prose(lines, width)) + "\n"  # prose lines wrap; table rows were fitted above


def stages_json(pplan) -> dict:
    """A pipelined plan's stages as data (what :func:`format_stages` prints): per stage its ranks, estimated time
    and memory, modules; the boundary tensors with bytes; the imbalance, bubble and estimated step
    (:meth:`autoshard.compiler.pipeline.PipelinePlan.cost`); the microbatch plan's ``plan.cost()`` and search
    estimate."""
    split, p = pplan.split, pplan.pipeline
    estimate = pplan.cost()
    stages = []
    for s, cost in enumerate(estimate.microbatch):
        ranks = [r for r in range(pplan.mesh.size) if s in pplan.stages_of(r)]
        stages.append({"stage": s, "ranks": ranks, "time_per_microbatch_s": cost, "compute_s": split.compute[s],
                       "transfer_s": split.transfer[s], "once_per_step_s": estimate.once[s],
                       "memory_bytes": pplan.stage_memory(s, ranks[0]), "modules": list(split.modules[s])})
    boundaries = [{"from": k, "to": k + 1, "bytes_per_microbatch": b.nbytes,
                   "tensors": [{"name": n, "shape": list(sh), "dtype": str(dt).replace("torch.", "")}
                               for n, sh, dt in zip(b.names, b.shapes, b.dtypes)]}
                  for k, b in enumerate(split.boundaries)]
    return {"model": pplan.model_name, "mesh": dict(pplan.mesh.axes), "submesh": dict(pplan.submesh.axes),
            "schedule": p.schedule, "microbatches": p.microbatches, "batch": pplan.batch,
            "split": "manual" if split.manual else "auto", "stages": stages, "boundaries": boundaries,
            "shared_parameters": [{"param": n, "stages": list(s)} for n, s in pplan.shared_params()],
            "imbalance": split.imbalance, "bubble": estimate.bubble, "step_overhead_s": estimate.overhead,
            "estimated_step_s": estimate.step_time,
            # one microbatch through every stage as one plan: its plan.cost() and the search's own estimate of it
            "microbatch": {"step_time_s": pplan.microbatch_plan.cost().step_time,
                           "search": search_json(pplan.microbatch_plan)}}
