"""Context parallelism: the sequence of attention sharded over one mesh axis (``compile(..., context_axis=...)``).

Three passes of the one list (``passes/manager.py``):

* :class:`CutSequence` (plan phase, before the planners): after every input whose dim 1 is the length of the
  model's self-attention sequence, a ``sequence_cut`` node (:mod:`autoshard.compiler.ops.context`) planned to shard
  dim 1 on the context axis, so users pass whole sequences and every activation downstream starts sharded; records
  the layout in ``gm.meta[autoshard.meta.CONTEXT]``.
* :class:`ContextAttention` (plan phase, after collective insertion): each attention whose strategy shards the sequence
  on the axis takes the local form the user asked for (``ring`` / ``all_gather`` / ``ulysses``); checks what the
  head-tail layout cannot hold (a parameter sharded on the axis, dropout with a sharded mask) and raises
  :class:`~autoshard.errors.PlanError` naming the module; reports each attention's form, those split on the axis by
  heads or batch (the sequence all-to-all'd: Ulysses as a redistribution), and those left gathered.
* :class:`BalanceContext` (rank phase, after localisation; only with ``balance``): the chunks a rank holds are
  ``r`` and ``2n-1-r``, so every collective on the axis that cuts or joins a dim reorders it: a local slice,
  reduce-scatter or the split side of an all-to-all takes the head-tail order first, an all-gather (or the joined
  side of an all-to-all) puts the natural order back (:func:`autoshard.runtime.context.head_tail`); ZeRO's gathers
  of parameters stored over the axis (:func:`autoshard.compiler.context.zero_axis`) keep the natural order. Positions
  (rotary), masks and labels are computed whole and sliced, so they follow; outputs leave the program gathered,
  in natural order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from autoshard import meta as M
from autoshard.compiler.collective_kinds import kind_of
from autoshard.compiler.context import Context
from autoshard.errors import PlanError
from autoshard.frontend.graph_utils import node_location
from autoshard.compiler.ops.attention import context_axis_of, context_form
from autoshard.compiler.ops.context import sequence_cut
from autoshard.passes.shard_storage import stage_of
from autoshard.placements import Replicate, Shard

__all__ = ["BalanceContext", "ContextAttention", "CutSequence"]

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_GATHERS = ("all_gather", "all_gather_sync", "all_gather_reshard")
_CUTS = ("local_slice", "reduce_scatter")


def _attention_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == _SDPA]


def _ancestors(nodes) -> set[torch.fx.Node]:
    seen, stack = set(), list(nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


@dataclass(frozen=True)
class CutSequence:
    name: str = "cut_sequence"
    phase: str = "plan"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        from autoshard.passes.propagate import node_strategies

        cp = ctx.options.context_parallel
        a = ctx.mesh.index(cp.axis)
        if ctx.mesh.shape[a] == 1:  # nothing to cut: a size-1 context axis plans as the mesh without it does
            M.plan_report(gm)[self.name] = {"inputs": [], "axis": cp.axis, "skipped": "the axis has size 1"}
            return gm
        attn = [n for n in _attention_nodes(gm) if n.args[0].meta["val"].shape[-2] == n.args[1].meta["val"].shape[-2]]
        if not attn:
            raise PlanError(f"option context_axis={cp.axis!r} shards the sequence of self-attention, but the traced "
                            "model calls no scaled_dot_product_attention over one sequence (HF models: "
                            "attn_implementation='sdpa'). Drop context_axis, or use an SDPA attention.")
        length = attn[0].args[0].meta["val"].shape[-2]
        # the inputs' layouts on the other axes were seeded by the seed_specs pass (passes/prepare.py)
        feeds = _ancestors([n.args[0] for n in attn])  # inputs the queries are computed from (not the labels)
        cut = []
        for ph in [n for n in gm.graph.nodes if n.op == "placeholder"]:
            val = ph.meta.get("val")
            if not isinstance(val, torch.Tensor) or val.dim() < 2 or val.shape[1] != length or ph not in feeds:
                continue
            spec = ph.meta[M.SPEC]
            if isinstance(spec[a], Shard):
                if cp.balance:
                    raise PlanError(f"input `{ph.name}` is annotated {spec[a]} on the context axis `{cp.axis}`, but "
                                    "with context_axis the inputs are passed whole and autoshard cuts them (head-tail"
                                    "). Drop the annotation on that axis, or use ContextParallel(balance=False).")
                continue
            if not isinstance(spec[a], Replicate):
                continue
            with gm.graph.inserting_after(ph):
                node = gm.graph.call_function(sequence_cut, (ph, 1))
            ph.replace_all_uses_with(node, delete_user_cb=lambda u, node=node: u is not node)
            node.meta["val"] = val
            out = list(spec)
            out[a] = Shard(1)
            want = ((spec,), tuple(out))
            planned = [s for s in node_strategies(node, ctx) if (s.input_specs, s.output_spec) == want]
            if not planned:
                raise PlanError(f"option context_axis={cp.axis!r} cuts input `{ph.name}` (shape {list(val.shape)}) "
                                f"along its sequence dim 1 into {ctx.mesh.shape[a]} shards, but no strategy of the "
                                f"cut gives that layout (the length {length} must divide by the axis size "
                                f"{ctx.mesh.shape[a]}). Use a sequence length divisible by it, or drop context_axis.")
            node.meta[M.PLANNED] = planned[0]
            cut.append(ph.name)
        if not cut:
            raise PlanError(f"option context_axis={cp.axis!r} cuts inputs along the sequence (dim 1 of length "
                            f"{length}), but no input of the model has that dim 1.")
        gm.graph.lint()
        gm.recompile()
        gm.meta[M.CONTEXT] = M.ContextLayout(cp.axis, bool(cp.balance), cp.attention, tuple(cut))
        M.plan_report(gm)[self.name] = {"inputs": cut, "sequence": length, "axis": cp.axis, "balance": cp.balance}
        return gm


@dataclass(frozen=True)
class ContextAttention:
    name: str = "context_attention"
    phase: str = "plan"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        from autoshard.compiler.ops.attention import ulysses_valid

        layout = gm.meta.get(M.CONTEXT)
        mesh = ctx.mesh
        forms, split, gathered = {}, {}, []
        for n in _attention_nodes(gm):
            strat = n.meta.get(M.STRATEGY)
            a = None if strat is None else context_axis_of(strat, n.args[0].meta["val"].dim())
            if a is None:
                if layout is not None:
                    # the sequence redistributed whole onto this attention: split on the axis by heads (Ulysses'
                    # all-to-all, as a redistribution) or batch, or gathered (every rank of the axis runs it all)
                    q = strat.input_specs[0] if strat is not None and strat.input_specs else None
                    p = q[mesh.index(layout.axis)] if q else None
                    ndim = n.args[0].meta["val"].dim()
                    if isinstance(p, Shard):
                        split[n.name] = "heads" if p.dim == ndim - 3 else "batch"
                    else:
                        gathered.append(node_location(n))
                continue
            form = context_form(strat)
            if layout is not None and layout.attention is not None and mesh.names[a] == layout.axis:
                form = layout.attention
                strat = M.Strategy(strat.input_specs, strat.output_spec, strat.grad_sync,
                                   f"{form}:{strat.note.split(':', 1)[1]}")
                if form == "ulysses" and not ulysses_valid(strat, [tuple(x.meta["val"].shape) for x in n.args[:3]],
                                                            mesh):
                    raise PlanError(f"{node_location(n)} cannot run Ulysses attention on axis `{layout.axis}` of "
                                    f"size {mesh.shape[a]}: its local heads ({n.args[0].meta['val'].shape[-3]} "
                                    "query heads, split by the other axes) must divide by the axis size. Use "
                                    "attention='ring' or 'all_gather'.")
                n.meta[M.STRATEGY] = strat
            forms[n.name] = f"{form} on {mesh.names[a]}"
        if layout is not None and layout.balance:
            self._check_balance(gm, ctx, layout)
        if gathered:
            ctx.warn(f"context_axis={layout.axis!r}: {len(gathered)} attention(s) run on the whole sequence "
                     f"(gathered), not context-parallel: {gathered[:3]}")
        M.plan_report(gm)[self.name] = {"attention": forms, "split": split, "gathered": gathered}
        return gm

    @staticmethod
    def _check_balance(gm, ctx: Context, layout: M.ContextLayout) -> None:
        a = ctx.mesh.index(layout.axis)
        n_ = ctx.mesh.shape[a]
        for n in gm.graph.nodes:
            spec = n.meta.get(M.SPEC)
            if M.STORAGE in n.meta:  # stored sharded by ZeRO over the axis (zero_axis): computed with as gathered
                spec = n.meta[M.STORAGE].compute
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) and isinstance(spec, tuple) and spec and isinstance(spec[a], Shard) \
                    and val.shape[spec[a].dim] % (2 * n_):
                raise PlanError(f"{node_location(n)} is sharded {spec[a]} on the context axis `{layout.axis}` "
                                f"(shape {list(val.shape)}), but head-tail load balancing cuts every dim sharded on "
                                f"that axis into {2 * n_} chunks and {val.shape[spec[a].dim]} does not divide by "
                                f"{2 * n_}. Use sizes divisible by {2 * n_}, or ContextParallel(balance=False).")
            if n.op == "get_attr" and isinstance(spec, tuple) and spec and isinstance(spec[a], Shard):
                raise PlanError(f"parameter `{n.meta.get(M.PARAM, n.target)}` is sharded {spec[a]} on the context "
                                f"axis `{layout.axis}`, but with head-tail load balancing that axis shards only the "
                                "sequence. Keep parameters replicated there (ZeRO may store them sharded: over the "
                                "data axis, or over this axis where the mesh has no data axis), or use "
                                "ContextParallel(balance=False).")
            if n.op == "call_function" and "dropout" in str(n.target) and isinstance(spec, tuple) and spec \
                    and isinstance(spec[a], Shard) and _drops(n):
                raise PlanError(f"{node_location(n)} runs dropout on a tensor sharded along the sequence on "
                                f"`{layout.axis}`, but the head-tail layout has no offsets for one global mask. Set "
                                "dropout to 0 (or eval mode), or use ContextParallel(balance=False).")


def _drops(node: torch.fx.Node) -> bool:
    """Whether a dropout node draws a mask: not with p = 0 or train = False (``aten.dropout(x, p, train)``,
    ``aten.native_dropout(x, p, train)``), which return their input."""
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return not (isinstance(p, (int, float)) and p == 0) and train is not False


@dataclass(frozen=True)
class BalanceContext:
    name: str = "balance_context"
    phase: str = "rank"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        from autoshard.runtime.context import head_tail

        layout = gm.meta.get(M.CONTEXT)
        if layout is None or not layout.balance:
            return gm
        graph, axis = gm.graph, layout.axis
        for node in list(graph.nodes):
            k = kind_of(node)
            if k is None or len(node.args) < 2 or node.args[1] != axis:
                continue
            if k.name in _GATHERS and stage_of(node.args[0]) > 0:
                continue  # ZeRO's gather of a parameter stored over the axis (zero_axis): natural order both ways
            if k.name in _GATHERS:
                dim, size = node.args[2], node.args[3]
                with graph.inserting_after(node):
                    back = graph.call_function(head_tail, (node, dim, size, True))
                node.replace_all_uses_with(back, delete_user_cb=lambda u, back=back: u is not back)
            elif k.name in _CUTS:
                dim, size = node.args[2], node.args[3]
                with graph.inserting_before(node):
                    node.update_arg(0, graph.call_function(head_tail, (node.args[0], dim, size, False)))
            elif k.name == "all_to_all":
                split, cat, size = node.args[2], node.args[3], node.args[4]
                with graph.inserting_before(node):
                    node.update_arg(0, graph.call_function(head_tail, (node.args[0], split, size, False)))
                with graph.inserting_after(node):
                    back = graph.call_function(head_tail, (node, cat, size, True))
                node.replace_all_uses_with(back, delete_user_cb=lambda u, back=back: u is not back)
            elif k.name not in ("all_reduce",):
                raise PlanError(f"collective `{node.name}` ({k.name}) on the context axis `{axis}` has no head-tail "
                                "form; use ContextParallel(balance=False).")
        graph.lint()
        gm.recompile()
        return gm
