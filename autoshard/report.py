"""Formatters of plans: pure functions returning text (golden-file friendly); ``rich`` only in ``show_plan``."""

from __future__ import annotations

import json

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
    search = plan.context.report.get("plan_search")
    if search is not None:
        cost = plan.cost()
        axes = ", ".join(f"{a} {b:.0f}B" for a, b in cost.comm_bytes.items())
        limit = search["memory_limit"]
        text += (f"\nestimated step time {cost.step_time * 1e3:.3f} ms (compute {cost.compute_time * 1e3:.3f} ms, "
                 f"communication {cost.comm_time * 1e3:.3f} ms) on profile {search['profile']}; bytes per axis: "
                 f"{axes}; memory per rank {cost.memory_per_rank / 2**20:.1f} MiB"
                 + (f" of {limit / 2**20:.1f} MiB allowed" if limit else "")
                 + f"; binding constraint: {search['binding']}; search: {search['decisions']} decisions "
                 "(repeated layers shared), solved exactly")
    return text


def plan_json(plan) -> str:
    return json.dumps({"model": plan.model_name, "mesh": dict(plan.mesh.axes), "nodes": list(_rows(plan)),
                       "summary": format_summary(plan)}, indent=1, default=str)


def show_plan(plan, console=None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"autoshard plan: {plan.model_name} on {plan.mesh}", show_lines=False)
    for c in ("node", "op", "global shape", "spec " + "×".join(plan.mesh.names), "strategy", "cost",
              "best rejected (cost)", "comm bytes fwd/bwd", "module"):
        table.add_column(c)
    for r in _rows(plan):
        style = "bold magenta" if r["comm_bytes"] else None
        cells = (r["node"], r["op"], str(r["shape"]), r["spec"], r["strategy"], r["cost"], r["alternative"],
                 r["comm_bytes"], r["module"])
        table.add_row(*(escape(c) for c in cells), style=style)
    console.print(table)
    console.print(format_summary(plan), markup=False)
    moe = format_moe(plan)
    if moe:
        console.print(moe, markup=False, style="bold cyan", soft_wrap=True)


def format_stages(pplan) -> str:
    """A pipelined plan's stages: modules, estimated time and memory, boundary tensors and their bytes, the
    imbalance (max / mean stage cost) and the schedule's theoretical bubble fraction."""
    from autoshard.pipeline.options import bubble_fraction

    split, p = pplan.split, pplan.pipeline
    lines = [(f"pipeline for {pplan.model_name} on {pplan.mesh}: {split.stages} stages "
              f"({'manual' if split.manual else 'auto'} split), schedule {p.schedule}, {p.microbatches} microbatches "
              f"of {pplan.batch // p.microbatches} rows; stages run on {pplan.submesh} inside")]
    cols = ["stage", "ranks", "time/mb (ms)", "compute+comm", "transfer", "memory (MiB)", "modules"]
    rows = []
    for s, cost in enumerate(split.costs):
        ranks = [r for r in range(pplan.mesh.size) if s in pplan.stages_of(r)]
        mods = list(split.modules[s])
        shown = ", ".join(mods if len(mods) <= 6 else [*mods[:3], "...", *mods[-2:]])
        rows.append([str(s), ",".join(map(str, ranks)), f"{cost * 1e3:.3f}", f"{split.compute[s] * 1e3:.3f}",
                     f"{split.transfer[s] * 1e3:.3f}", f"{pplan.stage_memory(s, ranks[0]) / 2**20:.2f}", shown])
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
    bubble = bubble_fraction(pplan.pipe, p.microbatches, v)
    formula = "(p-1)/(v*m+p-1)" if v > 1 else "(p-1)/(m+p-1)"
    per_rank = [sum(split.costs[s] for s in pplan.stages_of(r)) for r in range(pplan.mesh.size)]
    step = max(per_rank) * p.microbatches / (1 - bubble)
    lines.append(f"imbalance (max/mean stage cost): {split.imbalance:.3f}; theoretical bubble {formula}: "
                 f"{bubble:.3f}; estimated step: {step * 1e3:.3f} ms")
    return "\n".join(lines) + "\n"


def format_symbolic(plan) -> str:
    """Every inserted collective's bytes on the wire and time as formulas: shapes (b, s for the first input's
    dims, d<size> otherwise), mesh sizes n_<axis>, and the link's alpha/beta."""
    import sympy

    from autoshard.collectives import KINDS
    from autoshard.cost_models.comm import collective_bytes_on_wire, time_expr

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
