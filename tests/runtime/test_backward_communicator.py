"""Which communicator a backward pass finds (autoshard/runtime/communicator.py), the same on simulated and real ranks:
none after the call that ran the forward has returned, unless the backward's own code makes one current — an op's
kept communicator, a recomputed region's, or the one a ShardedModule call's outputs carry (``backward_uses``)."""

from __future__ import annotations

import pytest
import torch

from autoshard import Mesh
from autoshard.errors import AutoshardError
from autoshard.runtime import SimWorld, current, use
from autoshard.runtime.communicator import backward_uses, in_backward


class _LooksUpInBackward(torch.autograd.Function):
    """Identity whose backward all-reduces over `x` with the communicator current in backward (as a compiled
    backward's collectives, or a recomputed forward's, look it up)."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        assert in_backward()
        return current().all_reduce(grad, "x", phase="backward")


def _step(rank, carry: bool):
    comm = current()
    w = torch.ones(3, requires_grad=True)
    with use(comm):  # the call
        out = _LooksUpInBackward.apply(w * (rank + 1))
        if carry:
            out = backward_uses(out, comm)
    out.sum().backward()  # after the call, as in a script
    return w.grad


def test_a_backward_after_the_call_finds_the_communicator_its_outputs_carry():
    grads = SimWorld(Mesh(x=2), timeout=30).run(lambda r: _step(r, carry=True))
    for rank, g in enumerate(grads):
        torch.testing.assert_close(g, torch.full((3,), 2.0 * (rank + 1)))  # all-reduced ones, times the rank's scale


def test_a_backward_after_the_call_finds_no_communicator_in_the_simulator_as_on_a_real_rank():
    with pytest.raises(AutoshardError, match="no communicator is active in this backward pass"):
        SimWorld(Mesh(x=2), timeout=30).run(lambda r: _step(r, carry=False))


def test_backward_uses_leaves_the_outputs_as_they_are():
    comm = SimWorld(Mesh(x=1)).communicator(0)
    x = torch.ones(2, requires_grad=True) * 2
    out = backward_uses({"loss": x, "n": 3}, comm)
    assert out["loss"] is x and out["n"] == 3
    x.mul_(2)  # the user's in-place habits still work: no view was made
