"""``autoshard.shard(model, mesh, ...)``: the user's model, sharded in place (as FSDP2's ``fully_shard``).

The object the user holds stays theirs: same object, its class a subclass of its own (``ShardedGPT`` of ``GPT``,
so ``isinstance``, methods, attributes and ``config`` work), every parameter and buffer replaced by this rank's
shards as ``DTensor``s with the global shapes (the model's own tensors are dropped: no unsharded copy is left with
stale weights). Calling it runs this rank's program of the plan; methods that call the model (``generate``,
``estimate_mfu``, an evaluation loop) go through that call.

What the subclass adds or changes (nothing else): ``forward`` runs the plan's program (a program per training mode
and input shapes, :class:`autoshard.api.sharded_module.ShardedModule`); ``train()``/``eval()`` also switch the program;
``load_state_dict`` takes whole tensors or DTensors of any layout; ``compile()`` and ``torch.compile`` compile the
rank programs; ``no_sync()``, ``set_requires_gradient_sync()``, ``require_backward_grad_sync`` (DDP's and FSDP2's
names); ``data_parallel_rank`` / ``data_parallel_size`` (which chunk of the global batch this rank loads); and
``.autoshard``, the :class:`~autoshard.api.sharded_module.ShardedModule` that holds the plan
(``model.autoshard.show()``). Moving or casting (``.to()``, ``.cuda()``, ``.half()``) is an error: the shards are placed
by autoshard.

``torch.compile``: autoshard runs the model as one traced program per mode and input shapes, so that program is
what gets compiled — ``torch.compile(model)`` (before or after ``shard``), ``model.compile(...)`` (its options are
passed on) and a compiled block (torchtitan's per-block ``torch.compile``) all compile the rank programs; a compiled
block compiles the whole program, and a notice says so once.
"""

from __future__ import annotations

import torch

from autoshard.errors import AutoshardError

__all__ = ["ShardedModel", "shard"]


def shard(model: torch.nn.Module, mesh, example_inputs=None, example_kwargs: dict | None = None, **options):
    """Shard ``model`` over ``mesh`` in place and return it (the same object).

    ``example_inputs`` / ``example_kwargs``: this rank's inputs as it will pass them in a call — its chunk of the
    global batch (``model.data_parallel_rank`` says which, once sharded; pass any batch of the right shapes). The
    plan is made now, so the parameters are this rank's shards before the optimizer is built.
    Other keywords are :func:`autoshard.compile`'s (``planner``, ``memory_limit``, ``plan``, ``zero``, ``recompute``,
    ``precision``, ...). Needs this process's rank: run under ``torchrun`` (``torch.distributed`` initialised), or
    pass ``comm=``. A ``torch.compile``'d model is sharded inside (its ``_orig_mod``); the compiled wrapper is
    returned and compiles the rank programs."""
    from torch._dynamo.eval_frame import OptimizedModule

    from autoshard.api.entry import compile as compile_sharded

    target = model._orig_mod if isinstance(model, OptimizedModule) else model
    if not isinstance(target, torch.nn.Module):
        raise AutoshardError(f"autoshard.shard takes a torch.nn.Module, not {type(model).__name__}.")
    if isinstance(target, ShardedModel):
        raise AutoshardError(f"this {type(target).__name__} is sharded already (autoshard.shard was called on it "
                             "before): shard a model once.")
    if getattr(type(target), "AUTOSHARD_SHARDED", False):
        raise AutoshardError("autoshard.shard takes the model itself, not a ShardedModule made by autoshard.compile.")
    if example_inputs is None and example_kwargs is None:
        raise AutoshardError("autoshard.shard needs example_inputs= (this rank's batch, as it will pass it to the "
                             "model): the plan decides how each parameter is sharded, and is made from the shapes of "
                             "a call before the optimizer is built.")
    if options.get("pipeline") is not None:
        raise AutoshardError("autoshard.shard does not cut pipeline stages (a rank then holds only its stage's "
                             "modules, not the model): use autoshard.compile(model, mesh, pipeline=...).")
    for name in ("mesh",):
        options.pop(name, None)
    engine = compile_sharded(target, mesh, **options)
    args = () if example_inputs is None else (
        tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,))
    object.__setattr__(engine, "_in_place", target)  # a plain attribute, not a child module (no cycle)
    engine._build_plan(*engine._global_examples(args, dict(example_kwargs or {})))
    engine.materialize()  # this rank's shards replace the model's tensors (ShardedModule._publish)
    target.__dict__["_autoshard"] = engine
    target.__class__ = _sharded_class(type(target))
    return model


_CLASSES: dict[type, type] = {}


def _sharded_class(cls: type) -> type:
    found = _CLASSES.get(cls)
    if found is None:
        found = type(f"Sharded{cls.__name__}", (ShardedModel, cls), {"__module__": cls.__module__})
        _CLASSES[cls] = found
    return found


class ShardedModel:
    """Mixed into the class of a model sharded by :func:`shard` (first in its bases: its methods win)."""

    #: what autoshard.save/load and init code recognise an in-place sharded model by
    AUTOSHARD_IN_PLACE = True

    @property
    def autoshard(self):
        """The :class:`~autoshard.api.sharded_module.ShardedModule` that holds this model's plan and programs
        (``show()``, ``code(rank)``, ``plan``)."""
        return self.__dict__["_autoshard"]

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # torch.compile(model): the rank programs are what is compiled
            return _call_compiled(self, args, kwargs)
        return _call(self, args, kwargs)

    def train(self, mode: bool = True):
        super().train(mode)
        self.autoshard.train(mode)
        return self

    def compile(self, *args, **kwargs) -> None:
        """As ``nn.Module.compile``: from the next call on, the rank programs run through
        ``torch.compile(program, **kwargs)``."""
        if args:
            raise AutoshardError("model.compile() of a sharded model takes torch.compile's keyword options only.")
        self.autoshard.compile_programs(**kwargs)

    def _apply(self, fn, recurse: bool = True):
        raise AutoshardError(f"this {type(self).__name__}'s parameters are this rank's shards, placed by "
                             "autoshard.shard: moving or casting them (.to(), .cuda(), .half(), ...) would leave the "
                             "program behind. Move the model before sharding it, or pass device=... and "
                             "precision=autoshard.MixedPrecision(...) to autoshard.shard.")

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As ``nn.Module.load_state_dict``, by the model's names: values may be DTensors (of any layout: they are
        redistributed) or whole tensors (this rank takes its slices)."""
        from autoshard.api.sharded_module import prepared_state

        if assign:
            raise AutoshardError("load_state_dict(assign=True) would replace the tensors this rank's program reads; "
                                 "load with assign=False (the values are copied into the shards).")
        mine = dict(torch.nn.Module.state_dict(self, keep_vars=True))
        return super().load_state_dict(prepared_state(mine, state_dict), strict=strict)

    # ---- DDP's and FSDP2's habits -------------------------------------------------------------------------
    def no_sync(self):
        """As DDP's: calls inside the block accumulate gradients without syncing them; the first call after it
        syncs everything accumulated."""
        return self.autoshard.no_sync()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """As FSDP2's: ``False`` until set ``True`` again, backward keeps gradients unsynced (accumulated)."""
        self.autoshard.set_requires_gradient_sync(requires_gradient_sync)

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's attribute: whether the next backward syncs gradients (settable)."""
        return self.autoshard.require_backward_grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.autoshard.set_requires_gradient_sync(value)

    @property
    def data_parallel_rank(self) -> int:
        """Which chunk of the global batch this rank loads (its coordinate on the data axis; ranks that differ only
        on other axes load the same chunk) — DDP's ``rank`` for data."""
        return self.autoshard.data_parallel_rank

    @property
    def data_parallel_size(self) -> int:
        """Into how many chunks the global batch is cut (the data axis's size) — DDP's ``world_size`` for data."""
        return self.autoshard.data_parallel_size


def _call(model, args, kwargs):
    engine = model.__dict__["_autoshard"]
    if engine.training != model.training:
        engine.train(model.training)
    if engine._compile_options is None:
        block = _compiled_block(model)
        if block is not None:
            from autoshard.runtime.notices import notice

            notice("autoshard: a block of the model is torch.compile'd; autoshard runs the model as one traced "
                   "program, so that whole program is compiled (with the block's backend).")
            engine.compile_programs(**_options_of(block))
    return engine(*args, **kwargs)


@torch._dynamo.disable
def _call_compiled(model, args, kwargs):
    """The model's call from inside ``torch.compile(model)``'s frame (dynamo runs this eagerly: a graph break):
    the rank programs are compiled with that compile's backend."""
    engine = model.__dict__["_autoshard"]
    if engine._compile_options is None:
        engine.compile_programs(**_options_of(_compiling_wrapper(model)))
    return _call(model, args, kwargs)


def _compiled_block(model: torch.nn.Module):
    """A submodule of ``model`` that is ``torch.compile``'d (an ``OptimizedModule`` put in its place, or a module
    whose ``compile()`` was called), or None."""
    from torch._dynamo.eval_frame import OptimizedModule

    for m in model.modules():
        if m is not model and (isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None):
            return m
    return None


def _compiling_wrapper(model: torch.nn.Module):
    """The ``OptimizedModule`` (``torch.compile(model)``) whose call is running ``model`` on this thread, or None
    (``model.compile()`` was called before sharding). Found on the call stack: the wrapper is not referenced by the
    model."""
    import sys

    from torch._dynamo.eval_frame import OptimizedModule

    frame = sys._getframe(1)
    for _ in range(64):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if isinstance(owner, OptimizedModule) and owner._orig_mod is model:
            return owner
        frame = frame.f_back
    return None


def _options_of(compiled) -> dict:
    """``torch.compile`` options for the rank programs that repeat ``compiled``'s backend (an ``OptimizedModule``;
    a module whose ``compile()`` was called or None: the default backend)."""
    backend = getattr(getattr(compiled, "dynamo_ctx", None), "callback", None)
    while hasattr(backend, "_torchdynamo_orig_backend"):  # dynamo's wrappers, down to torch.compile's backend
        backend = backend._torchdynamo_orig_backend
    return {} if backend is None else {"backend": backend}
