"""Save on one mesh, resume on another: a GPT trained 5 Adam steps on data=2 x model=2, saved, loaded into
model=4 (and into the plain nn.Module), trained 5 more; the losses match an uninterrupted 10-step run.

    python examples/checkpoint_reshard.py            # every rank simulated in this process (threads)
    python examples/checkpoint_reshard.py --gloo     # 4 real gloo processes on 127.0.0.1

Exits non-zero if any resumed loss differs from the uninterrupted one by more than 1e-5.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autoshard
from examples import models

LR = 3e-3


def batches(n: int):
    g = torch.Generator().manual_seed(1234)
    for _ in range(n):
        ids = torch.randint(0, 128, (8, 16), generator=g)
        yield ids, (ids + 1) % 128


def train(module, mesh, rank: int, data, opt=None):
    """Adam steps of a ShardedModule (``mesh`` given) or of a plain module (``mesh`` None); returns losses, opt."""
    losses = []
    for ids, labels in data:
        if mesh is not None:
            ids, labels = autoshard.data_shard(ids, mesh, rank), autoshard.data_shard(labels, mesh, rank)
        loss = module(ids, labels)
        opt = opt or torch.optim.Adam(module.parameters(), lr=LR)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, opt


def first_run(rank: int, path: str, model, comm=None):
    """The uninterrupted 10 steps, then 5 steps and a save, both on data=2 x model=2."""
    data, mesh = list(batches(10)), autoshard.Mesh(data=2, model=2)
    plan = models.megatron(mesh, "gpt")
    ref, _ = train(autoshard.compile(copy.deepcopy(model), mesh, annotations=plan, comm=comm), mesh, rank, data)
    first = autoshard.compile(copy.deepcopy(model), mesh, annotations=plan, comm=comm)
    before, opt = train(first, mesh, rank, data[:5])
    autoshard.save(first, path, optimizer=opt)
    return ref, before


def second_run(rank: int, path: str, model, comm=None):
    """Load into model=4 (other initial weights: everything comes from the checkpoint) and train 5 more steps."""
    data, mesh = list(batches(10)), autoshard.Mesh(model=4)
    second = autoshard.compile(model, mesh, example_inputs=data[0], annotations=models.megatron(mesh, "gpt"), comm=comm)
    autoshard.load(second, path)  # gives `second` its parameters (this rank's shards) ...
    opt = torch.optim.Adam(second.parameters(), lr=LR)
    autoshard.load(second, path, optimizer=opt)  # ... and then the Adam moments, resharded
    return train(second, mesh, rank, data[5:], opt)[0]


def new_models():
    # Built once, outside the rank threads: models.gpt seeds the global RNG, which threads share.
    return models.gpt(batch=8, seq=16, layers=1)[0], models.gpt(batch=8, seq=16, layers=1, seed=7)[0]


def _gloo_rank(rank: int, world_size: int, path: str):
    model, other = new_models()
    ref, before = first_run(rank, path, model)
    return ref, before + second_run(rank, path, other)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gloo", action="store_true", help="4 real gloo processes instead of the simulator")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "step5")
        if args.gloo:
            from autoshard.runtime import spawn

            ref, resumed = spawn(_gloo_rank, 4, path, timeout=300)[0]
        else:
            from autoshard.runtime import SimWorld

            model, other = new_models()
            world = SimWorld(autoshard.Mesh(data=2, model=2), timeout=120)
            ref, before = world.run(lambda r: first_run(r, path, model, world.communicator(r)))[0]
            world4 = SimWorld(autoshard.Mesh(model=4), timeout=120)  # one world per mesh
            after = world4.run(lambda r: second_run(r, path, copy.deepcopy(other), world4.communicator(r)))[0]
            resumed = before + after
        # the same checkpoint, back in plain PyTorch in this process
        plain = models.gpt(batch=8, seq=16, layers=1, seed=7)[0]
        opt = torch.optim.Adam(plain.parameters(), lr=LR)
        autoshard.load(plain, path, optimizer=opt)
        single, _ = train(plain, None, 0, list(batches(10))[5:], opt)
    print("step  uninterrupted (data=2 x model=2)  resumed on model=4  resumed in one process")
    for step, (a, b) in enumerate(zip(ref, resumed)):
        c = f"{single[step - 5]:.6f}" if step >= 5 else "-"
        print(f"{step:4d}  {a:32.6f}  {b:18.6f}  {c:>21}")
    worst = max(max(abs(a - b) for a, b in zip(ref, resumed)), max(abs(a - b) for a, b in zip(ref[5:], single)))
    print(f"max |resumed - uninterrupted|: {worst:.2e}")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
