"""Pipeline parallelism: the ``Pipeline`` options, the pipelined plan, and the per-rank runner.

    >>> mesh = autoshard.Mesh(pipe=2, data=2, model=2)
    >>> sm = autoshard.compile(model, mesh, example_inputs=(ids, labels),
    ...                        pipeline=autoshard.Pipeline(microbatches=8, schedule="1f1b", split="auto"))
    >>> sm.show()                   # stages, modules, time, memory, boundary tensors, imbalance, bubble
    >>> loss = sm.step(ids, labels) # on each of the 8 processes: one training step (forward and backward)

How it is built (:func:`build_pipeline_plan`):

1. The example batch is cut to one *global microbatch* (``B / microbatches`` rows), and the model is traced and
   planned with the usual passes on the mesh *without* the pipe axis (the pipe axis is a pure pipeline axis:
   nothing is ever sharded on it, by construction rather than by hoping propagation leaves it alone). Local
   shapes inside the stages are then microbatch shapes.
2. Two passes at the end of the plan phase: :class:`~autoshard.passes.pipeline_split.PipelineSplit` cuts the
   annotated graph into ``pipe × stages_per_rank`` stages balanced by the cost model, and
   :class:`~autoshard.passes.pipeline_split.BuildStages` makes one global GraphModule per stage. The rank phase of
   the pass list (:meth:`autoshard.compiler.plan.Plan.rank_program` with ``stage=``) gives each rank its stage's program
   for its (data, model) coordinates, its collectives checked against the stage's other ranks.
3. At run time (:class:`PipelineRunner`, :mod:`autoshard.runtime.pipeline`) each rank wraps its stage(s) in
   ``PipelineStage`` and runs ``ScheduleGPipe``/``Schedule1F1B`` (or the looped/interleaved ones when it holds
   several stages) over the process group of its pipe axis. Stage ``s`` lives on pipe coordinate ``s % pipe``.

Gradients. Inside a stage, the plan's collectives on the data/model axes run per microbatch as usual, except the
parameters' data-parallel all-reduce, which the runner does once per step after the last microbatch's backward
(one flat all-reduce per axes, :func:`autoshard.runtime.pipeline.sync_grads_once`). A parameter read by several
stages (a tied embedding and LM head) is held by each of them; after the backward its gradients are summed over
the pipe group (:func:`autoshard.runtime.pipeline.sum_shared_grads`), so every copy gets the full gradient and
stays equal to the others under any elementwise optimizer.

Loss scaling. Each microbatch's loss is the model's own loss on that microbatch (a mean over its rows, already
averaged over the data axis by the plan); the schedule sums the microbatch gradients and divides by
``microbatches``. The result equals the full-batch gradient exactly when the model's loss is a mean and the
microbatches are equal-sized (which :class:`Pipeline` enforces: ``microbatches`` must divide the batch); the
step's reported loss is the mean of the microbatch losses. A user ``loss_fn`` (applied on the last stage to
the model's output and the microbatch's ``target``) sees only this rank's rows when the output is sharded on the
data axis: it is divided by the data axis size, so that the data-axis gradient sum, and the reported loss summed
over the data axis, give the global mean. A loss with ``reduction="sum"`` or ignored labels
(``ignore_index``) unevenly spread over microbatches does not have this property.

The module ``compile`` returns (:class:`autoshard.api.pipelined_module.PipelinedModule`) is this rank's stages as a
module of the model's names: ``named_parameters()`` and ``state_dict()`` list its stages' tensors (DTensors on the
stage's DeviceMesh), ``load_state_dict``, ``init_weights`` and ``autoshard.save``/``load`` work as on a
ShardedModule, and ``step(*args, target=..., losses=..., **kwargs)`` is ``torch.distributed.pipelining``'s
``Schedule.step`` (forward only in ``eval()`` mode).

The package keeps the pieces apart: :mod:`.options` (what the user asks for), :mod:`.plan` (the pipelined plan,
built by the one pass list with the split enabled); this process's runner and the module ``compile`` returns are
:mod:`autoshard.api.pipelined_module`, the schedules themselves :mod:`autoshard.runtime.pipeline`.
"""

from autoshard.compiler.pipeline.options import Pipeline, bubble_fraction
from autoshard.compiler.pipeline.plan import PipelinePlan, build_pipeline_plan

__all__ = [
    "Pipeline",
    "PipelinePlan",
    "bubble_fraction",
    "build_pipeline_plan",
]
