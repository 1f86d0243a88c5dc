"""``torch.nn.utils.clip_grad_norm_`` on a ShardedModule's DTensor parameters next to eager, per layout.

For each layout of ``tests/test_ecosystem.py`` (simulated ranks, each with torch's threaded process group), two
AdamW steps clipped at 0.5 with the same data: the total norm every rank's ``clip_grad_norm_`` returned (the
largest relative difference from eager over ranks and steps) and the loss after them. The bf16 layout has no
fp32 eager twin (its programs compute in bf16); its row compares ranks with each other only.

    python bench/grad_norms.py
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))


def main() -> None:
    from tests.test_ecosystem import LAYOUTS, _loop, _ranks

    print(f"{'layout':<8}{'eager norm (step 1)':>20}{'sharded norm':>16}{'max rel diff':>14}{'loss diff':>12}")
    for layout in LAYOUTS:
        model, args, kwargs, world, ranks = _ranks(layout)

        def body(rank, ranks=ranks, args=args, kwargs=kwargs):
            a, k = ranks[rank].plan.shard_inputs(rank, args, kwargs)
            return _loop(ranks[rank], a, k, steps=2)

        got = world.run(body)
        exact = LAYOUTS[layout][4]
        want = _loop(model, args, kwargs, steps=2) if exact else got[0]
        rel = max(abs(g[1] - w[1]) / w[1] for r in got for g, w in zip(r, want))
        loss = max(abs(g[0] - w[0]) for r in got for g, w in zip(r, want))
        label = "" if exact else " (ranks vs rank 0)"
        print(f"{layout:<8}{want[0][1]:>20.7f}{got[0][0][1]:>16.7f}{rel:>14.1e}{loss:>12.1e}{label}")


if __name__ == "__main__":
    main()
