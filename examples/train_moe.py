"""Train a small GPT whose every second FFN is a Mixture-of-Experts layer, experts sharded over 4 gloo processes.

    python examples/train_moe.py                 # 4 gloo processes on 127.0.0.1 (data=4: 2 of 8 experts per rank)
    python examples/train_moe.py --simulate      # the same 4 ranks as threads of this process

The dense GPT (examples.models.GPT, 4 blocks) is compiled with
``moe=autoshard.MoE(layers="blocks.*.mlp", every=2, num_experts=8, top_k=2, capacity_factor=1.25)``: blocks 1 and
3 get 8 experts each, upcycled from their dense FFN with a little noise. Each rank routes its own tokens
(capacity from static shapes), sends them to the experts' ranks with one all-to-all and gets them back with
another. The load-balancing and z losses are attached to the activations, so ``loss.backward()`` trains the router
with them; the script prints the model loss, the aux losses and the fraction of dropped choices per MoE layer.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autoshard
from examples import models

MESH = {"data": 4}
MOE = {"layers": "blocks.*.mlp", "every": 2, "num_experts": 8, "top_k": 2, "capacity_factor": 1.25,
       "aux_loss_weight": 0.01,
           "z_loss_weight": 1e-3, "init": "upcycle", "noise": 0.1, "router_std": 0.1}


def batches(steps: int, batch: int, seq: int, vocab: int):
    g = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        yield ids, (ids * 3 + 1) % vocab  # a learnable mapping, so the loss visibly falls


def train(rank: int, steps: int, comm=None, lr: float = 3e-3):
    torch.manual_seed(0)
    model = models.GPT(vocab=128, hidden=64, heads=4, layers=4, seq=16)
    mesh = autoshard.Mesh(**MESH)
    sharded = autoshard.compile(model, mesh, moe=autoshard.MoE(**MOE), comm=comm)
    opt = None
    rows = []
    for ids, labels in batches(steps, 16, 16, 128):
        loss = sharded(autoshard.data_shard(ids, mesh, rank), autoshard.data_shard(labels, mesh, rank))
        if opt is None:  # parameters exist once the lazy plan has been made by the first call
            opt = torch.optim.Adam(sharded.parameters(), lr=lr)
        loss.backward()  # includes the aux losses' gradients
        opt.step()
        opt.zero_grad(set_to_none=True)
        aux = autoshard.moe_losses(sharded)
        stats = autoshard.moe_stats(sharded)
        rows.append((loss.item(), float(aux["total"]), {k: v["dropped_fraction"] for k, v in stats.items()},
                     {k: v["tokens_per_expert"] for k, v in stats.items()}))
    return rows, (sharded.plan.format().splitlines()[-2:] if rank == 0 else None)


def _worker(rank, world_size, steps):
    from autoshard.runtime import DistCommunicator

    return train(rank, steps, comm=DistCommunicator(autoshard.Mesh(**MESH), timeout=120))


def report(rows, moe_lines) -> int:
    for line in moe_lines or ():
        if line.startswith("MoE"):
            print(line)
    for step, (loss, aux, dropped, _) in enumerate(rows):
        drops = "  ".join(f"{k} dropped {v:5.1%}" for k, v in dropped.items())
        print(f"step {step:2d}  loss {loss:.4f}  aux {aux:.4f}  {drops}")
    last = rows[-1][3]
    for k, v in last.items():
        print(f"{k} tokens per expert at the last step: {v}")
    first, final = rows[0][0], rows[-1][0]
    print(f"loss {first:.4f} -> {final:.4f}")
    return 0 if final < first else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--simulate", action="store_true", help="run the 4 ranks as threads of this process")
    args = parser.parse_args()
    if args.simulate:
        from autoshard.runtime import SimWorld

        world = SimWorld(autoshard.Mesh(**MESH))
        results = world.run(lambda r: train(r, args.steps, comm=world.communicator(r)))
    else:
        from autoshard.runtime import spawn

        results = spawn(_worker, 4, args.steps, timeout=900)
    if any([row[0] for row in results[r][0]] != [row[0] for row in results[0][0]] for r in range(4)):
        print("ranks disagree on the loss")
        return 1
    return report(*results[0])


if __name__ == "__main__":
    sys.exit(main())
