"""Formatters of plans: pure functions returning text (golden-file friendly); ``rich`` only in ``show_plan``."""

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
        text += (f"\nestimated step time {cost.step_time * 1e3:.3f} ms (compute {cost.compute_time * 1e3:.3f} ms, "
                 f"communication {cost.comm_time * 1e3:.3f} ms) on profile {search['profile']}; bytes per axis: "
                 f"{axes}; memory per rank {cost.memory_per_rank / 2**20:.1f} MiB"
                 + (f" of {limit / 2**20:.1f} MiB allowed" if limit else "")
                 + f"; binding constraint: {search['binding']}; search: {search['decisions']} decisions "
                 "(repeated layers shared), solved exactly")
    return text


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
                                         "spec": _spec_text(spec), "local_shape": list(local),
                                         "bytes_per_rank": nbytes, "dtype": str(val.dtype).replace("torch.", ""),
                                         "zero_stage": storage.stage if storage is not None else 0,
                                         "compute_spec": _spec_text(storage.compute if storage else spec)})
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
                     "comm_time_s": cost.comm_time, "memory_per_rank_bytes": cost.memory_per_rank,
                     "param_bytes_per_rank": cost.parameter_bytes, "comm_bytes_per_axis": dict(cost.comm_bytes),
                     "memory_by_kind": memory_by_kind(cost),
                     "profile": str(plan.context.options.profile),
                     "memory_limit_bytes": search["memory_limit"] if search else None}}


def _top_fold(name: str) -> str:
    """The outermost folded container of a folded name (``model.layers.*``), or the name itself."""
    return name[:name.index("*") + 1] if "*" in name else name


def _indices(ix: list[int]) -> str:
    if ix == list(range(ix[0], ix[-1] + 1)):
        return f"{ix[0]}–{ix[-1]}" if len(ix) > 1 else str(ix[0])
    return ",".join(map(str, ix[:3])) + ("…" if len(ix) > 3 else "")


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
                rows.append(("  " * depth + label + f" ×{len(ix)}", None))
            depth, start = depth + 1, i + 1
        rows.append(("  " * depth + (".".join(parts[start:]) or "(its own ops)" if parts else "(top level)"), name))
    return rows


def _table(header: list[str], rows: list[list[str]], right: set[int], width: int) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    over = sum(widths) + 2 * (len(widths) - 1) - width
    if over > 0:  # shorten the first (name) column, keeping its end
        widths[0] = max(12, widths[0] - over)

    def cell(v: str, i: int) -> str:
        if i == 0 and len(v) > widths[0]:
            v = v[:widths[0] - 1] + "…"
        return v.rjust(widths[i]) if i in right else v.ljust(widths[i])

    return ["  ".join(cell(v, i) for i, v in enumerate(r)).rstrip() for r in [header, *rows]]


def format_overview(plan, width: int = 80, overview: dict | None = None) -> str:
    """A large plan in under a screen at ``width`` columns: per module kind (repeated layers folded, ``×32``) its
    ops, parameter and communication bytes per rank; each parameter kind's placement; the collectives per layer
    with bytes; memory per rank and the estimated step time. ``autoshard show --nodes`` prints every node."""
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
    lines += _table(["module", "×", "ops", "params/rank", "comm/rank"], rows, {1, 2, 3, 4}, width)
    lines.append("")
    prm = {p["param"]: p for p in o["params"]}
    rows = []
    for text, name in _tree(list(prm), groups):
        if name is None:
            rows.append([text, "", "", "", ""])
            continue
        p = prm[name]
        rows.append([text, "[" + ", ".join(map(str, p["shape"])) + "]", p["spec"], str(p["zero_stage"]),
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
    lines += _table(["collectives", "kind[axes]", "×", "fwd/rank", "bwd/rank"], rows, {2, 3, 4}, width)
    lines.append("")
    cost = o["cost"]
    limit = cost["memory_limit_bytes"]
    lines.append(f"memory per rank: {_bytes(cost['memory_per_rank_bytes'])} peak"
                 + (f" of {_bytes(limit)} allowed" if limit else "") + " = " + _memory_text(cost["memory_by_kind"]))
    lines.append(f"estimated step: {cost['step_time_s'] * 1e3:.1f} ms = compute {cost['compute_time_s'] * 1e3:.1f} + "
                 f"communication {cost['comm_time_s'] * 1e3:.1f} ({cost['profile']})")
    lines.append("bytes per step per axis: " + ", ".join(f"{a} {_bytes(b)}" for a, b in
                                                          cost["comm_bytes_per_axis"].items()))
    out = []
    for ln in lines:  # prose lines wrap at width; table rows were fitted above
        while len(ln) > width:
            cut = ln.rfind(" ", 0, width)
            cut = cut if cut > 0 else width
            out.append(ln[:cut])
            ln = "  " + ln[cut:].lstrip()
        out.append(ln)
    return "\n".join(out) + "\n"


def stages_json(pplan) -> dict:
    """A pipelined plan's stages as data (what :func:`format_stages` prints): per stage its ranks, estimated time
    and memory, modules; the boundary tensors with bytes; the imbalance, bubble and estimated step."""
    from autoshard.pipeline.options import bubble_fraction

    split, p = pplan.split, pplan.pipeline
    stages = []
    for s, cost in enumerate(split.costs):
        ranks = [r for r in range(pplan.mesh.size) if s in pplan.stages_of(r)]
        stages.append({"stage": s, "ranks": ranks, "time_per_microbatch_s": cost, "compute_s": split.compute[s],
                       "transfer_s": split.transfer[s], "memory_bytes": pplan.stage_memory(s, ranks[0]),
                       "modules": list(split.modules[s])})
    boundaries = [{"from": k, "to": k + 1, "bytes_per_microbatch": b.nbytes,
                   "tensors": [{"name": n, "shape": list(sh), "dtype": str(dt).replace("torch.", "")}
                               for n, sh, dt in zip(b.names, b.shapes, b.dtypes)]}
                  for k, b in enumerate(split.boundaries)]
    v = p.stages_per_rank if p.schedule == "interleaved" else 1
    bubble = bubble_fraction(pplan.pipe, p.microbatches, v)
    per_rank = [sum(split.costs[s] for s in pplan.stages_of(r)) for r in range(pplan.mesh.size)]
    return {"model": pplan.model_name, "mesh": dict(pplan.mesh.axes), "submesh": dict(pplan.submesh.axes),
            "schedule": p.schedule, "microbatches": p.microbatches, "batch": pplan.batch,
            "split": "manual" if split.manual else "auto", "stages": stages, "boundaries": boundaries,
            "shared_parameters": [{"param": n, "stages": list(s)} for n, s in pplan.shared_params()],
            "imbalance": split.imbalance, "bubble": bubble,
            "estimated_step_s": max(per_rank) * p.microbatches / (1 - bubble)}
