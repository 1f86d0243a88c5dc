"""Real processes: a Hugging Face Llama saved with ``save_pretrained``, built on the meta device, compiled with the
Megatron plan on data=2 x model=2 and loaded with ``autoshard.load`` trains (SGD) like the eager model loaded from
the same directory, while no rank reads or holds more than 60% of the parameter bytes."""

from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard.runtime.parameters import local_of
from autoshard.placements import assemble
from autoshard.runtime import spawn
from examples import models

MESH = {"data": 2, "model": 2}
STEPS, LR, BATCH, SEQ, VOCAB = 3, 0.1, 4, 16, 128


def batches():
    g = torch.Generator().manual_seed(99)
    return [{"input_ids": (ids := torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)), "labels": (ids * 7 + 3) % VOCAB}
            for _ in range(STEPS)]


def _worker(rank: int, world: int, path: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    mesh = autoshard.Mesh(**MESH)
    data = batches()
    sharded = autoshard.compile(model, mesh, example_kwargs=data[0], annotations=models.megatron(mesh, "hf_llama"),
                                timeout=120, device="cpu")
    stats = autoshard.load(sharded, path)
    held = sum(local_of(t).numel() * t.element_size() for t in sharded.parameters())
    opt = torch.optim.SGD(sharded.parameters(), lr=LR)
    losses = []
    for batch in data:
        _, kwargs = sharded.plan.shard_inputs(rank, (), batch)
        loss = sharded(**kwargs).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    final = {n: local_of(p).detach().clone() for n, p in sharded.named_parameters()}
    return losses, stats, held, final, sharded.plan.param_specs()


@pytest.mark.gloo
def test_meta_llama_loads_its_slices_and_trains_like_eager(tmp_path):
    from transformers import LlamaForCausalLM

    saved, _, _ = models.hf_llama(layers=2, seed=5)
    saved.save_pretrained(tmp_path)
    results = spawn(_worker, 4, str(tmp_path), timeout=300, start_method="forkserver")

    eager = LlamaForCausalLM.from_pretrained(tmp_path)
    total = sum(p.numel() * p.element_size() for p in eager.parameters())
    opt = torch.optim.SGD(eager.parameters(), lr=LR)
    want = []
    for batch in batches():
        loss = eager(**batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        want.append(loss.item())
    for rank, (losses, stats, held, _, _) in enumerate(results):
        print(f"rank {rank}: read {stats['bytes_read']} B, holds {held} B of {total} B of parameters "
              f"({stats['bytes_read'] / total:.0%}, {held / total:.0%}); losses {losses}")
        assert stats["bytes_read"] <= 0.6 * total and held <= 0.6 * total
        assert stats["computed"] == ["model.rotary_emb.inv_freq"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-4, atol=1e-4)
    specs = results[0][4]
    params = dict(eager.named_parameters())
    for fqn, spec in specs.items():
        if fqn not in params:
            continue
        got = assemble([results[r][3][fqn] for r in range(4)], spec, autoshard.Mesh(**MESH))
        torch.testing.assert_close(got, params[fqn].detach(), rtol=1e-4, atol=1e-4, msg=lambda m, f=fqn: f"{f}: {m}")
