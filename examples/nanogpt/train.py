"""Train a small character-level GPT on a text file: one process, or data parallel under torchrun.

    python train_ddp.py --max_iters 50                                  # one process: the reference
    torchrun --standalone --nproc-per-node 2 train_ddp.py --max_iters 50
    torchrun --standalone --nproc-per-node 4 train.py --mesh data=2,model=2 --memory_limit 2MB

``train_ddp.py`` wraps the model in DDP; ``train.py`` is this file with ``autoshard.shard`` in its place
(``diff -u train_ddp.py train.py``: five lines). gloo on CPU, NCCL on ``cuda:LOCAL_RANK``.

Every data-parallel rank draws the same global batch (a generator seeded by seed, step and micro-step) and takes its
chunk, so every world size and mesh trains on the same batches and one process is the exact reference. Rank 0 writes
every train loss, eval loss and the final greedy sample to ``--log_file`` as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
import autoshard

from model import GPT, GPTConfig

HERE = os.path.dirname(os.path.abspath(__file__))
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
flag = parser.add_argument
# I/O
flag("--data", default=os.path.join(HERE, "..", "..", "README.md"), help="a text file; one token per character")
flag("--out_dir", default="out-nanogpt", help="checkpoints go to OUT_DIR/ckpt")
flag("--log_file", default=None, help="JSON lines of every logged loss (default OUT_DIR/log.jsonl)")
flag("--eval_interval", type=int, default=10)
flag("--eval_iters", type=int, default=4)
flag("--save_at", type=int, default=None, help="save a checkpoint (DCP) after this many steps")
flag("--resume", action="store_true", help="continue from the checkpoint in OUT_DIR/ckpt")
# data
flag("--batch_size", type=int, default=8, help="sequences per micro-step, all data-parallel ranks together")
flag("--eval_batch_size", type=int, default=None, help="sequences per eval batch (default: --batch_size)")
flag("--grad_accum", type=int, default=2, help="micro-steps per optimizer step")
flag("--block_size", type=int, default=32)
# model
flag("--n_layer", type=int, default=2)
flag("--n_head", type=int, default=4)
flag("--n_embd", type=int, default=32)
flag("--dropout", type=float, default=0.0)
flag("--no_bias", action="store_true", help="no biases in the linears and LayerNorms")
# optimizer and schedule
flag("--max_iters", type=int, default=50)
flag("--learning_rate", type=float, default=1e-3)
flag("--min_lr", type=float, default=1e-4)
flag("--warmup_iters", type=int, default=5)
flag("--lr_decay_iters", type=int, default=None, help="cosine decay to --min_lr over this many steps "
                                                        "(default: --max_iters)")
flag("--weight_decay", type=float, default=0.1)
flag("--beta1", type=float, default=0.9)
flag("--beta2", type=float, default=0.95)
flag("--grad_clip", type=float, default=1.0, help="clip the gradients' global norm to this (0: off)")
# system
flag("--seed", type=int, default=1337)
flag("--dtype", choices=["float32", "bfloat16"], default="float32", help="bfloat16: autocast")
flag("--compile", action="store_true", help="torch.compile the model")
flag("--mesh", default=None, help="device mesh axes NAME=SIZE,..., e.g. data=2,model=2 (default: every rank on data)")
flag("--memory_limit", default=None, help="autoshard: memory per rank for the plan search, e.g. 2MB")
# sampling
flag("--prompt", default="autoshard shards a model ", help="what the final greedy sample continues")
flag("--max_new_tokens", type=int, default=16)
args = parser.parse_args()

# ---- processes and devices -------------------------------------------------------------------------------------
distributed = "RANK" in os.environ  # launched by torchrun
if distributed:
    local_rank = int(os.environ["LOCAL_RANK"])
    device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    if torch.cuda.is_available():
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
else:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rank, world_size = 0, 1
device_type = "cuda" if device.startswith("cuda") else "cpu"
master = rank == 0
axes = dict((name, int(size)) for name, size in (part.split("=") for part in args.mesh.split(","))) if args.mesh \
    else {"data": world_size}
mesh = init_device_mesh(device_type, tuple(axes.values()), mesh_dim_names=tuple(axes)) if distributed else None
# which chunk of each global batch this rank takes: its coordinate on the data axis (ranks on other axes share it)
dp_rank, dp_size = (mesh["data"].get_local_rank(), mesh["data"].size()) if distributed else (0, 1)
ctx = nullcontext() if args.dtype == "float32" else torch.autocast(device_type=device_type, dtype=torch.bfloat16)
torch.manual_seed(args.seed)

# ---- data: characters of a text file ---------------------------------------------------------------------------
with open(args.data, encoding="utf-8") as f:
    text = f.read()
chars = sorted(set(text))
stoi = {c: i for i, c in enumerate(chars)}


def encode(s: str) -> list[int]:
    return [stoi[c] for c in s]


def decode(ids: list[int]) -> str:
    return "".join(chars[i] for i in ids)


tokens = torch.tensor(encode(text), dtype=torch.long)
splits = {"train": tokens[: int(0.9 * len(tokens))], "val": tokens[int(0.9 * len(tokens)):]}


def get_batch(split: str, step: int, micro: int, batch_size: int | None = None, evaluating: bool = False):
    """This rank's chunk of global batch ``(step, micro)`` of ``split``: every rank draws the same global batch."""
    batch_size = batch_size or args.batch_size
    if batch_size % dp_size:
        raise SystemExit(f"a batch of {batch_size} cannot be split over {dp_size} data-parallel ranks")
    stream = ("train", "val").index(split) + 2 * evaluating
    g = torch.Generator().manual_seed(((args.seed * 4 + stream) * 1_000_000 + step) * 1_000 + micro)
    source = splits[split]
    starts = torch.randint(len(source) - args.block_size, (batch_size,), generator=g).tolist()
    x = torch.stack([source[i:i + args.block_size] for i in starts])
    y = torch.stack([source[i + 1:i + 1 + args.block_size] for i in starts])
    return x.chunk(dp_size)[dp_rank].to(device), y.chunk(dp_size)[dp_rank].to(device)


def data_mean(value: torch.Tensor) -> float:
    """The mean of ``value`` over the data-parallel ranks (each has its chunk's)."""
    value = value.detach().float().clone()
    if distributed:
        dist.all_reduce(value, group=mesh["data"].get_group())
        value /= dp_size
    return value.item()


# ---- model and optimizer ---------------------------------------------------------------------------------------
config = GPTConfig(block_size=args.block_size, vocab_size=len(chars), n_layer=args.n_layer, n_head=args.n_head,
                   n_embd=args.n_embd, dropout=args.dropout, bias=not args.no_bias)
model = GPT(config).to(device)
if args.compile:
    model = torch.compile(model)
if distributed:
    model = autoshard.shard(model, autoshard.Mesh(**axes), example_inputs=get_batch("train", 0, 0),
                            search=autoshard.Search(memory_limit=args.memory_limit))
    dp_rank, dp_size = model.data_parallel_rank, model.data_parallel_size
raw_model = getattr(model, "module", model)  # the model's own methods (DDP keeps the model as .module)
optimizer = raw_model.configure_optimizers(args.weight_decay, args.learning_rate, (args.beta1, args.beta2),
                                           device_type)
if master:
    print(f"{raw_model.get_num_params() / 1e3:.1f}K parameters, vocabulary {len(chars)}, mesh {axes}")


def get_lr(step: int) -> float:
    """Linear warmup, then cosine decay to ``min_lr`` at ``lr_decay_iters``, then ``min_lr``."""
    decay_iters = args.lr_decay_iters or args.max_iters
    if step < args.warmup_iters:
        return args.learning_rate * (step + 1) / (args.warmup_iters + 1)
    if step >= decay_iters:
        return args.min_lr
    progress = (step - args.warmup_iters) / max(1, decay_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (args.learning_rate - args.min_lr)


@torch.no_grad()
def estimate_loss() -> dict[str, float]:
    """The mean loss over ``eval_iters`` fixed batches of each split, in eval mode (every rank runs it)."""
    model.eval()
    out = {}
    for split in ("train", "val"):
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            x, y = get_batch(split, k, 0, args.eval_batch_size, evaluating=True)
            with ctx:
                _, loss = model(x, y)
            losses[k] = loss.float().item()
        out[split] = data_mean(losses.mean())
    model.train()
    return out


# ---- checkpoints: DCP, each rank writing its own part ----------------------------------------------------------
ckpt_dir = os.path.join(args.out_dir, "ckpt")


def training_state(step: int) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": torch.tensor(step),
             f"rng.rank{rank}": torch.get_rng_state()}
    if device_type == "cuda":
        state[f"cuda_rng.rank{rank}"] = torch.cuda.get_rng_state()
    return state


step = start = 0
if args.resume:
    state = training_state(0)
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    step = start = int(state["step"])
    torch.set_rng_state(state[f"rng.rank{rank}"])
    if device_type == "cuda":
        torch.cuda.set_rng_state(state[f"cuda_rng.rank{rank}"])
    if master:
        print(f"resumed from {ckpt_dir} at step {step}")

if master:
    os.makedirs(args.out_dir, exist_ok=True)
log = open(args.log_file or os.path.join(args.out_dir, "log.jsonl"), "w") if master else None


def record(**entry) -> None:
    if log is not None:
        log.write(json.dumps(entry) + "\n")
        log.flush()


# ---- the training loop -----------------------------------------------------------------------------------------
model.train()
while True:
    if step == args.save_at and not (args.resume and step == start):  # not the step it resumed at
        dcp.save(training_state(step), checkpoint_id=ckpt_dir)
        if master:
            print(f"saved a checkpoint at step {step} to {ckpt_dir}")
    if step % args.eval_interval == 0 or step == args.max_iters:
        losses = estimate_loss()
        record(kind="eval", step=step, train=losses["train"], val=losses["val"])
        if master:
            print(f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    if step == args.max_iters:
        break
    t0 = time.time()
    lr = get_lr(step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    step_loss = torch.zeros(())
    for micro in range(args.grad_accum):
        x, y = get_batch("train", step, micro)
        last = micro == args.grad_accum - 1
        # gradients are all-reduced once per step, in the last micro-step's backward
        with model.no_sync() if distributed and not last else nullcontext():
            with ctx:
                _, loss = model(x, y)
                loss = loss / args.grad_accum
            loss.backward()
        step_loss += loss.detach().float().cpu()
    if args.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lossf = data_mean(step_loss)
    record(kind="train", step=step, loss=lossf, lr=lr)
    if master:
        dt = time.time() - t0
        mfu = raw_model.estimate_mfu(args.batch_size * args.grad_accum // dp_size, dt)
        print(f"step {step}: loss {lossf:.4f}, lr {lr:.2e}, time {dt * 1000:.0f}ms, mfu {mfu * 100:.3f}%")
    step += 1

# ---- a greedy sample from the model's own generate, on every rank ---------------------------------------------
model.eval()
prompt = torch.tensor([encode(args.prompt)], dtype=torch.long, device=device)
with ctx:
    sample = decode(raw_model.generate(prompt, args.max_new_tokens, greedy=True)[0].tolist())
record(kind="sample", text=sample)
if master:
    print(f"sample: {sample!r}")
    log.close()
if distributed:
    dist.destroy_process_group()
