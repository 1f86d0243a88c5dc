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
        yield {"node": n.name, "op": op, "shape": shape, "spec": spec_text, "module": M.module_path(n),
               "comm_bytes": comm}


def format_plan(plan) -> str:
    """The annotated graph as a plain-text table: node, op, global shape, spec per mesh axis, collective bytes."""
    rows = list(_rows(plan))
    head = f"plan for {plan.model_name} on {plan.mesh}  (spec: one placement per axis {list(plan.mesh.names)})"
    cols = ["node", "op", "shape", "spec", "comm_bytes", "module"]
    table = [[str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) if table else len(c) for i, c in enumerate(cols)]
    lines = [head, "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(t, widths)).rstrip() for t in table]
    lines.append(format_summary(plan))
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
    return f"collectives: {parts}; bytes per rank forward {fwd}, backward {bwd}"


def plan_json(plan) -> str:
    return json.dumps({"model": plan.model_name, "mesh": dict(plan.mesh.axes), "nodes": list(_rows(plan)),
                       "summary": format_summary(plan)}, indent=1, default=str)


def show_plan(plan, console=None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"autoshard plan: {plan.model_name} on {plan.mesh}", show_lines=False)
    for c in ("node", "op", "global shape", "spec " + "×".join(plan.mesh.names), "comm bytes fwd/bwd", "module"):
        table.add_column(c)
    for r in _rows(plan):
        style = "bold magenta" if r["comm_bytes"] else None
        cells = (r["node"], r["op"], str(r["shape"]), r["spec"], r["comm_bytes"], r["module"])
        table.add_row(*(escape(c) for c in cells), style=style)
    console.print(table)
    console.print(format_summary(plan), markup=False)
