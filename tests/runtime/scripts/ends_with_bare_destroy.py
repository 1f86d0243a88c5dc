"""A training script that ends the way users' scripts do, with a bare ``dist.destroy_process_group()`` (torchrun
runs it; ``tests/runtime/test_shutdown.py`` reads what it prints).

Its own ``atexit`` hook is registered before autoshard's (hooks run last-registered first), so it runs after
autoshard's: it prints how many gloo threads are still alive at that point, where interpreter finalization would
otherwise have met them. ``--raise`` ends the script with an uncaught exception instead, after the last step."""

import atexit
import os
import sys

import torch
import torch.distributed as dist

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def gloo_threads() -> int:
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() in GLOO_THREADS
        except FileNotFoundError:  # a thread that ended while listing
            pass
    return count


def report() -> None:
    print(f"rank {os.environ['RANK']}: {gloo_threads()} gloo threads at exit", flush=True)


atexit.register(report)

import autoshard  # noqa: E402 - after the hook above, so that autoshard's hook runs first


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 64)
        self.down = torch.nn.Linear(64, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).square().mean()


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(8, 16)
    mesh = autoshard.Mesh(data=int(os.environ["WORLD_SIZE"]) // 2, model=2)
    sharded = autoshard.compile(model, mesh)  # lazy: traced at the first call
    sharded(x)  # (so that the traced torch.export imports torch.distributed.nn.functional after the init)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    for _ in range(3):
        loss = sharded(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
    print(f"rank {os.environ['RANK']}: loss {loss.item():.6f}", flush=True)
    if "--raise" in sys.argv:
        raise RuntimeError("the script's own error, after training")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
