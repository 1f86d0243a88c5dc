"""Advice in the planner's warnings: why a plan leaves a mesh axis unused, and what would change that.

Passes call it (the ``propagate`` pass's warning about idle axes); it reads the graph, the options and the hardware
profile, never the plan report, and imports no formatter (:mod:`autoshard.compiler.report` is for whole plans).
"""

from __future__ import annotations

from autoshard import meta as M

__all__ = ["axis_advice"]


def _seconds(t: float) -> str:
    """``t`` seconds in the unit that reads best (s, ms, us), three significant digits."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if t >= scale or unit == "us":
            return f"{t / scale:.3g} {unit}"
    return ""


def axis_advice(gm, ctx, unused: list[str], use: dict[str, tuple[int, int]]) -> str:
    """The reason and the fix that end the warning about mesh axes a plan leaves ``unused`` (or mostly whole).

    Greedy planner: it propagates layouts op by op and never chooses to split work, so the fix is annotations or
    the search. The search: it left the axis alone because replication was cheapest under the hardware profile;
    say by how much (the step's compute a split could save at most, next to one collective's latency on that axis)
    and name what would change it — never the option already in use. ``use``: {axis: (forward FLOPs split over
    it, run whole)} of the plan (``passes.propagate.axis_use``)."""
    options = ctx.options
    if options.planner != "search":
        return "Annotate parameters (annotations=...), use planner='search', or use a smaller mesh."
    from autoshard.cost_models.compute import compute_time
    from autoshard.cost_models.profile import HardwareProfile, load_profile

    profile = options.profile if isinstance(options.profile, HardwareProfile) else load_profile(options.profile)
    compute = sum(compute_time(n, profile) + compute_time(n, profile, backward=True)
                  for n in gm.graph.nodes if n.op == "call_function" and M.SPEC in n.meta)
    reasons = []
    for name in unused:
        size = ctx.mesh.axis_size(name)
        saved = compute * (1 - 1 / size)
        latency = (size - 1) * profile.link_for(name, mesh=ctx.mesh).alpha  # one ring collective's message steps
        verdict = ("less than one collective costs" if saved < latency else
                   "yet every plan splitting over it was priced slower: its collectives cost more than that saves")
        reasons.append(f"splitting the step over `{name}` (size {size}) saves at most {_seconds(saved)} of its "
                       f"{_seconds(compute)} of compute, {verdict} (a collective over `{name}` takes at least "
                       f"{_seconds(latency)} of latency alone)")
    fixes = ["a larger model or batch (more work per collective)"]
    if options.memory_limit is None:
        fixes.append("a memory_limit the replicated plan does not fit (the search then shards to fit)")
    fixes += ["annotations (annotations=...) to force a layout",
              "a mesh without " + ", ".join(f"`{a}`" for a in unused)]
    idle = all(use.get(a, (0, 0))[0] == 0 for a in unused)
    head = ("The model is so small that replication is cheapest" if idle else
            "Running most of the work whole is cheapest")
    return (f"{head} under profile `{profile.name}`: " + "; ".join(reasons) + ". To use the axis: "
            + ", ".join(fixes[:-1]) + ", or " + fixes[-1] + ".")
