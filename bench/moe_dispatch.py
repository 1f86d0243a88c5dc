"""MoE dispatch+combine: index scatter/gather (autoshard.runtime.moe.routing) vs GShard's dense one-hot einsum.

Both paths start from the same routing and run forward + backward (gradients to the tokens and to the gates, as
in training) with an identity expert in between, so only dispatch and combine are measured. They run side by
side in one process, interleaved, after one warm-up each; each time is the median of the repeats. The memory
columns are the bytes of tensors the warm-up step actually allocated: the index path's ``[E, C, h]`` dispatch
buffer and the dense path's ``[T, E, C]`` one-hot mask (seen by a dispatch mode that watches every aten op).

    python bench/moe_dispatch.py            # T=8192, h=512, top_k=2, capacity_factor=1.25, E in 8/32/128
    python bench/moe_dispatch.py --quick    # a seconds-long smoke run (used by tests/moe/test_routing.py)

The dense path's cost hardly depends on E (E·C ≈ k·T·capacity_factor), so its repeats are capped by
``--budget`` rather than shrinking the sizes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.runtime.moe import routing as M


@dataclass(frozen=True)
class Config:
    tokens: int
    hidden: int
    experts: tuple[int, ...]
    top_k: int
    capacity_factor: float
    repeats: int
    budget_s: float  # wall-clock seconds for the whole run; dense repeats are reduced to fit


FULL = Config(tokens=8192, hidden=512, experts=(8, 32, 128), top_k=2, capacity_factor=1.25, repeats=5, budget_s=100)
QUICK = Config(tokens=256, hidden=32, experts=(4, 16), top_k=2, capacity_factor=1.25, repeats=3, budget_s=10)


class _ShapeBytes(TorchDispatchMode):
    """Bytes of the first tensor of a given shape that any aten op returns (what a path actually allocates)."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.shape, self.nbytes = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if not self.nbytes and isinstance(t, torch.Tensor) and tuple(t.shape) == self.shape:
                self.nbytes = t.numel() * t.element_size()
        return out


def _index_step(x, r, experts, cap, cot):
    buf = M.dispatch(x, r, experts, cap)
    M.combine(buf, r).backward(cot)
    return buf


def _dense_step(x, r, experts, cap, cot):
    buf = M.dispatch_dense_onehot(x, r, experts, cap)
    M.combine_dense_onehot(buf, r, experts, cap).backward(cot)
    return buf


def _timed(step, x, r, gate, *args) -> float:
    x.grad = gate.grad = None
    start = time.perf_counter()
    step(x, r, *args)
    return time.perf_counter() - start


def measure(cfg: Config, experts: int, budget_s: float) -> dict:
    """One table row: both paths on the same routing, interleaved."""
    g = torch.Generator().manual_seed(experts)
    x = torch.randn(cfg.tokens, cfg.hidden, generator=g, requires_grad=True)
    logits = torch.randn(cfg.tokens, experts, generator=g)
    cot = torch.randn(cfg.tokens, cfg.hidden, generator=g)
    cap = M.capacity(cfg.tokens, experts, cfg.top_k, cfg.capacity_factor)
    r = M.route(logits, cfg.top_k, cap)
    gate = r.gate.detach().requires_grad_()  # the router's gradient stops here, as it would at the gates
    r = r._replace(gate=gate)
    args = (experts, cap, cot)

    start = time.perf_counter()
    x.grad = gate.grad = None
    buf = _index_step(x, r, *args)
    index_bytes = buf.numel() * buf.element_size()
    mask_seen = _ShapeBytes((cfg.tokens, experts, cap))
    dense_start = time.perf_counter()
    x.grad = gate.grad = None
    with mask_seen:
        _dense_step(x, r, *args)
    end = time.perf_counter()

    # the dense path dominates: give it the repeats that fit in what is left of this size's budget
    left_s, dense_s = budget_s - (end - start), max(end - dense_start, 1e-9)
    dense_repeats = max(1, min(cfg.repeats, int(left_s / dense_s)))
    index_times, dense_times = [], []
    for i in range(cfg.repeats):
        index_times.append(_timed(_index_step, x, r, gate, *args))
        if i < dense_repeats:
            dense_times.append(_timed(_dense_step, x, r, gate, *args))
    index_s, dense_s = statistics.median(index_times), statistics.median(dense_times)
    return {
        "experts": experts,
        "capacity": cap,
        "index_ms": index_s * 1e3,
        "dense_ms": dense_s * 1e3,
        "ratio": dense_s / index_s,
        "index_repeats": len(index_times),
        "dense_repeats": len(dense_times),
        "index_buffer_bytes": index_bytes,
        "dense_mask_bytes": mask_seen.nbytes,
    }


HEADERS = [
    "E",
    "C",
    "index ms",
    "dense ms",
    "dense/index",
    "index [E,C,h] buf",
    "dense [T,E,C] mask",
    "mask/buf",
]


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def table_cells(rows: list[dict]) -> list[list[str]]:
    return [
        [
            str(row["experts"]),
            str(row["capacity"]),
            f"{row['index_ms']:,.1f} (n={row['index_repeats']})",
            f"{row['dense_ms']:,.1f} (n={row['dense_repeats']})",
            f"{row['ratio']:,.1f}x",
            _mib(row["index_buffer_bytes"]),
            _mib(row["dense_mask_bytes"]),
            f"{row['dense_mask_bytes'] / row['index_buffer_bytes']:,.1f}x",
        ]
        for row in rows
    ]


def title(cfg: Config) -> str:
    return (
        f"MoE dispatch+combine, forward+backward, fp32 CPU ({torch.get_num_threads()} threads): "
        f"T={cfg.tokens}, h={cfg.hidden}, top_k={cfg.top_k}, capacity_factor={cfg.capacity_factor}; "
        "median ms (n repeats)"
    )


def format_table(cfg: Config, rows: list[dict]) -> str:
    """Plain-text table (pure function)."""
    cells = [HEADERS, *table_cells(rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(HEADERS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join([title(cfg), *lines])


def _print(cfg: Config, rows: list[dict]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_table(cfg, rows))
        return
    table = Table()
    for h in HEADERS:
        table.add_column(h, justify="right")
    for cells in table_cells(rows):
        table.add_row(*cells)
    console = Console(width=160)
    console.print(title(cfg), soft_wrap=True)
    console.print(table)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds (smoke test)")
    parser.add_argument("--repeats", type=int, help="timed repeats per path (dense may get fewer, see --budget)")
    parser.add_argument("--budget", type=float, help="seconds for the whole run; caps the dense path's repeats")
    opts = parser.parse_args(argv)
    cfg = QUICK if opts.quick else FULL
    if opts.repeats is not None:
        cfg = Config(**{**cfg.__dict__, "repeats": opts.repeats})
    if opts.budget is not None:
        cfg = Config(**{**cfg.__dict__, "budget_s": opts.budget})
    rows = [measure(cfg, e, cfg.budget_s / len(cfg.experts)) for e in cfg.experts]
    _print(cfg, rows)
    return rows


if __name__ == "__main__":
    main()
