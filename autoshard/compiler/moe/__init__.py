"""Mixture of Experts: the user's options, the pieces the expert rewrite puts in the graph, and what each forward
records. The package keeps them apart:

==========================  ================================================================================
``moe/options.py``          :class:`MoE`, the user's options, and :func:`capacity_of` (plan time)
``moe/routing.py``          the routing math of one group: capacity, route, dispatch, combine, losses, expert
                            FFN, and the dense one-hot references (pure functions, no options, no records)
``moe/graph_ops.py``        the group ops the expert rewrite emits (``route_groups`` ... ``attach``)
``moe/hf_blocks.py``        Hugging Face sparse-MoE blocks (``MoE(existing=True)``): recognition, the
                            static-shape experts op swapped in while tracing, its expansion into the group ops
``moe/result.py``           :class:`MoERewrite`, the rewrite's typed result on ``gm.meta`` (plan time)
``moe/records.py``          the losses and statistics of each forward, per compiled model and rank (run time):
                            :func:`moe_losses`, :func:`moe_stats`, :func:`clear_records`
==========================  ================================================================================

``autoshard.compile(model, mesh, example_inputs, moe=autoshard.MoE(layers="blocks.*.mlp", every=2, ...))`` runs
``passes/expert_rewrite.py`` before propagation: each selected dense FFN becomes a capacity-bounded MoE layer built
from the ops of :mod:`autoshard.runtime.moe.graph_ops` (see that pass for the graph it emits).
``moe=autoshard.MoE(existing=True, expert_axis="data", capacity_factor=None)`` instead keeps a Hugging Face
model's own sparse-MoE blocks (Mixtral, Qwen2-MoE, ...) and runs their experts sharded over ``expert_axis`` with
the same group ops (:mod:`autoshard.frontend.hf_blocks`); ``capacity_factor=None`` is dropless (Hugging Face's result).

Routing groups (GShard): tokens are routed in ``G`` groups, by default one per coordinate of the expert axis
(``G = mesh.axis_size(expert_axis)``; ``MoE(groups=...)`` overrides it). Group ``g`` is the ``g``-th contiguous
chunk of the batch, i.e. exactly the tokens data rank ``g`` holds, so each rank routes its own tokens with a
capacity ``C = ceil(k * T_g / E * capacity_factor)`` computed from static shapes — never agreed by a collective.
The global graph carries the group as an explicit leading dim (``[G, T_g, h]``), which is what the rule table
shards; on one device the same graph routes the same ``G`` groups, so sharded and single-device runs agree
exactly. The expert buffer is ``[E, G, C, h]``: sharded on the group dim (dim 1) where tokens live, on the expert
dim (dim 0) where the experts run; the propagation turns one into the other with one all-to-all each way.

Auxiliary losses are defined over *all* tokens (global means): ``lb = α · E · Σ_i f_i · P_i`` with ``f_i`` the
fraction of all tokens whose first choice is ``i`` (no gradient) and ``P_i`` the mean router probability of ``i``;
``z = β · mean_t(logsumexp(logits_t)²)``. Because ``f`` is global and carries no gradient, the loss is a sum of
per-group terms (``lb = Σ_g α·E·Σ_i f_i·P_i^g``), so each rank holds its own groups' terms and no term is counted
twice or scaled by the world size. The terms are attached to the MoE output's autograd graph
(:func:`~autoshard.runtime.moe.graph_ops.attach`, Megatron's approach): ``loss.backward()`` on the model's own loss
already includes their gradients — do *not* add them again. Their values (and routing statistics) are recorded on every
forward and read with :func:`moe_losses` / :func:`moe_stats`, e.g. to log ``loss + moe_losses(m)["total"]``.
"""

from __future__ import annotations

from autoshard.frontend.hf_blocks import find_blocks as find_hf_blocks
from autoshard.compiler.moe.options import MoE, capacity_of
from autoshard.runtime.moe.records import clear_records, moe_losses, moe_stats
from autoshard.compiler.moe.result import MoELayer, MoERewrite

__all__ = ["MoE", "MoELayer", "MoERewrite", "capacity_of", "clear_records", "find_hf_blocks", "moe_losses",
           "moe_stats"]
