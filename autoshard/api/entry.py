"""The two ways in: :func:`compile` (plan and apply in one call, or plan on the first call) and :func:`apply` (a plan
made by :func:`autoshard.plan`, applied to the model on this rank). Both return the module this rank runs: a
:class:`~autoshard.api.sharded_module.ShardedModule`, or a :class:`~autoshard.api.pipelined_module.PipelinedModule`
for a pipelined plan; this module sits above both, so neither imports the other."""

from __future__ import annotations

import torch

from autoshard.api.planning import as_precision, check_number, make_options, plan_options, with_moe
from autoshard.api.sharded_module import ShardedModule
from autoshard.errors import PlanError
from autoshard.mesh import as_mesh

__all__ = ["apply", "compile"]


def compile(model: torch.nn.Module, mesh, example_inputs=None, example_kwargs: dict | None = None, *,
            annotations: dict | None = None, data_axis: str = "data", on_unsupported: str = "replicate",
            search=None, planner: str = "greedy", profile="cpu-gloo", memory_limit: float | str | None = None,
            optimizer: str = "adam", comm=None, timeout: float = 300.0, pipeline=None,
            bucket_cap_mb: float | None = None, moe=None, sequence_parallel: bool = False,
            device=None, zero: int | str | None = None, recompute: str | bool | None = None, precision=None,
            context_parallel=None, new_shapes: str = "plan", search_time_limit: float | None = None,
            plan: dict | None = None, context_axis=None) -> ShardedModule:
    """Shard ``model`` over ``mesh``: :func:`autoshard.plan` and :func:`autoshard.apply` in one call (see
    :mod:`autoshard.api.planning`, which groups these options by the question they answer), or, without example
    inputs, a module that plans on its first call.

    ``annotations`` maps glob patterns over parameter FQNs (or input names) to one placement per mesh axis, e.g.
    ``{"transformer.h.*.mlp.c_fc.weight": (Replicate(), Shard(1))}``; annotations are hard constraints (``plan=`` is
    the old name of this keyword, still accepted with a FutureWarning).

    ``search=autoshard.Search(profile=..., memory_limit=..., ...)`` runs the plan search (the grouped form of
    ``planner="search"``, ``profile``, ``memory_limit``, ``optimizer``, ``search_time_limit``, which stay accepted
    as shorthand; give one form, not both).

    ``planner="greedy"`` (default) propagates op by op, fewest bytes first. ``planner="search"`` chooses every
    other strategy by the plan search (an ILP; optimal, or within the gap it reports) minimising the estimated step
    time for the hardware ``profile`` (a preset name such as "cpu-gloo", "gpu-8x-nvlink", "multi-node", a TOML path,
    or a HardwareProfile) under ``memory_limit`` bytes per rank (an int or text like "2GiB").

    ``timeout`` (seconds): how long a collective waits for its peers under torch.distributed before raising
    :class:`~autoshard.errors.CollectiveTimeoutError` (a peer died or hangs).

    ``pipeline=autoshard.Pipeline(microbatches=..., schedule=..., split=...)`` cuts the model into stages over the
    mesh's ``pipe`` axis and returns a :class:`autoshard.api.pipelined_module.PipelinedModule` (its ``step()``, or a
    call, runs one training step, forward and backward, and returns the loss); see :mod:`autoshard.compiler.pipeline`.

    ``moe=autoshard.MoE(layers="blocks.*.mlp", every=2, num_experts=8, top_k=2, ...)`` rewrites the chosen dense
    FFNs as capacity-bounded Mixture-of-Experts layers with experts sharded over ``expert_axis`` (see
    :mod:`autoshard.compiler.moe`); their auxiliary losses train with the model's loss, and
    ``autoshard.moe_losses(module)`` / ``autoshard.moe_stats(module)`` report them after each forward.

    ``bucket_cap_mb``: data-parallel gradient all-reduces run like DDP's, in buckets of this many MiB launched
    asynchronously as gradients become ready during backward (:mod:`autoshard.runtime.buckets`; default as
    DDP's: a 1 MiB first bucket, then 25 MiB); 0 runs one blocking all-reduce per parameter inside backward
    instead. The gradients are identical either way.

    ``sequence_parallel=True`` (greedy planner): at equal communication prefer sharded activations, so norms and
    residuals between tensor-parallel layers run sharded along the sequence on the model axis (Megatron-SP:
    reduce-scatter + all-gather in place of each all-reduce, less activation memory per rank). Annotate the
    input's sequence dim, e.g. ``plan={"x": (Replicate(), Shard(1))}``, to start the model in that layout.

    ``zero``: how parameters are stored over the data axis, apart from the layout they compute in (ZeRO/FSDP):
    0 as computed; 1 sharded (optimizer state sharded too; gradients all-reduced, this rank's slice kept); 2 as 1
    with gradients reduce-scattered; 3 as 2 with the gathered copy freed after forward and gathered again for
    backward (FSDP's reshard-after-forward); ``"auto"`` (``planner="search"``) picks a stage per parameter under
    ``memory_limit``. ``recompute``: recompute activations in backward instead of saving them — False (only the
    model's own ``torch.utils.checkpoint`` regions), a glob over module paths (``"model.layers.*"``) or ``"auto"``
    (``planner="search"``). Left out (None), both are ``"auto"`` when ``planner="search"`` has a ``memory_limit``
    (the search then uses ZeRO storage and recomputation where the limit needs them, as it uses tensor
    parallelism) and 0 / False otherwise; a value given explicitly always wins (``zero=0, recompute=False``: a
    limited search without either). Hugging Face sparse-MoE experts need no ``moe=`` for this: their stacked weights
    may be split on the expert dim or stored sharded like any parameter (:mod:`autoshard.frontend.hf_blocks`).
    ``precision=autoshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=...)``: compute in
    ``param_dtype`` with the model's own dtype kept for the parameters the optimizer steps.

    ``context_axis="context"`` (or ``autoshard.ContextParallel(axis, attention="ring"|"all_gather"|"ulysses",
    balance=True)``): context parallelism — pass whole sequences; autoshard cuts them along that mesh axis
    (head-tail for causal balance) and runs attention sequence-sharded (:mod:`autoshard.compiler.context_parallel`).

    ``device``: where this rank's shards live (default: ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU).
    The model may be built under ``torch.device("meta")``: nothing is allocated until this rank's shards are, on
    ``device``; fill them with ``sharded.init_weights()`` (the model's own init, module by module) or
    ``autoshard.load(sharded, path)`` (a Hugging Face safetensors directory or an autoshard checkpoint). A model
    built normally gives each rank its slices and is not kept: the ShardedModule holds only this rank's shards.

    ``new_shapes="plan"`` (default): a call whose inputs differ from the example's (another batch size or sequence
    length, another constant argument) is planned for them on its first call — every parameter and buffer pinned to
    its layout in the plan, the same shards — and that program is cached per mode and input shapes (a notice after
    8 of them: pad or bucket inputs). ``"error"``: such a call is a RuntimeShapeError.

    ``search_time_limit`` (seconds, ``planner="search"``): how long the search may run (None: 120 s). A limit below
    the least memory the search can bound (or prove within a few seconds) is refused before the search's walk; one
    between that bound and the least-memory plan found is refused, saying so, when the search finds no plan in time.

    To shard the model object itself, in place (as FSDP2's ``fully_shard``), use :func:`autoshard.shard`.
    """
    mesh = as_mesh(mesh)
    if plan is not None:
        import warnings

        if annotations is not None:
            raise PlanError("compile got both annotations= and plan=, the old name of annotations=: give one.")
        warnings.warn("autoshard.compile(plan=...) is now annotations=...: the old name is still accepted.",
                      FutureWarning, stacklevel=2)
        annotations = plan
    if context_axis is not None:
        if context_parallel is not None:
            raise PlanError("compile got both context_parallel= and context_axis=, its shorthand: give one.")
        context_parallel = context_axis
    if search is not None:
        legacy = {k: v for k, v in (("planner", planner != "greedy"), ("profile", profile != "cpu-gloo"),
                                    ("memory_limit", memory_limit is not None), ("optimizer", optimizer != "adam"),
                                    ("search_time_limit", search_time_limit is not None)) if v}
        if legacy:
            raise PlanError(f"compile got search=Search(...) and {sorted(legacy)}, the shorthand for its fields: "
                            "give them inside Search(...).")
        options = plan_options(mesh, annotations=annotations, data_axis=data_axis, search=search,
                               zero=0 if zero is None else zero, recompute=recompute, precision=precision, moe=moe,
                               context_parallel=context_parallel, sequence_parallel=sequence_parallel,
                               on_unsupported=on_unsupported)
    else:
        options = make_options(annotations, data_axis, on_unsupported, mesh, planner, profile, memory_limit,
                               optimizer, sequence_parallel, zero, recompute, as_precision(precision))
        if context_parallel is not None:
            import dataclasses

            from autoshard.compiler.context_parallel import as_context_parallel

            options = dataclasses.replace(options, context_parallel=as_context_parallel(context_parallel, mesh))
        if search_time_limit is not None:
            import dataclasses

            # checked as Search.time_limit is
            options = dataclasses.replace(options, search_time_limit=check_number("search_time_limit",
                                                                                  search_time_limit, 0, above=True))
        if moe is not None:
            options = with_moe(options, moe)
    if pipeline is not None:
        from autoshard.api.pipelined_module import PipelinedModule

        return PipelinedModule(model, mesh, options, example_inputs, example_kwargs, pipeline, comm, timeout, device,
                               bucket_cap_mb=bucket_cap_mb)
    return ShardedModule(model, mesh, options, example_inputs, example_kwargs, comm, timeout, bucket_cap_mb, device,
                         new_shapes)


def apply(model: torch.nn.Module, plan, *, device=None, comm=None, timeout: float = 300.0,
          bucket_cap_mb: float | None = None, new_shapes: str = "plan"):
    """``model`` sharded as ``plan`` says, on this process's rank: a :class:`autoshard.ShardedModule` (a
    :class:`autoshard.api.pipelined_module.PipelinedModule` for a pipelined plan). Nothing is planned again.

    ``model`` is the model planned, or one with the same parameters and buffers (names, shapes, dtypes: checked,
    a difference is a :class:`PlanError` naming it); its own tensors are the ones sharded. ``device``: where this
    rank's shards live (default: the current accelerator, else CPU). ``comm``: the communicator to run on (default:
    torch.distributed's). ``timeout``: seconds a collective waits for its peers. ``bucket_cap_mb``: gradient
    buckets as DDP's (None: DDP's sizes; 0: one blocking all-reduce per parameter). ``new_shapes``: "plan" (inputs
    of other shapes are planned for on first call, every parameter pinned) or "error"."""
    from autoshard.compiler.plan import Plan

    if not isinstance(model, torch.nn.Module):
        raise PlanError(f"model has type {type(model).__name__}, but autoshard.apply shards a torch.nn.Module.")
    if not isinstance(plan, Plan):
        from autoshard.compiler.pipeline import PipelinePlan

        if isinstance(plan, PipelinePlan):
            from autoshard.api.pipelined_module import PipelinedModule

            plan.microbatch_plan.check_model(model)
            return PipelinedModule.of_plan(model, plan, comm=comm, timeout=timeout, device=device,
                                           bucket_cap_mb=bucket_cap_mb)
        raise PlanError(f"autoshard.apply got a {type(plan).__name__} as plan, but needs what autoshard.plan returns.")
    plan.check_model(model)
    plan.bind_weights(model)
    return ShardedModule(model, plan.mesh, plan.context.options, comm=comm, timeout=timeout,
                         bucket_cap_mb=bucket_cap_mb, device=device, new_shapes=new_shapes, planned=plan)
