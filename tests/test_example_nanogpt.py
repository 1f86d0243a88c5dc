"""examples/nanogpt run as a user runs them: ``train.py`` (autoshard.shard) and its DDP twin ``train_ddp.py`` as
subprocesses under torchrun on gloo, each compared with ``train_ddp.py`` in one process, loss by logged loss.

Every run logs each train loss, each eval loss and its final greedy sample (rank 0, JSON lines); the runs draw the
same global batches whatever their world size, so one process is the exact reference. The multi-process tests are
marked ``gloo`` (``pytest -m gloo`` selects them). The whole file took about 240 CPU-s in one pytest process (6 min
on 2 cores loaded by other work); the searched plan's two runs, the second resumed under torch.compile, about 110
CPU-s of it.
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "nanogpt"
#: a tiny GPT and a short run: 2 layers of width 32, 32 characters of context, 20 steps of 2 micro-batches of 8;
#: eval at steps 0, 10 and 20 on 4-sequence batches (another shape than training's) and a 4-character greedy sample
#: (4 new lengths: on 4 processes each new length traces and plans a new program)
TINY = ["--n_layer", "2", "--n_head", "4", "--n_embd", "32", "--block_size", "32", "--batch_size", "8",
        "--grad_accum", "2", "--max_iters", "20", "--eval_interval", "10", "--eval_iters", "2",
        "--eval_batch_size", "4", "--max_new_tokens", "4"]
#: the 4-process train.py runs sample 2 new characters, not 4: each new length is a new program, traced and planned
#: (searched under the memory limit) on every rank, about 6.6 CPU-s per length for the 4 ranks; 2 lengths still
#: show a program made for each new shape after the first (the one-process reference samples 4)
SHORT_SAMPLE = ["--max_new_tokens", "2"]
SAVE_AT = 10  # the sharded run saves a checkpoint after this many steps, the resumed run continues from it
MESH = ["--mesh", "data=2,model=2"]
#: the memory limit as a share of the unconstrained searched plan's peak per rank: low enough that the search
#: recomputes the blocks (asserted in test_the_memory_limit_makes_the_search_recompute). Without a limit the search
#: replicates this tiny model on every rank; under it (when written) it recomputes both blocks, splits the MLPs over
#: `model` and stores the embedding ZeRO-2 over `data`, the batch split over `data`
LIMIT_SHARE = 0.6
TIMEOUT = 600  # seconds per run: 4 processes share 2 cores


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """One folder for every run of this file, with its own copy of the text (the repository's README.md may be
    edited while the tests run; every run must read the same characters)."""
    path = tmp_path_factory.mktemp("nanogpt")
    shutil.copy(ROOT / "README.md", path / "data.txt")
    return path


def run(work: Path, script: str, nproc: int, name: str, *flags: str) -> dict:
    """Run ``script`` as a user would (one process, or torchrun with ``nproc`` gloo processes) in ``work`` and return
    its log: ``{"train": {step: loss}, "eval": {(step, split): loss}, "sample": text, "stdout": text}``."""
    out = work / name
    cmd = [sys.executable, str(EXAMPLE / script)]
    if nproc > 1:
        # torchrun as a module of this interpreter (the `torchrun` on PATH may be another Python's); --standalone:
        # its rendezvous binds a port it picks itself
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               *cmd[1:]]
    cmd += ["--data", str(work / "data.txt"), "--out_dir", str(out), "--log_file", str(work / f"{name}.jsonl"),
            *TINY, *flags]
    # one thread each, and inductor compiling in the rank's own process: its default pool of compile workers (one
    # per core, each importing torch) on every rank of a 4-process job on 2 cores cost ~20 CPU-s of the --compile run
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    log = {"train": {}, "eval": {}, "sample": None, "stdout": proc.stdout}
    with open(work / f"{name}.jsonl") as f:
        for entry in map(json.loads, f):
            if entry["kind"] == "train":
                log["train"][entry["step"]] = entry["loss"]
            elif entry["kind"] == "eval":
                log["eval"][entry["step"], "train"] = entry["train"]
                log["eval"][entry["step"], "val"] = entry["val"]
            else:
                log["sample"] = entry["text"]
    return log


@pytest.fixture(scope="module")
def reference(work) -> dict:
    """``train_ddp.py`` in one process: plain PyTorch, no wrapper."""
    return run(work, "train_ddp.py", 1, "reference")


@pytest.fixture(scope="module")
def memory_limit(work) -> int:
    """LIMIT_SHARE of the peak memory per rank of the searched plan without a limit, for the model and the
    shapes train.py shards (the global batch of one micro-step)."""
    return int(LIMIT_SHARE * plan_of(work, None).cost().memory.peak)


def plan_of(work: Path, limit):
    """The plan ``autoshard.shard`` makes in train.py, made here in one process (the plan needs no process group)."""
    import torch

    import autoshard

    sys.path.insert(0, str(EXAMPLE))
    try:
        from model import GPT, GPTConfig
    finally:
        sys.path.remove(str(EXAMPLE))
    text = (work / "data.txt").read_text(encoding="utf-8")
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=len(set(text)), n_layer=2, n_head=4, n_embd=32))
    x = torch.zeros(8, 32, dtype=torch.long)
    return autoshard.compile(model, autoshard.Mesh(data=2, model=2), (x, x), planner="search",
                             memory_limit=limit).plan


def assert_same_losses(got: dict, want: dict, tol: float, steps=None) -> float:
    """Every logged loss of ``got`` equals ``want``'s within ``tol`` (train losses at ``steps``, default all of
    want's); returns the largest difference."""
    steps = sorted(want["train"]) if steps is None else list(steps)
    assert sorted(got["train"]) == steps
    worst = 0.0
    for step in steps:
        assert got["train"][step] == pytest.approx(want["train"][step], abs=tol), f"train loss at step {step}"
        worst = max(worst, abs(got["train"][step] - want["train"][step]))
    evals = [k for k in want["eval"] if k[0] >= steps[0]]
    assert sorted(got["eval"]) == sorted(evals)
    for key in evals:
        assert got["eval"][key] == pytest.approx(want["eval"][key], abs=tol), f"eval loss {key}"
        worst = max(worst, abs(got["eval"][key] - want["eval"][key]))
    return worst


def assert_sample_is_the_references_start(got: dict, reference: dict) -> None:
    """A run with :data:`SHORT_SAMPLE` sampled 2 characters fewer than the reference; greedy sampling makes its
    sample the reference's first characters."""
    assert len(got["sample"]) == len(reference["sample"]) - 2
    assert got["sample"] == reference["sample"][:len(got["sample"])]


def test_train_py_is_train_ddp_py_with_at_most_5_lines_changed():
    ddp = (EXAMPLE / "train_ddp.py").read_text().splitlines()
    sharded_script = (EXAMPLE / "train.py").read_text().splitlines()
    changed = sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in
                  difflib.SequenceMatcher(None, ddp, sharded_script, autojunk=False).get_opcodes() if tag != "equal")
    diff = "\n".join(difflib.unified_diff(ddp, sharded_script, "train_ddp.py", "train.py", lineterm=""))
    assert 0 < changed <= 5, diff
    assert "autoshard.shard(" in diff and "DDP(" in diff


def test_the_memory_limit_makes_the_search_recompute(work, memory_limit):
    report = plan_of(work, memory_limit).context.report["plan_search"]
    assert report["recomputed"], report  # the limit is below the plan without recomputation
    assert report["memory_per_rank"] <= memory_limit


@pytest.mark.gloo
def test_train_ddp_py_on_2_processes_equals_one_process(work, reference):
    """The DDP twin itself: 2 gloo ranks, each its chunk of the same global batches, equal the one-process run."""
    ddp = run(work, "train_ddp.py", 2, "ddp")
    assert_same_losses(ddp, reference, 1e-4)
    assert ddp["sample"] == reference["sample"]


@pytest.mark.gloo
def test_train_py_searched_plan_on_data_2_model_2_equals_one_process_and_resumes_at_step_10_under_torch_compile(
        work, reference, memory_limit):
    """train.py on 4 gloo processes, data=2 x model=2, the searched plan under the memory limit, saving a DCP
    checkpoint at step 10 (model, optimizer, step, RNG); then a new job, ``--compile`` (torch.compile, the default
    inductor backend: each program an inductor compile on every rank), resumed from it continues with the same
    losses (its eval at steps 10 and 20) as the eager run and as the one-process reference, and samples the same
    characters. One test, so that the 4-process runs are made once whatever the pytest-xdist workers; the compiled
    run is the resumed one (a 4-process job of its own, from step 0, cost about 35 CPU-s more: the same programs,
    train, eval and the 2 sample lengths, compiled on every rank, compared with the reference within the same
    tolerance)."""
    sharded = run(work, "train.py", 4, "sharded", *MESH, "--memory_limit", str(memory_limit), "--save_at",
                  str(SAVE_AT), *SHORT_SAMPLE)
    worst = assert_same_losses(sharded, reference, 1e-4)
    assert_sample_is_the_references_start(sharded, reference)
    print(f"sharded vs reference: max |difference| {worst:.2e} over {len(reference['train'])} steps")
    # (2 new characters, SHORT_SAMPLE: each new length is a program, and each program an inductor compile on every
    # rank)
    resumed = run(work, "train.py", 4, "resumed-compiled", *MESH, "--memory_limit", str(memory_limit), "--resume",
                  "--out_dir", str(work / "sharded"), "--compile", *SHORT_SAMPLE)
    assert "resumed from" in resumed["stdout"]
    after = range(SAVE_AT, len(sharded["train"]))
    assert_same_losses(resumed, sharded, 1e-4, steps=after)
    assert_same_losses(resumed, reference, 1e-4, steps=after)
    assert resumed["sample"] == sharded["sample"]
    assert_sample_is_the_references_start(resumed, reference)


@pytest.mark.gloo
def test_train_py_bf16_autocast_on_4_processes_is_close_to_one_process_bf16(work, memory_limit):
    want = run(work, "train_ddp.py", 1, "reference-bf16", "--dtype", "bfloat16", *SHORT_SAMPLE)
    got = run(work, "train.py", 4, "bf16", *MESH, "--memory_limit", str(memory_limit), "--dtype", "bfloat16",
              *SHORT_SAMPLE)
    assert_same_losses(got, want, 2e-2)
    assert got["sample"] == want["sample"]
