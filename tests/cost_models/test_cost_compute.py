"""FLOPs, bytes and roofline time of aten ops, read from a graph traced with torch.export."""

from __future__ import annotations

import pytest
import sympy
import torch
import torch.nn.functional as F
from autoshard.cost_models.compute import (
    backward_bytes_accessed,
    backward_flops,
    bytes_accessed,
    compute_time,
    flops,
    flops_expr,
)
from autoshard.cost_models.profile import HardwareProfile, LinkCost
from torch import nn

from autoshard.errors import PlanError
from autoshard.compiler.ops import entry

aten = torch.ops.aten
B, S, H, N = 4, 8, 64, 32  # linear: [B, S, H] -> [B, S, N]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, H)
        self.ln = nn.LayerNorm(H)
        self.proj = nn.Linear(H, N)
        self.head = nn.Linear(N, 10, bias=False)

    def forward(self, idx, a, b2, q, k, v, tgt):
        x = self.ln(self.emb(idx))
        y = F.gelu(self.proj(x))
        scores = torch.bmm(a, b2).softmax(-1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        logits = self.head(y).view(-1, 10)
        return F.cross_entropy(logits, tgt) + scores.sum() + att.sin().mean()


@pytest.fixture(scope="module")
def graph():
    args = (torch.randint(0, 100, (B, S)), torch.randn(3, 5, 7), torch.randn(3, 7, 6),
            torch.randn(2, 4, 16, 8), torch.randn(2, 4, 12, 8), torch.randn(2, 4, 12, 8),
            torch.randint(0, 10, (B * S,)))
    return torch.export.export(Net(), args, strict=False).module().graph


def node(graph, op, index=0):
    found = [nd for nd in graph.nodes if nd.op == "call_function"
             and getattr(nd.target, "overloadpacket", nd.target) is op]
    return found[index]


def test_linear(graph):
    lin = node(graph, aten.linear)
    assert flops(lin) == 2 * B * S * N * H + B * S * N  # matmul + bias
    assert backward_flops(lin) == 2 * flops(lin)
    assert flops(node(graph, aten.linear, 1)) == 2 * B * S * 10 * N  # no bias


def test_bmm(graph):
    bmm = node(graph, aten.bmm)
    assert flops(bmm) == 2 * 3 * 5 * 6 * 7
    assert backward_flops(bmm) == 2 * flops(bmm)
    assert bytes_accessed(bmm) == 4 * (3 * 5 * 7 + 3 * 7 * 6 + 3 * 5 * 6)


def test_sdpa(graph):
    sdpa = node(graph, aten.scaled_dot_product_attention)
    b, h, s_q, s_kv, d = 2, 4, 16, 12, 8
    assert flops(sdpa) == 4 * b * h * s_q * s_kv * d
    assert backward_flops(sdpa) == 2.5 * flops(sdpa)


def test_norms_softmax_and_losses(graph):
    assert flops(node(graph, aten.layer_norm)) == 8 * B * S * H
    assert flops(node(graph, aten.softmax)) == 5 * 3 * 5 * 6
    assert flops(node(graph, aten.cross_entropy_loss)) == 5 * B * S * 10 + B * S
    assert flops(node(graph, aten.sum)) == 3 * 5 * 6


def test_elementwise_and_unknown_ops_count_output_elements(graph):
    assert flops(node(graph, aten.gelu)) == B * S * N
    assert backward_flops(node(graph, aten.gelu)) == B * S * N
    assert flops(node(graph, aten.sin)) == 2 * 4 * 16 * 8  # not in the table: numel of the output


def test_embedding_moves_bytes_only(graph):
    emb = node(graph, aten.embedding)
    assert flops(emb) == 0
    assert backward_flops(emb) == B * S * H  # scatter-add of the output gradient
    assert bytes_accessed(emb) == 2 * B * S * H * 4 + B * S * 8  # rows read + output written + int64 indices


def test_views_placeholders_and_integer_outputs_are_free(graph):
    view = node(graph, aten.view)
    assert flops(view) == bytes_accessed(view) == backward_flops(view) == backward_bytes_accessed(view) == 0
    for nd in graph.nodes:
        if nd.op in ("placeholder", "get_attr", "output"):
            assert flops(nd) == bytes_accessed(nd) == backward_flops(nd) == 0


def test_bytes_accessed_reads_inputs_and_writes_output(graph):
    lin = node(graph, aten.linear)
    assert bytes_accessed(lin) == 4 * (B * S * H + N * H + N + B * S * N)
    assert backward_bytes_accessed(lin) == 2 * bytes_accessed(lin)


def _profile(peak, bw):
    return HardwareProfile("t", peak_flops=peak, mem_bandwidth=bw, memory_bytes=1 << 30, overlap_comm=False,
                           link=LinkCost(0, 1e-9))


def test_compute_time_is_a_roofline_split_by_the_shard_factor(graph):
    lin = node(graph, aten.linear)
    f, by = flops(lin), bytes_accessed(lin)
    compute_bound = _profile(1e9, 1e15)
    memory_bound = _profile(1e15, 1e9)
    assert compute_time(lin, compute_bound) == pytest.approx(f / 1e9)
    assert compute_time(lin, memory_bound) == pytest.approx(by / 1e9)
    assert compute_time(lin, compute_bound, shard_factor=4) == pytest.approx(f / 1e9 / 4)
    assert compute_time(lin, compute_bound, backward=True) == pytest.approx(2 * f / 1e9)
    with pytest.raises(PlanError, match="shard_factor=0"):
        compute_time(lin, compute_bound, shard_factor=0)


def test_flops_expr_prints_shape_formulas(graph):
    lin = node(graph, aten.linear)
    expr = flops_expr(lin, names={B: "b", S: "s", H: "h", N: "n"})
    b, s, h, n = (sympy.Symbol(x, positive=True, integer=True) for x in "bshn")
    assert sympy.expand(expr - (2 * b * s * h * n + b * s * n)) == 0
    assert str(flops_expr(node(graph, aten.bmm))) == "2*d3*d5*d6*d7"
    for nd in graph.nodes:
        e = flops_expr(nd)
        assert e.subs({sym: int(sym.name[1:]) for sym in e.free_symbols}) == flops(nd), nd.name


def test_einsum_and_matmul_on_a_small_graph():
    class M(nn.Module):
        def forward(self, x, y, z):
            return (torch.einsum("bsh,bth->bst", x, y).sum() + (x @ z).sum()
                    + torch.einsum("...ij,jk->...ik", x, z).sum())

    gm = torch.export.export(M(), (torch.randn(2, 3, 5), torch.randn(2, 7, 5), torch.randn(5, 4)),
                             strict=False).module()
    einsums = [nd for nd in gm.graph.nodes if getattr(nd.target, "overloadpacket", None) is aten.einsum]
    assert flops(einsums[0]) == 2 * 2 * 3 * 7 * 5
    assert flops(einsums[1]) == 2 * 2 * 3 * 5 * 4
    matmuls = [nd for nd in gm.graph.nodes if getattr(nd.target, "overloadpacket", None) is aten.matmul]
    assert flops(matmuls[0]) == 2 * 2 * 3 * 4 * 5


def test_missing_shapes_name_the_node():
    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    mm = g.call_function(aten.mm.default, (a, b))
    with pytest.raises(PlanError, match=r"node `mm_default` \(aten.mm.default\) has argument 0 \(`a`\) without "
                                        r"a tensor in meta\['val'\]"):
        flops(mm)


def test_compute_time_adds_the_per_op_overhead_and_reads_the_efficiency_at_the_ranks_share(graph):
    import dataclasses

    lin = node(graph, aten.linear)
    f, by = flops(lin), bytes_accessed(lin)
    table = ((f / 4, 0.25), (f, 0.5))  # the whole op at half the peak, a quarter of it at a quarter
    p = dataclasses.replace(_profile(1e9, 1e15), op_overhead=3e-6, backward_op_overhead=7e-6,
                            efficiency={"matmul": table})
    assert compute_time(lin, p) == pytest.approx(3e-6 + f / (1e9 * 0.5))
    assert compute_time(lin, p, shard_factor=4) == pytest.approx(3e-6 + f / 4 / (1e9 * 0.25))
    # between two points: linear in log(work)
    mid = 0.25 + 0.5 * (0.5 - 0.25)
    assert compute_time(lin, p, shard_factor=2) == pytest.approx(3e-6 + f / 2 / (1e9 * mid))
    assert compute_time(lin, p, backward=True) == pytest.approx(7e-6 + 2 * f / (1e9 * 0.5))
    # an elementwise op is memory-bound: the matmul table does not apply to it, the memory table does
    p2 = dataclasses.replace(_profile(1e15, 1e9), efficiency={"matmul": table, "memory": ((1.0, 0.1),)})
    add = next(n for n in graph.nodes if n.op == "call_function" and entry(n.target).compute_kind == "memory"
               and bytes_accessed(n) > 0)
    assert compute_time(add, p2) == pytest.approx(bytes_accessed(add) / (1e9 * 0.1))
    assert compute_time(lin, p2) == pytest.approx(max(f / (1e15 * 0.5), by / (1e9 * 0.1)))
    # views run (the overhead) but move nothing
    view = next(n for n in graph.nodes if n.op == "call_function" and bytes_accessed(n) == 0 and flops(n) == 0)
    assert compute_time(view, p) == pytest.approx(3e-6)
