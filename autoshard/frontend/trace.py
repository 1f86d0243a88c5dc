"""Frontend: capture an ``nn.Module`` as an aten-level FX graph with static shapes.

``torch.export.export(strict=False)`` gives the training IR (high-level aten ops such as ``aten.linear``,
``aten.layer_norm``, ``aten.scaled_dot_product_attention``), a ``"val"`` FakeTensor on every node, and the
module path of every op in ``nn_module_stack``. We keep the *unlifted* form (``ExportedProgram.module()``):
parameters and buffers appear as ``get_attr`` nodes whose targets are their original fully-qualified names
(``transformer.h.0.mlp.c_fc.weight``), which is what user annotations and per-rank weight copies key on.
The pytree calling convention of the exported module (``_in_spec``/``_out_spec``) is kept, so per-rank modules
are called exactly like the original model (same args, kwargs, and output structure).

Removed after export: the input guard module (it checks *global* shapes, but ranks see local ones) and
``aten._assert_tensor_metadata`` nodes (dtype asserts without effect on values). Then parameters are put in the
model's order and ops renamed from their targets, so the graph does not depend on how it was made: a list of
identical layers is traced once and copied (:mod:`autoshard.frontend.layer_reuse`; ``reuse_layers=False`` exports every
layer), and both ways give the same code.

The model's own ``torch.utils.checkpoint`` regions: export inlines them (their ops appear in the graph like any
other, with nothing that says they were checkpointed). While exporting, :class:`_checkpoint_regions` wraps the
function every ``use_reentrant=False`` checkpoint call goes through (``_checkpoint_without_reentrant_generator``,
looked up at call time, so a ``from torch.utils.checkpoint import checkpoint`` or a ``functools.partial`` of it is
seen too; a ``use_reentrant=True`` call, which export turns into a no-grad submodule whose gradients would be lost,
is a :class:`TraceError` naming its line) so that the ops of each call are annotated (``torch.fx.traceback.annotate``);
:func:`_mark_checkpoint_regions` turns the annotations into :data:`autoshard.meta.RECOMPUTE` ids — the region's module
path (the common prefix of its ops' paths, ``#2``, ``#3`` for further calls of one module), distinct per call. A nested
call belongs to the outermost region.

Side effects: torch is patched only inside the ``with`` around ``torch.export`` in :func:`_export` (the checkpoint
wrappers above, installed while any thread exports and restored when the last one leaves, whether export
succeeded or failed). When the layers are not copied, the reason goes to the ``autoshard.frontend.trace`` logger
(:func:`_log_no_reuse`: INFO for a :class:`~autoshard.frontend.layer_reuse.CannotReuse` reason, WARNING with the
traceback for a fault of the copying itself); nothing is swallowed silently.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch
import torch.fx

from autoshard.frontend import layer_reuse
from autoshard import meta as M
from autoshard.errors import AutoshardError, TraceError
from autoshard.frontend.graph_utils import fetch_attr, verify_traced  # fetch_attr re-exported (trace.fetch_attr)
from autoshard.frontend.layer_reuse import find_groups
from autoshard.progress import slow_step
from autoshard.runtime.torch_state import RANK_THREADS

log = logging.getLogger(__name__)

#: gm.meta: container path -> [traced layer, copied layers...] (autoshard.frontend.layer_reuse)
REUSED_LAYERS = M.REUSED_LAYERS
_DROP_TARGETS = {torch.ops.aten._assert_tensor_metadata.default}


def trace(model: torch.nn.Module, args: tuple = (), kwargs: dict | None = None,
          reuse_layers: bool = True, device: torch.device | str | None = None) -> torch.fx.GraphModule:
    """Export ``model(*args, **kwargs)`` to a GraphModule with static shapes, FQN-named get_attrs and module paths.

    With ``reuse_layers`` (default), a list of identical layers is traced once and copied (see
    :mod:`autoshard.frontend.layer_reuse`); the graph is the same as exporting every layer.

    ``device``: where the program will run, for a model on the meta device (a meta-built model, or the skeleton a
    ShardedModule traces its other programs from). Its tensors and the inputs are then traced as FakeTensors on that
    device (:class:`_on_device`), so that code which reads a tensor's device (``x.device.type``, as Hugging Face's
    Mixtral picks ``torch.histc``'s dtype by it) takes the branch it takes when the program runs; the graph still
    holds the model's own meta tensors. Without it (or with ``"meta"``, or a device this process has no backend for)
    such a model is traced on meta inputs. A model whose tensors are real is traced where they are, whatever
    ``device`` says.
    """
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"model has type {type(model).__name__}, but autoshard traces torch.nn.Module instances.")
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    args, kwargs = unaliased(args, dict(kwargs or {}))
    device = torch.device(device) if device is not None and on_meta(model) else None
    if device is not None and not _traceable_on(device):
        device = None
    if device is None and on_meta(model):
        # a model built under torch.device("meta"): trace with meta inputs of the same shapes and dtypes
        args, kwargs = torch.utils._pytree.tree_map(_to_meta, (args, kwargs))
    # one trace at a time where ranks are threads of one process (the simulator; a no-op otherwise)
    # (no frame between this one and _export: the traceback of a model torch.export cannot trace stays short)
    faking = _on_device(model, device) if device is not None else contextlib.nullcontext()
    with RANK_THREADS.exclusive(), slow_step(f"autoshard: tracing {type(model).__name__} with torch.export"), \
            faking as faked:
        if faked is not None:
            args, kwargs = faked.inputs(args, kwargs)
        gm = None
        if reuse_layers:
            try:  # a checkpoint region in a copied layer would lose its mark: such models export every layer
                gm = _finish(_export_reusing_layers(model, args, kwargs), model, "layer_reuse")
            except Exception as e:  # copying is an optimisation: every failure falls back to exporting every layer
                _log_no_reuse(model, e)
        if gm is None:
            gm = _finish(_export(model, args, kwargs), model, "trace")
    return gm if faked is None else faked.restore(gm)


def _traceable_on(device: torch.device) -> bool:
    """Whether FakeTensors on ``device`` can be traced in this process: the CPU, or a backend this torch has and
    sees (a plan made for a GPU on a machine without one is traced on meta: a fake kernel asking a missing backend
    for its device guard aborts the process)."""
    if device.type == "cpu":
        return True
    backend = getattr(torch, device.type, None) if device.type != "meta" else None
    available = getattr(backend, "is_available", None)
    return bool(available is not None and available())


class _on_device:
    """While a model on the meta device is traced for ``device``: each of its meta parameters, buffers and tensor
    attributes is a FakeTensor on ``device`` (one per tensor: tied weights stay tied; ``requires_grad`` kept), put
    back on exit. torch.export takes FakeTensor parameters as it takes real ones (it fakifies them again in its own
    fake mode), so the trace is the one of a model whose weights are on ``device``, at no memory cost.
    :meth:`restore` then gives the graph the model's own meta tensors back."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.model, self.device = model, device
        self.mode = FakeTensorMode()
        self.original: dict[int, torch.Tensor] = {}  # id(fake) -> the meta tensor it stands for
        self._fakes: dict[int, torch.Tensor] = {}  # id(meta tensor) -> its fake (they keep the ids above unique)
        self._swapped: list[tuple] = []  # (table or module, key, meta tensor): what __exit__ puts back

    def _fake(self, t: torch.Tensor) -> torch.Tensor:
        fake = self._fakes.get(id(t))
        if fake is None:
            with self.mode:
                fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=self.device)
            if isinstance(t, torch.nn.Parameter):
                fake = torch.nn.Parameter(fake, requires_grad=t.requires_grad)
            elif t.requires_grad:
                fake.requires_grad_(True)
            self._fakes[id(t)] = fake
            self.original[id(fake)] = t
        return fake

    def __enter__(self):
        try:
            for module in self.model.modules():
                for table in (module._parameters, module._buffers):
                    for key, t in list(table.items()):
                        if isinstance(t, torch.Tensor) and t.is_meta:
                            self._swapped.append((table, key, t))
                            table[key] = self._fake(t)
                for key, t in list(vars(module).items()):  # plain tensor attributes (constants)
                    if isinstance(t, torch.Tensor) and t.is_meta:
                        self._swapped.append((module, key, t))
                        module.__dict__[key] = self._fake(t)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for owner, key, t in reversed(self._swapped):
            if isinstance(owner, dict):
                owner[key] = t
            else:
                owner.__dict__[key] = t
        self._swapped = []
        return False

    def inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Every tensor of ``(args, kwargs)`` as a FakeTensor on the device (same shape, strides, dtype, grad)."""
        def fake(x):
            if not isinstance(x, torch.Tensor):
                return x
            with self.mode:
                out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=self.device)
            return out.requires_grad_(x.requires_grad)

        return torch.utils._pytree.tree_map(fake, (args, kwargs))

    def restore(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """``gm`` holding the model's meta tensors where the trace left their fakes. A value that is one of those
        fakes (a copied layer's get_attr, whose value is its tensor) becomes a FakeTensor of export's own fake mode
        on the device, like every other value of the graph."""
        from torch._subclasses.fake_tensor import FakeTensor

        for module in gm.modules():
            for table in (module._parameters, module._buffers):
                for key, t in list(table.items()):
                    if t is not None and id(t) in self.original:
                        table[key] = self.original[id(t)]
            for key, t in list(vars(module).items()):
                if isinstance(t, torch.Tensor) and id(t) in self.original:
                    module.__dict__[key] = self.original[id(t)]
        vals = [n.meta.get("val") for n in gm.graph.nodes]
        export_mode = next((v.fake_mode for v in vals if isinstance(v, FakeTensor) and v.fake_mode is not self.mode),
                           None)
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            if not (isinstance(val, torch.Tensor) and id(val) in self.original):
                continue
            if export_mode is None:  # nothing of export's in the graph to match: the meta tensor, as on meta
                node.meta["val"] = self.original[id(val)]
                continue
            with export_mode:
                node.meta["val"] = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype,
                                                       device=val.device).requires_grad_(val.requires_grad)
        return gm


def unaliased(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with every tensor that shares memory with an earlier one (the same object twice, a view of
    another input) replaced by a copy. Example inputs stand for any later call's inputs: torch.export traces two
    aliased inputs as one, and the program would read one where the model reads two (``(z, z)`` for ``(idx,
    targets)`` gave an embedding of the targets)."""
    leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    seen: set = set()
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if _memory(x) & seen:
                x = x.detach().clone().requires_grad_(x.requires_grad)
            seen |= _memory(x)
        out.append(x)
    return torch.utils._pytree.tree_unflatten(out, spec)


def _memory(x: torch.Tensor) -> set:
    """What identifies the memory ``x`` reads: the tensor, its base, and (off the meta device) its storage."""
    keys = {("object", id(x))}
    if x._base is not None:
        keys.add(("object", id(x._base)))
    if not x.is_meta and x.untyped_storage().nbytes():
        keys.add(("storage", str(x.device), x.untyped_storage().data_ptr()))
    return keys


def _log_no_reuse(model: torch.nn.Module, e: Exception) -> None:
    """Say on the ``autoshard.frontend.trace`` logger why the layers of ``model`` are not copied: a
    :class:`~autoshard.frontend.layer_reuse.CannotReuse` reason (layers that differ, a structure the copy does not
    handle) or an export that failed with copied layers at INFO (exporting every layer reports a real failure again);
    anything else, a fault of the copying itself, at WARNING with its traceback."""
    name = type(model).__name__
    reason = _cause(e, layer_reuse.CannotReuse)
    if reason is not None:
        log.info("%s: exporting every layer, the layers are not copied: %s", name, reason)
    elif isinstance(e, TraceError):
        log.info("%s: exporting every layer, the export with copied layers failed: %s", name,
                 str(e).split(". ")[0])
    else:
        log.warning("%s: exporting every layer, copying the layers failed: %s: %s", name, type(e).__name__, e,
                    exc_info=e)


def on_meta(model: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _to_meta(x):
    return torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x


def _export_reusing_layers(model, args, kwargs) -> torch.fx.GraphModule:
    groups = find_groups(model)
    if not groups:
        raise layer_reuse.CannotReuse("no repeated layers")
    for attempt in range(4):
        try:
            _CHECKPOINT_STATE.refuse = True  # the first checkpoint call ends this export (see _checkpoint_call)
            try:
                with layer_reuse.reuse_layers(model, groups):
                    gm = _export(model, args, kwargs)
            finally:
                _CHECKPOINT_STATE.refuse = False
            if any(_CHECKPOINT_KEY in (n.meta.get("custom") or {}) for n in gm.graph.nodes):
                raise layer_reuse.CannotReuse("torch.utils.checkpoint regions")
        except Exception as e:  # a copy called with other inputs: lead its group from there (once per group)
            mismatch = _cause(e, layer_reuse.LayerMismatch)
            if mismatch is None or attempt == 3:
                raise
            groups = layer_reuse.starting_at(groups, mismatch.group, mismatch.index)
        else:
            from autoshard.frontend import hf_blocks

            with hf_blocks.swapped(model):  # each copy's experts fingerprinted as exported: the static op
                wrong = layer_reuse.verify(groups)
            if not wrong:
                break
            groups = layer_reuse.without(groups, wrong)  # export again, tracing the layers that differ
        if not groups:
            raise layer_reuse.CannotReuse("no layer can be copied")
    else:
        raise layer_reuse.CannotReuse("the layers could not be matched")
    layer_reuse.expand_layer_calls(gm, groups, model)
    gm.meta[REUSED_LAYERS] = {g.prefix: [g.first, *g.stubbed] for g in groups if g.stubbed}
    return gm


def _cause(e: BaseException, kind: type):
    """``e`` or the first exception of its cause/context chain that is a ``kind``."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _export(model, args, kwargs) -> torch.fx.GraphModule:
    from autoshard.frontend import hf_blocks

    regions = _checkpoint_regions()
    try:  # Hugging Face sparse-MoE experts run a static-shape op while exporting (the model is restored after)
        with _quiet_export_logs(), regions, hf_blocks.swapped(model) as moe_blocks:
            ep = torch.export.export(model, args, kwargs, strict=False)
    except Exception as e:  # export raises many types; all mean the same thing to the user
        if regions.reentrant:
            raise _reentrant_error(model, regions.reentrant) from e
        own = _cause(e, AutoshardError)
        if own is not None:  # autoshard's own error from inside the trace (an experts block it cannot run) says more
            raise own from None
        raise export_error(model, e) from e
    if regions.reentrant:
        raise _reentrant_error(model, regions.reentrant)
    gm = ep.module()
    gm.meta[hf_blocks.FOUND] = moe_blocks
    return gm


def export_error(model: torch.nn.Module, e: BaseException) -> TraceError:
    """A :class:`TraceError` for torch.export's failure ``e``: names the model's source line that failed (file,
    line and code) and the cause in one line, and says what to change. Printed, it is a few lines: its traceback
    ends at that source line, and the attached ``__cause__`` (``e`` itself, message intact) shows only the model's
    own frames; torch's internal frames stay readable as text in ``err.export_traceback``."""
    import traceback

    full = "".join(traceback.format_exception(e))
    frames = [(tb, fs) for tb, fs in zip(_tb_entries(e.__traceback__), traceback.extract_tb(e.__traceback__))
              if not _internal(fs.filename)]
    where = ""
    if frames:
        fs = frames[-1][1]
        code = (fs.line or "").strip()
        where = f" {fs.filename}:{fs.lineno} in {fs.name}" + (f", `{code}`," if code else "")
    text = " ".join(str(e).split("\n\n")[0].split()) or type(e).__name__
    cause = f"{type(e).__name__}: {text if len(text) <= 240 else text[:237] + '...'}"
    err = TraceError(
        f"model {type(model).__name__} could not be traced by torch.export (strict=False):{where} raised {cause}. "
        "autoshard needs a graph with static shapes: remove data-dependent Python control flow (branches on "
        "tensor values, .item()), pass every input as a tensor argument, and for Hugging Face models set "
        "use_cache=False. torch.export's error is attached as __cause__ (its full traceback: .export_traceback).")
    err.export_traceback = full
    _release(e)
    user_tb = _chain([tb for tb, _ in frames])
    e.__traceback__ = user_tb  # the model's frames only; torch.export's internals are in err.export_traceback
    e.__suppress_context__ = True  # torch's own internal chain stays reachable as e.__context__
    if user_tb is not None:
        last = user_tb
        while last.tb_next is not None:
            last = last.tb_next
        err = err.with_traceback(_chain([last]))  # printed, this error's traceback ends at the failing line
    return err


def _release(e: BaseException) -> None:
    """Let torch.export's failed run finish unwinding now: its frames hold context managers (a fake mode's
    in-kernel flag, dispatch modes) whose exits only run when the frames go; kept alive by the exception chain, they
    would leave that state set for the next trace in this process. The frames' text is in ``export_traceback``."""
    import gc

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for tb in _tb_entries(e.__traceback__):
            if _internal(tb.tb_frame.f_code.co_filename):
                try:
                    tb.tb_frame.clear()
                except RuntimeError:  # a frame still executing (this one's callers)
                    pass
        e = e.__cause__ or e.__context__
    gc.collect()


def _tb_entries(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def _chain(entries: list):
    """A new traceback through ``entries`` (traceback objects), in order."""
    import types

    out = None
    for tb in reversed(entries):
        out = types.TracebackType(out, tb.tb_frame, tb.tb_lasti, tb.tb_lineno)
    return out


def _internal(filename: str) -> bool:
    """Frames of torch, of autoshard itself, of the standard library and generated code: not the model's."""
    import os
    import sysconfig

    import autoshard

    path = os.path.abspath(filename)
    roots = (os.path.dirname(torch.__file__), os.path.dirname(autoshard.__file__),
             sysconfig.get_paths()["stdlib"])
    return filename.startswith("<") or any(path.startswith(r + os.sep) for r in roots)


class _quiet_export_logs:
    """Drop torch's "Unable to find user code corresponding to {u0}" warnings (a graph dump on stderr per
    data-dependent value) while exporting: the TraceError names the line instead."""

    def __enter__(self):
        import logging

        self._logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
        self._filter = lambda record: not str(record.msg).startswith("Unable to find user code")
        self._logger.addFilter(self._filter)

    def __exit__(self, *exc):
        self._logger.removeFilter(self._filter)
        return False


_CHECKPOINT_KEY = M.CHECKPOINT_CALL  # in a node's meta["custom"]: the number of the checkpoint call that made it
_CHECKPOINT_STATE = threading.local()


class _checkpoint_regions:
    """While exporting on this thread, annotate the ops of every ``torch.utils.checkpoint`` call with the call's
    number (``meta["custom"][_CHECKPOINT_KEY]``). The wrappers stay installed process-wide while any thread exports
    (a counter), and do nothing on threads that are not exporting."""

    _lock = threading.Lock()
    _users = 0
    _saved: tuple = ()
    reentrant = None

    def __enter__(self):
        import torch.utils.checkpoint as ckpt

        with self._lock:
            if type(self)._users == 0:
                type(self)._saved = (ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction)
                ckpt._checkpoint_without_reentrant_generator = _annotated_generator(type(self)._saved[0])
                ckpt.CheckpointFunction = _ReentrantCall(type(self)._saved[1])
            type(self)._users += 1
        self._was = getattr(_CHECKPOINT_STATE, "calls", None), getattr(_CHECKPOINT_STATE, "reentrant", None)
        _CHECKPOINT_STATE.calls, _CHECKPOINT_STATE.reentrant = 0, None
        return self

    def __exit__(self, *exc):
        import torch.utils.checkpoint as ckpt

        self.reentrant = _CHECKPOINT_STATE.reentrant
        _CHECKPOINT_STATE.calls, _CHECKPOINT_STATE.reentrant = self._was
        with self._lock:
            type(self)._users -= 1
            if type(self)._users == 0:
                ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction = type(self)._saved
        return False


@contextlib.contextmanager
def _checkpoint_call():
    """Annotate the ops made inside (the outermost checkpoint call only) with a new call number."""
    import torch.fx.traceback as fx_traceback

    calls = getattr(_CHECKPOINT_STATE, "calls", None)
    inside = getattr(_CHECKPOINT_STATE, "inside", False)
    if calls is not None and getattr(_CHECKPOINT_STATE, "refuse", False):
        # an export that copies layers would copy a region's marks to layers that may not be checkpointed: stop it
        # at once (not after the whole model) and export every layer instead
        raise layer_reuse.CannotReuse("torch.utils.checkpoint regions")
    if calls is None or inside:  # not exporting on this thread, or nested in an annotated call
        yield
        return
    _CHECKPOINT_STATE.calls = calls + 1
    _CHECKPOINT_STATE.inside = True
    try:
        with fx_traceback.preserve_node_meta(), fx_traceback.annotate({_CHECKPOINT_KEY: calls + 1}):
            yield
    finally:
        _CHECKPOINT_STATE.inside = False


def _annotated_generator(generator):
    def checkpoint_without_reentrant_generator(*args, **kwargs):
        with _checkpoint_call():
            yield from generator(*args, **kwargs)
    return checkpoint_without_reentrant_generator


class _ReentrantCall:
    """``CheckpointFunction`` while exporting: remembers where the model first calls ``checkpoint(...,
    use_reentrant=True)`` on an exporting thread (the trace then refuses the model), and runs it as before."""

    def __init__(self, function):
        self._function = function

    def apply(self, *args):
        if getattr(_CHECKPOINT_STATE, "calls", None) is not None and getattr(_CHECKPOINT_STATE, "refuse", False):
            raise layer_reuse.CannotReuse("torch.utils.checkpoint regions")
        if getattr(_CHECKPOINT_STATE, "calls", None) is not None and _CHECKPOINT_STATE.reentrant is None:
            import traceback

            frames = [f for f in traceback.extract_stack() if not _internal(f.filename)]
            f = frames[-1] if frames else None
            _CHECKPOINT_STATE.reentrant = f"{f.filename}:{f.lineno}, `{(f.line or '').strip()}`" if f else "?"
        return self._function.apply(*args)

    def __getattr__(self, name):
        return getattr(self._function, name)


def _reentrant_error(model: torch.nn.Module, where: str) -> TraceError:
    return TraceError(
        f"model {type(model).__name__} calls torch.utils.checkpoint.checkpoint with use_reentrant=True at {where}: "
        "torch.export traces such a region under no_grad, so its gradients would be lost. Pass "
        "use_reentrant=False (autoshard then recomputes the region in backward); for Hugging Face models call "
        "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}).")


def _mark_checkpoint_regions(gm: torch.fx.GraphModule) -> None:
    """:data:`autoshard.meta.RECOMPUTE` on the ops of every checkpoint call: the common module path of the call's
    ops (``blocks.0``), with ``#2``, ``#3``... for further calls with the same path."""
    calls: dict[int, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        call = (node.meta.get("custom") or {}).get(_CHECKPOINT_KEY)
        if call is not None and node.op == "call_function":
            calls.setdefault(call, []).append(node)
    seen: dict[str, int] = {}
    for nodes in calls.values():
        paths = [M.module_path(n).split(".") if M.module_path(n) else [] for n in nodes]
        common = paths[0]
        for p in paths[1:]:
            k = 0
            while k < min(len(common), len(p)) and common[k] == p[k]:
                k += 1
            common = common[:k]
        path = ".".join(common) or "checkpoint"
        seen[path] = seen.get(path, 0) + 1
        region = path if seen[path] == 1 else f"{path}#{seen[path]}"
        for n in nodes:
            n.meta[M.RECOMPUTE] = region


def _finish(gm: torch.fx.GraphModule, model: torch.nn.Module, step: str) -> torch.fx.GraphModule:
    """The exported graph cleaned and named; ``step`` (trace, or layer_reuse when layers were copied) is what
    :func:`verify_traced` blames for a broken graph."""
    _clean(gm)
    _mark_checkpoint_regions(gm)
    _order_attrs(gm, model)
    _annotate_params(gm, model)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and "val" not in node.meta:
            node.meta["val"] = fetch_attr(gm, node.target)
    _renumber(gm)  # assigning the new graph recompiles the module
    return verify_traced(gm, step)


def _clean(gm: torch.fx.GraphModule) -> None:
    g = gm.graph
    for node in list(g.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards"):
            g.erase_node(node)
        elif node.op == "call_function" and node.target in _DROP_TARGETS and not node.users:
            g.erase_node(node)
    for name, _ in list(gm.named_children()):
        if name.startswith("_guards"):
            delattr(gm, name)
    g.eliminate_dead_code()
    g.lint()


def _order_attrs(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """Parameters, then buffers, then other constants, in the model's order, right after the inputs — the order
    export lifts them in, whichever way the graph was made (copied layers add theirs afterwards)."""
    rank: dict[str, tuple[int, int]] = {}
    for kind, named in enumerate((model.named_parameters(remove_duplicate=False),
                                  model.named_buffers(remove_duplicate=False))):
        for name, _ in named:
            rank.setdefault(name, (kind, len(rank)))
    attrs = [n for n in gm.graph.nodes if n.op == "get_attr"]
    order = sorted(range(len(attrs)), key=lambda k: (*rank.get(str(attrs[k].target), (2, k)), k))
    anchor = next(n for n in gm.graph.nodes if n.op != "placeholder")
    for k in order:
        node = attrs[k]
        if node is not anchor:
            anchor.prepend(node)
        else:
            anchor = node.next


def _renumber(gm: torch.fx.GraphModule) -> None:
    """Name every op from its target and position (``linear``, ``linear_1``, ...): the same names whether layers
    were traced or copied, and whatever nodes export created and dropped on the way."""
    old = gm.graph
    new = torch.fx.Graph(owning_module=gm, tracer_cls=old._tracer_cls, tracer_extras=old._tracer_extras)
    new._codegen = old._codegen
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in old.nodes:
        keep = n.op in ("placeholder", "output")
        name = n.name if keep else str(n.target).replace(".", "_") if n.op == "get_attr" else _op_name(n)
        copy = new.create_node(n.op, n.target, torch.fx.map_arg(n.args, env.__getitem__),
                               torch.fx.map_arg(n.kwargs, env.__getitem__), name=name,
                               type_expr=n.type)
        copy.meta = n.meta
        env[n] = copy
    gm.graph = new


def _op_name(n: torch.fx.Node) -> str | None:
    """The base name torch.export gives an op's node: ``linear`` for ``aten.linear.default``."""
    if isinstance(n.target, torch._ops.OpOverload):
        return n.target._opname.strip("_") or None
    return getattr(n.target, "__name__", None)


def _annotate_params(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    groups: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        groups.setdefault(id(t), []).append(name)
    by_name = {n: names for names in groups.values() for n in names}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            aliases = tuple(by_name.get(str(node.target), [str(node.target)]))
            if aliases[0] != node.target:  # a tied weight: the graph names it as model.named_parameters() does
                _move_attr(gm, str(node.target), aliases[0])
                node.target = aliases[0]
            node.meta[M.PARAM] = str(node.target)
            node.meta[M.ALIASES] = aliases


def _move_attr(gm: torch.fx.GraphModule, old: str, new: str) -> None:
    """Re-register the tensor at attribute path ``old`` of ``gm`` under ``new`` (torch.export keeps one name of a
    tied weight, not necessarily the first)."""
    from torch.fx.graph_module import _assign_attr

    t = fetch_attr(gm, old)
    *owner_path, leaf = old.split(".")
    owner = gm.get_submodule(".".join(owner_path)) if owner_path else gm
    for table in (owner._parameters, owner._buffers):
        table.pop(leaf, None)
    owner.__dict__.pop(leaf, None)
    _assign_attr(t, gm, new)
