"""Code generation: rank ``r``'s plain ``GraphModule`` from a plan's annotated global program.

A rank program is made by the *rank phase* of the one pass list (:func:`autoshard.passes.manager.pass_list`):
collective fusions, gradient bucketing, localisation (local shapes, local forms of ops, this rank's weight shards)
— run over a copy of the global program, so the plan's own graph never changes. FX then prints each program as
Python (``Plan.code(rank)``): collectives appear as ``torch.ops.autoshard.*`` operators, and the same plan always
gives byte-identical code.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from autoshard import meta as M
from autoshard.compiler.context import Options
from autoshard.mesh import Mesh
from autoshard.passes.manager import ProgramOptions, RankContext, pass_list, run_passes
from autoshard.passes.pipeline_split import stage_graphs_of
from autoshard.placements import Spec
from autoshard.runtime.torch_state import RANK_THREADS

__all__ = ["param_specs_of", "program_copy", "rank_program"]


def program_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of the global program's graph (node metadata copied) over the same module: the rank phase rewrites
    the copy, never the plan's graph. Weights are shared, not copied. The copy generates its Python code only if
    it is ever called or its code read (a lazy GraphModule): the rank phase's ``localize`` makes the rank's module
    from the copy's graph, so the code of the copy would be generated and compiled for nothing."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    if out is not None:
        graph.output(out)
    graph._codegen = gm.graph._codegen
    copy = _LazyGraphModule(gm, graph, class_name=type(gm).__name__)
    for name in ("_in_spec", "_out_spec"):
        if hasattr(gm, name):
            setattr(copy, name, getattr(gm, name))
    # a pipelined plan's stage graphs stay with the plan: a rank program made from the whole graph does not keep
    # them (and the full weights they hold) alive
    copy.meta.update({k: v for k, v in gm.meta.items() if k != M.STAGE_GRAPHS})
    return copy


def rank_program(gm: torch.fx.GraphModule, mesh: Mesh, rank: int, options: Options | None = None,
                 weights: torch.nn.Module | None = None, bucket_grads: bool = False,
                 local_weights: torch.nn.Module | None = None, stage: int | None = None) -> torch.fx.GraphModule:
    """Rank ``rank``'s program: the rank phase of the pass list over a copy of the global program ``gm`` — or,
    with ``stage``, of that stage's graph, which the plan phase's ``build_stages`` pass stored on ``gm``.
    ``weights``: the full tensors to take this rank's slices of (default: ``gm``'s own); ``local_weights``: a
    program of this rank whose tensors are shared as they are (another mode's program of the same plan).
    Call it through :meth:`autoshard.compiler.plan.Plan.rank_program`, which compares the collectives across ranks."""
    mesh._check_rank(rank)
    options = options or Options()
    ctx = RankContext(mesh, options, rank=rank, weights=weights, bucket_grads=bucket_grads,
                      local_weights=local_weights)
    passes = pass_list(options, program=ProgramOptions(bucket_grads))["rank"]
    program = gm if stage is None else stage_graphs_of(gm)[stage].gm
    # the copy shares gm's FakeTensors (and their fake mode) with other ranks' programs: one at a time where ranks
    # are threads of one process (the simulator)
    with RANK_THREADS.exclusive():
        return run_passes(program_copy(program), ctx, passes, ran=tuple(gm.meta.get(M.PASSES_RUN, ())))


def param_specs_of(gm: torch.fx.GraphModule) -> dict[str, Spec]:
    """{parameter FQN: its global spec (the layout it is stored in over the mesh)} of every get_attr tensor of the
    annotated global graph."""
    return {n.meta.get(M.PARAM, n.target): n.meta[M.SPEC] for n in gm.graph.nodes
            if n.op == "get_attr" and isinstance(n.meta.get("val"), torch.Tensor)}
