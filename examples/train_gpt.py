"""Train a GPT on a data=2 x model=2 mesh with torchrun, and check the losses against one process.

    torchrun --nproc-per-node 4 examples/train_gpt.py            # gloo on CPU; NCCL on cuda:LOCAL_RANK with GPUs
    python examples/train_gpt.py --simulate                       # all 4 ranks in this process

Every rank builds the same model (same seed), compiles it lazily (the plan is made on the first call from that
call's static shapes), and feeds its own data shard, as with DDP. Rank 0 also trains an unsharded copy on the
full batch and prints both losses side by side; the script exits non-zero if they differ by more than 1e-4.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autoshard  # noqa: E402
from examples import models  # noqa: E402


def batches(steps: int, batch: int, seq: int, vocab: int):
    g = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        yield ids, (ids + 1) % vocab  # a learnable mapping, so the loss visibly falls


def train(rank: int, mesh: autoshard.Mesh, steps: int, model, comm=None, reference: bool = False,
          lr: float = 3e-3, zero: int = 0, bucket_cap_mb: float | None = None):
    ref = copy.deepcopy(model) if reference else None
    sharded = autoshard.compile(model, mesh, annotations=models.megatron(mesh, "gpt"), comm=comm, zero=zero,
                                bucket_cap_mb=bucket_cap_mb)
    opt = None
    ref_opt = torch.optim.Adam(ref.parameters(), lr=lr) if ref is not None else None
    losses, ref_losses = [], []
    for ids, labels in batches(steps, 8, 16, 128):
        ids_local = autoshard.data_shard(ids, mesh, rank).to(sharded.device)  # the rank's device (cuda:LOCAL_RANK)
        labels_local = autoshard.data_shard(labels, mesh, rank).to(sharded.device)
        loss = sharded(ids_local, labels_local)
        if opt is None:  # parameters exist once the lazy plan has been made by the first call
            opt = torch.optim.Adam(sharded.parameters(), lr=lr)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if ref is not None:
            ref_loss = ref(ids, labels)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            ref_losses.append(ref_loss.item())
    return losses, ref_losses, sharded


def new_model():
    return models.gpt(batch=8, seq=16, layers=2)[0]


def report(losses, ref_losses) -> int:
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        print(f"step {step:2d}  sharded loss {a:.6f}  single-process loss {b:.6f}")
    print(f"max |sharded - single| over {len(losses)} steps: {worst:.2e}")
    return 0 if worst <= 1e-4 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--simulate", action="store_true", help="run all ranks in this process (threads)")
    parser.add_argument("--mesh", default="data=2,model=2", help="mesh axes, e.g. data=2 for two processes")
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage over the data axis")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="data-parallel gradient buckets in MiB (default as DDP's; 0: one blocking all-reduce "
                             "per parameter)")
    args = parser.parse_args()
    mesh = autoshard.Mesh.parse(args.mesh)
    if args.simulate:
        from autoshard.runtime import SimWorld

        world = SimWorld(mesh)
        model = new_model()  # built once: threads share the global RNG, so each would otherwise draw other weights
        results = world.run(lambda r: train(r, mesh, args.steps, copy.deepcopy(model), comm=world.communicator(r),
                                            reference=(r == 0), zero=args.zero,
                                            bucket_cap_mb=args.bucket_cap_mb)[:2])
        if any(results[r][0] != results[0][0] for r in range(mesh.size)):
            print("ranks disagree on the loss")
            return 1
        return report(results[0][0], results[0][1])
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # autoshard.compile's default device too
    dist.init_process_group(backend)
    rank = dist.get_rank()
    try:
        losses, ref_losses, sharded = train(rank, mesh, args.steps, new_model(), reference=(rank == 0), zero=args.zero,
                                             bucket_cap_mb=args.bucket_cap_mb)
        if rank == 0:
            sharded.show()
            return report(losses, ref_losses)
        return 0
    finally:
        autoshard.runtime.shutdown()  # waits for in-flight collectives and destroys every process group


if __name__ == "__main__":
    sys.exit(main())
