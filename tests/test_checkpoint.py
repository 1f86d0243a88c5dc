"""Checkpoints: save on one mesh, load on another (or into plain PyTorch), and nothing changes.

The acceptance run (gloo, 4 processes): train 5 Adam steps on data=2 x model=2, save, load into model=4 and train
5 more; the parent loads the same checkpoint into the original nn.Module and trains 5 more in one process. Both
continuations must match an uninterrupted 10-step run (losses to 1e-5, weights via ``full_state_dict``).
The simulator tests cover the same paths in one process, plus tied weights, Hugging Face round trips and every
CheckpointError.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard.api.checkpoint import MARKER
from autoshard.errors import CheckpointError
from autoshard.runtime import SimWorld, spawn
from examples import models
from examples.checkpoint_reshard import train

LR = 3e-3
BATCH, SEQ, VOCAB = 8, 16, 128


def batches(n: int):
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append((ids, (ids + 1) % VOCAB))
    return out


def new_model(seed: int = 0):
    return models.gpt(batch=BATCH, seq=SEQ, layers=1, seed=seed)[0]


def compile_gpt(model, mesh, comm=None, **kw):
    return autoshard.compile(model, mesh, annotations=models.megatron(mesh, "gpt"), comm=comm, planner="greedy", **kw)


def assert_state_close(got: dict, want: dict, steps: int) -> None:
    """Equal to 1e-5, except the attention key biases: their gradient is zero in exact arithmetic (a bias on k
    adds the same q·b to every score of a row, and softmax ignores that), so what they get is rounding noise, which
    Adam normalises to steps of up to ``lr``: runs that sum in another order (another mesh) drift by up to
    ``2·lr·steps`` there, and only there."""
    assert list(got) == list(want)
    diffs = {k: (got[k] - v).abs().max().item() for k, v in want.items() if v.numel()}
    worst = max((d, k) for k, d in diffs.items() if not k.endswith("attn.k.bias"))
    print(f"state_dict: max |diff| {worst[0]:.2e} ({worst[1]}); attn.k.bias "
          f"{max((d for k, d in diffs.items() if k.endswith('attn.k.bias')), default=0):.2e}")
    for k, v in want.items():
        tol = 2 * LR * steps if k.endswith("attn.k.bias") else 1e-5
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=tol, msg=lambda m, k=k: f"{k}: {m}")


def resume(module, path: str):
    """Load a checkpoint into ``module`` and an Adam over its parameters (which a ShardedModule has once loaded)."""
    autoshard.load(module, path)
    opt = torch.optim.Adam(module.parameters(), lr=0.5)  # a wrong lr: the checkpoint's must win
    autoshard.load(module, path, optimizer=opt)
    assert opt.param_groups[0]["lr"] == LR
    return opt


# ---- real processes ---------------------------------------------------------------------------------------------
def _acceptance_worker(rank: int, world: int, path: str):
    data = batches(10)
    mesh22, mesh4 = autoshard.Mesh(data=2, model=2), autoshard.Mesh(model=4)
    base = new_model()
    uninterrupted = compile_gpt(copy.deepcopy(base), mesh22, timeout=120)
    losses_ref, _ = train(uninterrupted, mesh22, rank, data)
    full_ref = autoshard.full_state_dict(uninterrupted)

    first = compile_gpt(copy.deepcopy(base), mesh22, timeout=120)
    losses_first, opt = train(first, mesh22, rank, data[:5])
    autoshard.save(first, path, optimizer=opt)

    # another mesh, other initial weights: everything must come from the checkpoint
    ids, labels = data[0]
    second = compile_gpt(new_model(seed=99), mesh4, example_inputs=(ids, labels), timeout=120)
    opt4 = resume(second, path)
    losses_second, _ = train(second, mesh4, rank, data[5:], opt4)
    full_second = autoshard.full_state_dict(second)
    keep = rank == 0
    return losses_ref, losses_first + losses_second, full_ref if keep else None, full_second if keep else None


@pytest.mark.gloo
def test_train_save_reshard_resume_equals_uninterrupted_run(tmp_path):
    path = str(tmp_path / "ckpt")
    results = spawn(_acceptance_worker, 4, path, timeout=300, start_method="forkserver")
    losses_ref, losses_resumed, full_ref, full_resumed = results[0]
    for r in range(4):
        assert results[r][0] == losses_ref and results[r][1] == losses_resumed  # every rank saw the same losses
    worst = max(abs(a - b) for a, b in zip(losses_resumed, losses_ref))
    print(f"\nmax |resumed on model=4 - uninterrupted| over 10 steps: {worst:.2e}")
    assert worst <= 1e-5, (losses_resumed, losses_ref)

    # the saved checkpoint: per-rank shards with global metadata, committed
    marker = json.loads(Path(path, MARKER).read_text())
    assert marker["mesh"] == [["data", 2], ["model", 2]]
    assert marker["tensors"]["head.weight"]["aliases"] == ["wte.weight", "head.weight"]
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    assert [list(c.sizes) for c in meta["model.blocks.0.mlp.0.weight"].chunks] == [[128, 64], [128, 64]]
    assert sorted(list(c.offsets) for c in meta["optim.blocks.0.mlp.0.weight.exp_avg"].chunks) == [[0, 0], [128, 0]]
    assert [list(c.sizes) for c in meta["model.ln_f.weight"].chunks] == [[64]]  # replicated: saved once
    assert list(meta["model.head.weight"].size) == [128, 64]

    # full_state_dict: the original model's keys and shapes, equal to the uninterrupted run's
    model = new_model(seed=99)
    assert list(full_resumed) == list(model.state_dict()) == list(full_ref)
    for k, v in model.state_dict().items():
        assert full_resumed[k].shape == v.shape
    assert_state_close(full_resumed, full_ref, steps=10)

    # into one process: back to the plain nn.Module and torch.optim.Adam
    opt = resume(model, path)
    losses_plain, _ = train(model, None, 0, batches(10)[5:], opt)
    worst_plain = max(abs(a - b) for a, b in zip(losses_plain, losses_ref[5:]))
    print(f"max |resumed in one process - uninterrupted| over steps 6-10: {worst_plain:.2e}")
    assert worst_plain <= 1e-5, (losses_plain, losses_ref[5:])
    assert_state_close(model.state_dict(), full_ref, steps=10)


# ---- the simulator and one process ------------------------------------------------------------------------------
def _sim(mesh, fn):
    world = SimWorld(mesh, timeout=60)
    return world.run(lambda r: fn(r, world.communicator(r)))


def test_simulated_save_and_loads_into_another_mesh_and_plain_pytorch(tmp_path):
    data = batches(4)
    path = str(tmp_path / "ckpt")
    base = new_model()
    mesh22, mesh4 = autoshard.Mesh(data=2, model=2), autoshard.Mesh(model=4)

    def first(rank, comm):
        sharded = compile_gpt(copy.deepcopy(base), mesh22, comm=comm)
        losses, opt = train(sharded, mesh22, rank, data[:2])
        autoshard.save(sharded, path, optimizer=opt)
        return losses, autoshard.full_state_dict(sharded)

    (losses, full), *_ = _sim(mesh22, first)
    ref = copy.deepcopy(base)
    ref_losses, ref_opt = train(ref, None, 0, data)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses[:2])) < 1e-5
    assert os.listdir(tmp_path) == ["ckpt"]  # no temporary directory left behind

    def second(rank, comm):
        sharded = compile_gpt(new_model(seed=5), mesh4, example_inputs=data[0], comm=comm)
        opt = resume(sharded, path)
        return train(sharded, mesh4, rank, data[2:], opt)[0], autoshard.full_state_dict(sharded)

    out = _sim(mesh4, second)
    assert all(o[0] == out[0][0] for o in out)
    assert max(abs(a - b) for a, b in zip(out[0][0], ref_losses[2:])) < 1e-5
    assert_state_close(out[0][1], ref.state_dict(), steps=4)

    plain = new_model(seed=5)
    opt = resume(plain, path)
    for k, v in full.items():
        torch.testing.assert_close(plain.state_dict()[k], v, rtol=0, atol=0)
    assert plain.head.weight is plain.wte.weight  # tied weights stay tied
    assert max(abs(a - b) for a, b in zip(train(plain, None, 0, data[2:], opt)[0], ref_losses[2:])) < 1e-5

    # and a plain model's checkpoint loads into the sharded plan (its canonical names differ: aliases resolve)
    plain_path = str(tmp_path / "plain")
    autoshard.save(ref, plain_path, optimizer=ref_opt)
    got = _sim(mesh22, lambda r, c: autoshard.full_state_dict(_loaded(mesh22, c, plain_path)))
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[3][k], v, rtol=0, atol=0)


def _loaded(mesh, comm, path):
    sharded = compile_gpt(new_model(seed=3), mesh, example_inputs=batches(1)[0], comm=comm)
    resume(sharded, path)
    return sharded


def test_full_state_dict_of_hf_gpt2_goes_back_to_save_pretrained(tmp_path):
    from transformers import GPT2LMHeadModel

    model, args, kwargs = models.hf_gpt2(layers=1)
    mesh = autoshard.Mesh(data=2, model=2)
    ann = models.megatron(mesh, "hf_gpt2")

    def body(rank, comm):
        sharded = autoshard.compile(copy.deepcopy(model), mesh, args, kwargs, annotations=ann, comm=comm,
                                    planner="greedy")
        a, k = sharded.plan.shard_inputs(rank, args, kwargs)
        out = sharded(*a, **k)
        opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
        (out.loss if hasattr(out, "loss") else out[0]).backward()
        opt.step()
        return autoshard.full_state_dict(sharded)

    full = _sim(mesh, body)[0]
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(*args, **kwargs).loss.backward()
    opt.step()
    assert list(full) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    fresh = GPT2LMHeadModel(model.config)
    fresh.load_state_dict(full, strict=True)
    fresh.save_pretrained(tmp_path / "hf")
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    for k, v in back.state_dict().items():
        torch.testing.assert_close(v, full[k], rtol=0, atol=0)


# ---- errors -----------------------------------------------------------------------------------------------------
def test_load_refuses_missing_partial_and_mismatched_checkpoints(tmp_path):
    model = models.mlp()[0]
    with pytest.raises(CheckpointError, match=r"checkpoint path '.*nowhere' has no checkpoint directory, but load "
                                              r"needs one written by autoshard.save\.$"):
        autoshard.load(model, str(tmp_path / "nowhere"))
    path = str(tmp_path / "ck")
    autoshard.save(model, path)
    # a save that died before its commit leaves a .tmp- directory without marker: never a checkpoint
    os.rename(path, path + ".tmp-dead")
    os.remove(os.path.join(path + ".tmp-dead", MARKER))
    with pytest.raises(CheckpointError, match=r"has no checkpoint directory.*A save there was interrupted before "
                                              r"its commit: \['ck.tmp-dead'\] hold\(s\) partial data"):
        autoshard.load(model, path)
    with pytest.raises(CheckpointError, match=r"has no commit marker autoshard.json, but every complete autoshard "
                                              r"checkpoint has one \(written last\)"):
        autoshard.load(model, path + ".tmp-dead")
    autoshard.save(model, path)
    bigger = models.mlp(hidden=16)[0]
    with pytest.raises(CheckpointError, match=r"checkpoint tensor `fc1.weight` has shape \[64, 32\], but the "
                                              r"model's `fc1.weight` has shape \[32, 16\]"):
        autoshard.load(bigger, path)
    with pytest.raises(CheckpointError, match=r"has no tensor `a.weight`, but the model being loaded has it"):
        autoshard.load(_Other(), path)
    with pytest.raises(CheckpointError, match=r"has no optimizer state, but load was given optimizer="):
        autoshard.load(model, path, optimizer=torch.optim.Adam(model.parameters()))
    autoshard.save(model, path, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(CheckpointError, match=r"has SGD state, but the optimizer is Adam"):
        autoshard.load(model, path, optimizer=torch.optim.Adam(model.parameters()))
    with pytest.raises(CheckpointError, match=r"optimizer holds a parameter of shape \[3\] that the saved model"):
        autoshard.save(model, path, optimizer=torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1))
    with pytest.raises(CheckpointError, match=r"checkpoint target has type str, but must be"):
        autoshard.save("model", path)
    assert sorted(os.listdir(tmp_path)) == ["ck", "ck.tmp-dead"]  # overwriting left nothing else behind


class _Other(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(2, 2)
