"""The trace's side effects: why it did not copy layers is logged (never swallowed), and torch is patched only
while a trace runs (the checkpoint wrappers of :class:`autoshard.frontend.trace._checkpoint_regions` are gone after it,
whether the trace succeeded or failed)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.utils.checkpoint as ckpt
from torch import nn

from autoshard.frontend import layer_reuse
from autoshard.errors import TraceError
from autoshard.frontend.trace import REUSED_LAYERS, trace

ORIGINAL = (ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction)
SEEN: list[bool] = []  # per forward run by a trace: whether torch's checkpoint functions were the originals


class Layers(nn.Module):
    def __init__(self, checkpointed: bool = False, n: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(n))
        self.checkpointed = checkpointed

    def forward(self, x):
        SEEN.append((ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction) == ORIGINAL)
        for layer in self.layers:
            x = ckpt.checkpoint(layer, x, use_reentrant=False) if self.checkpointed else layer(x)
        return x.sum()


def _reasons(caplog) -> list[str]:
    names = ("autoshard.frontend.trace", "autoshard.frontend.layer_reuse")
    return [r.getMessage() for r in caplog.records if r.name in names]


def test_copied_layers_log_nothing(caplog):
    caplog.set_level(logging.INFO, logger="autoshard")
    gm = trace(Layers(), (torch.randn(2, 8),))
    assert gm.meta[REUSED_LAYERS] == {"layers": ["1", "2"]}  # 1 traced, 2 copied (0's input is unlike theirs)
    assert not _reasons(caplog)


@pytest.mark.parametrize(("model", "reason"), [
    (nn.Linear(8, 8), "no repeated layers"),
    (Layers(checkpointed=True), "torch.utils.checkpoint regions"),
])
def test_the_fallback_to_exporting_every_layer_says_why(caplog, model, reason):
    caplog.set_level(logging.INFO, logger="autoshard")
    gm = trace(model, (torch.randn(2, 8),))
    assert REUSED_LAYERS not in gm.meta
    messages = _reasons(caplog)
    assert any("exporting every layer" in m and reason in m for m in messages), messages


def test_a_fault_of_the_copying_is_a_warning_and_the_trace_still_succeeds(caplog, monkeypatch):
    def broken(gm, groups, model):
        raise KeyError("a bug in the copy")

    monkeypatch.setattr(layer_reuse, "expand_layer_calls", broken)
    caplog.set_level(logging.INFO, logger="autoshard")
    gm = trace(Layers(), (torch.randn(2, 8),))
    assert REUSED_LAYERS not in gm.meta
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "autoshard.frontend.trace"]
    assert warnings and "KeyError" in warnings[0].getMessage() and warnings[0].exc_info is not None


def test_torch_is_patched_only_while_tracing():
    SEEN.clear()
    trace(Layers(checkpointed=True), (torch.randn(2, 8),))
    assert SEEN and not any(SEEN)  # inside the trace: the wrappers
    assert (ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction) == ORIGINAL

    class Fails(nn.Module):
        def forward(self, x):
            assert (ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction) != ORIGINAL
            return x[x > 0].sum() if x.sum() > 0 else x.sum()  # data-dependent: export fails

    with pytest.raises(TraceError):
        trace(Fails(), (torch.randn(2, 8),))
    assert (ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction) == ORIGINAL
