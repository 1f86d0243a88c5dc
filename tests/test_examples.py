"""The examples run and say what they promise: the demo matches one device; training under torchrun matches."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_demo_in_the_simulator_matches_single_device(capsys):
    from examples import demo

    assert demo.main([]) == 0
    out = capsys.readouterr().out
    assert "MATCH" in out and "generated code of rank 1" in out


@pytest.mark.gloo
def test_train_gpt_under_torchrun_matches_one_process():
    # torchrun as a module of this interpreter: the `torchrun` on PATH may belong to another Python (a venv's tests
    # would then launch ranks that import another checkout)
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    # --standalone: torchrun's agent binds its rendezvous store to a port it picks itself (no port chosen here and
    # bound later, which another process could take in between)
    cmd += ["--standalone", "--nproc-per-node", "4", str(ROOT / "examples" / "train_gpt.py"), "--steps", "20"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "max |sharded - single| over 20 steps" in proc.stdout
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("step ")]
    assert len(lines) == 20


def test_hf_model_script_simulated_matches_eager(capsys):
    from examples import hf_model

    assert hf_model.main([]) == 0
    out = capsys.readouterr().out
    assert "MATCH" in out and "MISMATCH" not in out and "eager loss" in out
