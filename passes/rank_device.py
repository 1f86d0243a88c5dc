"""Rank programs name no device: factories and device moves follow the device of the rank's own tensors.

``torch.export`` writes the device the model was traced on into every factory (``arange(16, device=cpu)``) and
every ``.to(...)``; a plan traced on CPU or on the meta device would then allocate there on a GPU rank. This pass
reads the device once from the program's first parameter (or, with none, its first tensor input) —
``rank_device = weight.device`` — and passes that node wherever the trace wrote a device. Programs then run
on whatever device their weights are on (``torch.compile`` reads the attribute as a constant of the guarded
inputs). A program with no tensor to read it from drops the device argument (the default device).

A trace cannot tell a device the model names on purpose (``x.to("cpu")`` to offload) from the device it happened
to be traced on, so every device the trace wrote follows the rank's: a model that moves tensors between devices
inside ``forward`` runs them all on the rank's device (README, "A model that never exists whole on a rank").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from autoshard import meta as M
from autoshard.compiler.context import Context


@dataclass(frozen=True)
class FollowRankDevice:
    name: str = "follow_rank_device"
    phase: str = "rank"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        graph = gm.graph
        users = [n for n in graph.nodes if n.op == "call_function" and _device_positions(n)]
        if not users:
            return gm
        ref = _reference(gm)
        device = None
        if ref is not None:
            # placeholders stay first: the read goes after the last of them (a parameter's, after its get_attr)
            after = [n for n in graph.nodes if n.op == "placeholder"][-1] if ref.op == "placeholder" else ref
            with graph.inserting_after(after):
                device = graph.create_node("call_function", getattr, (ref, "device"), name="rank_device")
        for node in users:
            kwargs, args = dict(node.kwargs), list(node.args)
            for where, key in _device_positions(node):
                if where == "kwarg":
                    if device is None:
                        kwargs.pop(key)
                    else:
                        kwargs[key] = device
                else:
                    args[key] = device
            node.args, node.kwargs = tuple(args), kwargs
        gm.recompile()
        return gm


def _device_positions(node: torch.fx.Node) -> list[tuple[str, object]]:
    """Where ``node`` names a concrete device: ``("kwarg", name)`` or ``("arg", index)``."""
    out = [("kwarg", k) for k, v in node.kwargs.items() if k == "device" and isinstance(v, torch.device)]
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        for i, (a, v) in enumerate(zip(schema.arguments, node.args)):
            if a.name == "device" and isinstance(v, torch.device):
                out.append(("arg", i))
    return out


def _reference(gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    for n in gm.graph.nodes:
        if n.op == "get_attr" and isinstance(_attr(gm, n.target), torch.Tensor):
            return n
    for n in gm.graph.nodes:
        if n.op == "placeholder" and M.SPEC in n.meta:
            return n
    return None


def _attr(gm: torch.fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj
