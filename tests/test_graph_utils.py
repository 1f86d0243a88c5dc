"""``tensor_inputs`` walks a node's arguments itself (it runs for every node in every pass): its order must stay
``pytree.tree_flatten((args, kwargs))``'s, the order sharding rules index."""

from __future__ import annotations

import torch
import torch.fx
from torch.utils import _pytree as pytree

from autoshard.frontend.graph_utils import is_tensor_node, tensor_inputs
from autoshard.frontend.trace import trace
from examples import models


def _reference(node: torch.fx.Node) -> list[torch.fx.Node]:
    leaves, _ = pytree.tree_flatten((node.args, node.kwargs))
    return [x for x in leaves if is_tensor_node(x)]


def test_tensor_inputs_is_pytrees_order_on_real_graphs():
    checked = 0
    for name in ("gpt", "hf_llama", "hf_mixtral"):
        if name not in models.FACTORIES:
            continue
        model, args, kwargs = models.FACTORIES[name](layers=2)
        gm = trace(model, args, kwargs)
        for node in gm.graph.nodes:
            assert tensor_inputs(node) == _reference(node), node.format_node()
            checked += len(node.args) > 1
    assert checked > 50


def test_tensor_inputs_walks_nested_lists_tuples_and_dicts_in_pytree_order():
    graph = torch.fx.Graph()
    a, b, c, d = (graph.placeholder(n) for n in "abcd")
    for x in (a, b, c, d):
        x.meta["val"] = torch.empty(2)
    out = graph.call_function(torch.cat, ([a, (b, 3)],), {"z": {"k2": d, "k1": [c, None]}, "dim": 0})
    assert tensor_inputs(out) == _reference(out) == [a, b, d, c]


def test_the_frontend_verifier_names_the_step_and_the_node():
    """trace, layer reuse and precision tracing end with verify_traced, as each pass ends with the manager's
    verifier: a node without its value, or a get_attr naming no tensor, is caught and blamed on the step."""
    import pytest

    from autoshard.errors import AutoshardError
    from autoshard.frontend.graph_utils import verify_traced
    from autoshard.frontend.trace import trace

    gm = trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.ones(2, 4),))
    assert verify_traced(gm, "trace") is gm
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    del node.meta["val"]
    with pytest.raises(AutoshardError, match=rf"^frontend step 'layer_reuse' left node `{node.name}` .* without "):
        verify_traced(gm, "layer_reuse")
    gm = trace(torch.nn.Linear(4, 4), (torch.ones(2, 4),))
    gm.number = 3
    attr = next(n for n in gm.graph.nodes if n.op == "get_attr")
    attr.target = "number"
    with pytest.raises(AutoshardError, match=r"reading `number`, which is neither a tensor nor a submodule"):
        verify_traced(gm, "precision")
