"""Run a region of a rank program so that backward recomputes it instead of keeping its activations.

Rank programs call :func:`checkpoint` on a child module made by the ``recompute`` pass
(``passes/recompute.py``): ``torch.utils.checkpoint.checkpoint(region, *inputs, use_reentrant=False)`` keeps the
region's inputs and runs it again when backward first needs one of its saved tensors. Two settings matter here:

- the recomputation runs inside backward, after the module's call has returned: :func:`_same_random_calls` makes
  the forward's communicator current for it (a real rank has none active there; the simulator's rank threads are
  as strict, :func:`autoshard.runtime.communicator.rank_thread`).
- ``early_stop=False``: the recomputation runs the whole region, so every collective in it runs again on every rank,
  in program order; with early stop a rank would stop after the last tensor *its* backward needs.
- autoshard's dropout (``torch.ops.autoshard.dropout``) seeds its mask from the communicator's count of random calls,
  not from torch's RNG state (which ``preserve_rng_state`` restores): :func:`_same_random_calls` sets the count back
  to its value at the region's forward for the recomputation, so every mask is drawn again identical, and restores it
  after.

Under ``torch.compile`` the compiled backward does the recomputation and ``context_fn`` must be a selective
checkpoint policy: :func:`_keep_random_outputs` keeps dropout's outputs (its mask) and recomputes the rest, so the
compiled program's gradients equal eager's.

Without autograd (``torch.no_grad()``, inference) the region is simply called.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.utils.checkpoint

from autoshard.errors import AutoshardError
from autoshard.runtime import ops as _ops  # noqa: F401  (registers torch.ops.autoshard.dropout)
from autoshard.runtime.communicator import current, use

__all__ = ["checkpoint"]


def checkpoint(region, *inputs):
    """``region(*inputs)``, its activations recomputed in backward instead of saved."""
    if not torch.is_grad_enabled():
        return region(*inputs)
    if torch.compiler.is_compiling():  # the compiled backward recomputes; dropout's outputs are kept (module doc)
        return torch.utils.checkpoint.checkpoint(region, *inputs, use_reentrant=False, preserve_rng_state=True,
                                                 context_fn=_keep_random_outputs)
    return torch.utils.checkpoint.checkpoint(region, *inputs, use_reentrant=False, preserve_rng_state=True,
                                             early_stop=False, context_fn=_same_random_calls)


def _same_random_calls():
    """(forward context, recomputation context) of one checkpoint call: the recomputation runs under the
    communicator its forward ran under (it runs inside backward, after the module's call has returned, where a real
    rank has no communicator active), and draws dropout masks with the random-call count the forward started from."""
    start: list = []

    @contextmanager
    def forward():
        comm = _communicator()
        start.append((comm, comm.random_calls if comm is not None else 0))
        yield

    @contextmanager
    def recompute():
        comm, calls = start[0]
        if comm is None:
            yield
            return
        after = comm.random_calls
        comm.random_calls = calls
        try:
            with use(comm):
                yield
        finally:
            comm.random_calls = after

    return forward(), recompute()


def _keep_random_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    if op is torch.ops.autoshard.dropout.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _keep_random_outputs():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_keep_random_policy)


def _communicator():
    try:
        return current()
    except AutoshardError:  # no communicator: a region without collectives or dropout run outside a rank
        return None
