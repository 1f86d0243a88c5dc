#!/usr/bin/env bash
# GPU check (not part of CI: run by hand, or on the device machine, on a machine with at least one CUDA GPU).
#
#   bash tests/gpu/check.sh
#
# 1. HF Llama built on the meta device, compiled for data=2 x model=2 (Megatron annotations), every rank's shards
#    materialised on cuda:0 by init_weights(); all four ranks run in the simulator; loss and every gradient are
#    compared with a single-device CUDA run of the same model (to_empty on cuda:0 + the same initialisation).
# 2. With two or more GPUs: two NCCL processes (data=2), each on its own GPU, loss compared with one device.
# 3. tests/gpu/calibrate_check.py: calibration tables (matmul, attention, elementwise), per-op overhead and the AdamW
#    step measured on GPU 0 against the gpu-8x-nvlink preset, then a small Llama's predicted vs measured step time
#    and peak memory (torch.cuda.max_memory_allocated) on a mesh of one rank.
set -euo pipefail
cd "$(dirname "$0")/../.."
python - <<'PY'
import torch
assert torch.cuda.is_available(), "this check needs a CUDA GPU"
import autoshard
from autoshard.placements import assemble
from autoshard.runtime import SimWorld
from examples import models
from transformers import LlamaForCausalLM

_, args, kwargs = models.hf_llama(layers=2)
config = models.hf_llama(layers=2)[0].config
dev = torch.device("cuda", 0)
mesh = autoshard.Mesh(data=2, model=2)
args = tuple(a.to(dev) for a in args)

with torch.device("meta"):
    meta_model = LlamaForCausalLM(config)
ref = LlamaForCausalLM(config)
ref.to_empty(device=dev)
torch.manual_seed(0)
ref.initialize_weights()
out = ref(*args, **(kwargs or {}))
loss_ref = out.loss
loss_ref.backward()

world = SimWorld(mesh, timeout=600)
def body(rank):
    torch.manual_seed(0)
    sharded = autoshard.compile(meta_model, mesh, args, kwargs, annotations=models.megatron(mesh, "hf_llama"),
                                comm=world.communicator(rank), device=dev)
    sharded.init_weights()
    a = tuple(autoshard.data_shard(x, mesh, rank) for x in args)
    o = sharded(*a, **(kwargs or {}))
    loss = o.loss if hasattr(o, "loss") else o
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in sharded.named_parameters()}, sharded.plan.param_specs()
res = world.run(body)
for r, (loss, _, _) in enumerate(res):
    torch.testing.assert_close(loss, loss_ref.detach(), rtol=1e-4, atol=1e-5)
params = dict(ref.named_parameters(remove_duplicate=False))
specs = res[0][2]
worst = 0.0
for name in res[0][1]:
    g = assemble([r[1][name] for r in res], specs[name], mesh)
    torch.testing.assert_close(g, params[name].grad, rtol=1e-3, atol=1e-5)
    worst = max(worst, float((g - params[name].grad).abs().max()))
print(f"simulator on {torch.cuda.get_device_name(0)}: loss {float(res[0][0]):.6f} vs single device "
      f"{float(loss_ref):.6f}; {len(res[0][1])} gradients equal (max |diff| {worst:.2e})")
PY
if python -c "import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)"; then
  torchrun --nproc-per-node 2 examples/train_gpt.py --steps 5 --mesh data=2 || { echo "NCCL run failed"; exit 1; }
else
  echo "one GPU: the two-process NCCL run is skipped"
fi
python tests/gpu/calibrate_check.py || { echo "calibrate_check failed"; exit 1; }
