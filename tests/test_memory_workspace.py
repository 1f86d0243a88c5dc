"""The memory model counts what ops allocate besides their outputs (``cost_models/workspace.py``, the registry's
``workspace`` facet): attention's float mask kept for backward once per mask, and ring attention's score blocks
at the point where the attention runs, not on top of the whole step."""

from __future__ import annotations

import torch

import autoshard
from autoshard import meta as M
from autoshard.cost_models import workspace
from autoshard.compiler.ops import Workspace, entry
from examples import models

aten = torch.ops.aten
SEQ = 64


def _plan(mesh: str, batch: int, layers: int = 2, axis=None, seq: int = SEQ):
    model, args, kwargs = models.hf_llama(batch=batch, seq=seq, layers=layers, hidden=64, heads=4, kv_heads=2,
                                          vocab=128)
    return autoshard.compile(model, autoshard.Mesh.parse(mesh), args, kwargs, context_axis=axis).plan


def _without_workspace(plan, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(workspace, "op_workspace", lambda node, mesh: Workspace())
        return plan.cost().memory


def test_the_float_mask_counts_once_among_the_activations(monkeypatch):
    batch = 4
    plan = _plan("data=2", batch)
    with_ws, without = plan.cost().memory, _without_workspace(plan, monkeypatch)
    # two attentions read one boolean mask: one [b/2, 1, s, s] fp32 copy kept for both backwards
    assert with_ws.activations - without.activations == batch // 2 * SEQ * SEQ * 4
    assert with_ws.transient == 0 and with_ws.peak == max(with_ws.points)


def test_ring_score_blocks_count_where_the_attention_runs(monkeypatch):
    plan = _plan("context=4", 8, axis="context", seq=1024)  # long enough for the blocks to outweigh the MLP
    mem, without = plan.cost().memory, _without_workspace(plan, monkeypatch)
    attentions = [n for n in plan.graph_module.graph.nodes if n.target == aten.scaled_dot_product_attention.default]
    sizes = [entry(n.target).workspace(n, n.meta[M.STRATEGY], plan.mesh).transient for n in attentions]
    assert len(sizes) == 2 and min(sizes) > 0
    assert without.transient == 0 and mem.activations == without.activations  # the ring keeps no float mask
    # at the liveness points where the attentions' backward runs next, each its own blocks less what its layer's
    # later ops (the MLP) saved and have freed by then: not at the end of forward (the loss's segment runs backward
    # first), not at the step
    added = [a - b for a, b in zip(mem.points, without.points)]
    assert added[0] == 0 and added[-1] == 0
    assert len([x for x in added if x]) == 2 and all(0 < x < max(sizes) for x in added if x)
    assert mem.peak == max(mem.points) >= without.peak
