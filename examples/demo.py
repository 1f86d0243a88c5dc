"""The main demo: a GPT on a data=2 x model=2 mesh, planned once (autoshard.plan), run on all 4 ranks.

    python examples/demo.py            # simulator: every rank in this process
    python examples/demo.py --gloo     # 4 real processes with gloo on 127.0.0.1

Prints the annotated plan (placement of every tensor per mesh axis, inserted collectives), rank 1's generated
code, and the sharded loss next to the single-device loss, with the largest gradient difference.
"""

from __future__ import annotations

import argparse
import os
import sys


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autoshard  # noqa: E402
from autoshard.compiler.plan import loss_of  # noqa: E402
from examples import models  # noqa: E402


def build():
    model, args, kwargs = models.gpt(batch=8, seq=16, layers=2)
    mesh = autoshard.Mesh(data=2, model=2)
    return model, args, kwargs, autoshard.plan(model, mesh, args, kwargs, annotations=models.megatron(mesh, "gpt"))


def _gloo_rank(rank, world_size):
    from autoshard.runtime import DistCommunicator, use

    model, args, kwargs, plan = build()  # every rank plans: rank 0's decisions are replayed where a search runs
    comm = DistCommunicator(plan.mesh)
    sharded = autoshard.apply(model, plan, comm=comm)  # this rank's module: DTensor parameters, bucketed DP sync
    a, k = plan.shard_inputs(rank, args, kwargs)
    with use(comm):
        loss = loss_of(sharded(*a, **k))
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}  # DTensor gradients, gathered
    return loss.detach(), grads


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gloo", action="store_true", help="run on 4 real gloo processes instead of the simulator")
    opts = parser.parse_args(argv)

    model, args, kwargs, plan = build()
    mesh = plan.mesh
    plan.show()
    body = [ln for ln in plan.code(rank=1).splitlines() if "getattr(" not in ln and " = self." not in ln]
    print("\n# generated code of rank 1 (parameter loads left out; first 40 lines)")
    print("\n".join(body[:40]) + "\n    ...\n")

    if opts.gloo:
        from autoshard.runtime import spawn

        results = spawn(_gloo_rank, mesh.size, timeout=300)
        losses = [r[0] for r in results]
        grads = results[1][1]  # every rank gathered the same whole gradients
    else:
        sim = plan.simulate(args, kwargs)
        losses = [loss_of(o).detach() for o in sim.outputs]
        grads = sim.grads

    ref = loss_of(model(*args, **kwargs))
    ref.backward()
    ref_grads = dict(model.named_parameters(remove_duplicate=False))
    worst = max((g - ref_grads[n].grad).abs().max().item() for n, g in grads.items())
    where = "4 gloo processes" if opts.gloo else "the simulator (4 ranks)"
    print(f"sharded loss on {where}: {[round(x.item(), 6) for x in losses]}")
    print(f"single-device loss:             {ref.item():.6f}")
    print(f"largest gradient difference over {len(grads)} parameters: {worst:.2e}")
    ok = all(abs(x.item() - ref.item()) <= 1e-4 * abs(ref.item()) for x in losses) and worst < 1e-4
    print("MATCH" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
