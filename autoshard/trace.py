"""Frontend: capture an ``nn.Module`` as an aten-level FX graph with static shapes.

``torch.export.export(strict=False)`` gives the training IR (high-level aten ops such as ``aten.linear``,
``aten.layer_norm``, ``aten.scaled_dot_product_attention``), a ``"val"`` FakeTensor on every node, and the
module path of every op in ``nn_module_stack``. We keep the *unlifted* form (``ExportedProgram.module()``):
parameters and buffers appear as ``get_attr`` nodes whose targets are their original fully-qualified names
(``transformer.h.0.mlp.c_fc.weight``), which is what user annotations and per-rank weight copies key on.
The pytree calling convention of the exported module (``_in_spec``/``_out_spec``) is kept, so per-rank modules
are called exactly like the original model (same args, kwargs, and output structure).

Removed after export: the input guard module (it checks *global* shapes, but ranks see local ones) and
``aten._assert_tensor_metadata`` nodes (dtype asserts without effect on values).
"""

from __future__ import annotations

import torch
import torch.fx

from autoshard import meta as M
from autoshard.errors import TraceError

_DROP_TARGETS = {torch.ops.aten._assert_tensor_metadata.default}


def trace(model: torch.nn.Module, args: tuple = (), kwargs: dict | None = None) -> torch.fx.GraphModule:
    """Export ``model(*args, **kwargs)`` to a GraphModule with static shapes, FQN-named get_attrs and module paths."""
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"model has type {type(model).__name__}, but autoshard traces torch.nn.Module instances.")
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    kwargs = dict(kwargs or {})
    name = type(model).__name__
    try:
        ep = torch.export.export(model, args, kwargs, strict=False)
    except Exception as e:  # export raises many types; all mean the same thing to the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TraceError(
            f"model {name} could not be traced by torch.export (strict=False): {type(e).__name__}: {first}. "
            "autoshard needs a graph with static shapes: remove data-dependent Python control flow (branches on "
            "tensor values, .item()), pass every input as a tensor argument, and for Hugging Face models set "
            "use_cache=False. See torch.export's error above for the exact line."
        ) from e
    gm = ep.module()
    _clean(gm)
    _annotate_params(gm, model)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "call_function") and "val" not in node.meta:
            if node.op == "get_attr":
                node.meta["val"] = _fetch(gm, node.target)
    gm.recompile()
    return gm


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


def _annotate_params(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    groups: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        groups.setdefault(id(t), []).append(name)
    by_name = {n: names for names in groups.values() for n in names}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            node.meta[M.PARAM] = str(node.target)
            node.meta[M.ALIASES] = tuple(by_name.get(str(node.target), [str(node.target)]))


def _fetch(gm: torch.nn.Module, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def fetch_attr(gm: torch.nn.Module, target: str):
    """The parameter/buffer/constant at a get_attr target."""
    return _fetch(gm, target)
