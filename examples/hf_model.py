"""Shard your own Hugging Face model: every rank simulated in one process, then real processes under torchrun.

    python examples/hf_model.py                                   # 4 simulated ranks (data=2 x model=2)
    torchrun --nproc-per-node 4 examples/hf_model.py              # 4 processes: gloo on CPU, NCCL on GPUs
    torchrun --nproc-per-node 2 examples/hf_model.py --mesh model=2

Put your own model in ``build()``: any ``transformers`` model that returns a loss, with ``use_cache=False`` (a
``DynamicCache`` cannot be traced with static shapes). ``TENSOR_PARALLEL`` annotates Megatron tensor parallelism
for Llama-style names (column-parallel q/k/v, gate and up; row-parallel o and down), given to ``compile`` as
``plan=``; every other tensor is placed by propagation and the batch is split over the ``data`` axis. Both modes
compare the sharded loss (and, simulated, every gradient) with the same model run eagerly, print the comparison,
and exit 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autoshard  # noqa: E402
from autoshard import Replicate, Shard  # noqa: E402
from autoshard.compiler.plan import loss_of  # noqa: E402

COLUMN, ROW = Shard(0), Shard(1)  # nn.Linear weights are [out, in]
LAYERS = "model.layers.*."
TENSOR_PARALLEL = {LAYERS + "self_attn.q_proj.weight": COLUMN, LAYERS + "self_attn.k_proj.weight": COLUMN,
                   LAYERS + "self_attn.v_proj.weight": COLUMN, LAYERS + "self_attn.o_proj.weight": ROW,
                   LAYERS + "mlp.gate_proj.weight": COLUMN, LAYERS + "mlp.up_proj.weight": COLUMN,
                   LAYERS + "mlp.down_proj.weight": ROW}


def build() -> tuple[torch.nn.Module, dict]:
    """The model and one batch of keyword inputs. Same seed, same weights on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=32, use_cache=False)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def annotations_for(mesh: autoshard.Mesh) -> dict:
    """``TENSOR_PARALLEL`` as annotations: each weight's placement per mesh axis, sharded on ``model`` when the mesh
    has that axis."""
    if "model" not in mesh.names:
        return {}
    return {glob: tuple(p if axis == "model" else Replicate() for axis in mesh.names)
            for glob, p in TENSOR_PARALLEL.items()}


def eager(model: torch.nn.Module, kwargs: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of one unsharded step on a copy of the model."""
    ref = copy.deepcopy(model)
    loss = ref(**kwargs).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in ref.named_parameters()}


def simulated(mesh: autoshard.Mesh) -> int:
    model, kwargs = build()
    ref_loss, ref_grads = eager(model, kwargs)
    sharded = autoshard.compile(model, mesh, (), kwargs, annotations=annotations_for(mesh))
    sharded.show()
    sim = sharded.plan.simulate((), kwargs)  # every rank in this process, forward and backward
    losses = [loss_of(out).item() for out in sim.outputs]
    worst = max((grad - ref_grads[name]).abs().max().item() for name, grad in sim.grads.items())
    print(f"sharded loss per rank:  {[round(x, 6) for x in losses]}")
    print(f"eager loss:             {ref_loss:.6f}")
    print(f"largest gradient difference over {len(sim.grads)} parameters: {worst:.2e}")
    ok = all(abs(x - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)) for x in losses) and worst <= 1e-4
    print("MATCH" if ok else "MISMATCH")
    return 0 if ok else 1


def distributed(mesh: autoshard.Mesh) -> int:
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        rank = dist.get_rank()
        model, kwargs = build()
        ref_loss, _ = eager(model, kwargs)
        sharded = autoshard.compile(model, mesh, annotations=annotations_for(mesh))  # lazy: plans on the first call
        local = {k: autoshard.data_shard(v, mesh, rank).to(sharded.device) for k, v in kwargs.items()}
        loss = loss_of(sharded(**local))
        loss.backward()
        ok = abs(loss.item() - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
        verdict = "MATCH" if ok else "MISMATCH"
        print(f"rank {rank}: sharded loss {loss.item():.6f}, eager loss {ref_loss:.6f}: {verdict}")
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="data=2,model=2", help="mesh axes NAME=SIZE,... (default data=2,model=2)")
    mesh = autoshard.Mesh.parse(parser.parse_args(argv).mesh)
    return distributed(mesh) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else simulated(mesh)


if __name__ == "__main__":
    sys.exit(main())
