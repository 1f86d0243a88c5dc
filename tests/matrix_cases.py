"""The cases of the real-process matrix (issue 33, part 3; tests/test_matrix.py): what a user's training script does
on every rank, per feature, and the same on one device.

A case is one training step as a script writes it: ``autoshard.compile`` on this rank (lazily where the case says),
this rank's share of the batch (``autoshard.data_shard``), ``loss = sharded(...)``, ``loss.backward()`` outside any
``autoshard.runtime.use()`` block, ``torch.nn.utils.clip_grad_norm_(sharded.parameters(), MAX_NORM)`` (DTensor
parameters), an ``AdamW`` step, then a second forward. :func:`rank_step` runs it on one rank (a simulated rank's
thread or a gloo process), :func:`eager_step` on one device, :func:`check` compares them. :func:`gloo_all` runs every
case in sequence in one set of gloo processes, each case in its own ``try``: one failing case hides no other.

Tolerances. fp32 cases: ``rtol=1e-5, atol=1e-4`` (sums in other orders). bf16 cases are another bf16 evaluation of
the same function, so they are bounded by bf16 arithmetic, with the existing tests' helpers: each loss within
``3 E`` of eager bf16's and ``2 E`` of fp32's, ``E`` = eager bf16's own error against fp32 (at least one bf16
rounding); gradients by ``_check_grads`` (MixedPrecision, tests/test_mixed_precision.py) or within ``3 E`` of eager
autocast per tensor, ``E`` = eager autocast's own error against fp32 (tests/test_autocast.py). The
clipped norm is the 2-norm of the gradients, so ``|norm - norm_eager| <= ||g - g_eager||`` (triangle inequality) of
the gradients the ranks actually computed; and AdamW's first step moves an element by ``lr * g / (|g| + eps)``
(bias corrections cancel at step 1), so each parameter is within ``lr * |u(g) - u(g_eager)|`` (``u`` that update
direction, of the clipped gradients) plus fp32 rounding of eager's: where the gradient is well above its bf16 error
both moved by ``lr * sign(g)`` and agree to fp32 rounding.
"""

from __future__ import annotations

import copy
import threading
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

import autoshard
from autoshard.compiler.plan import loss_of
from examples import models

LR, WEIGHT_DECAY, MAX_NORM = 1e-3, 0.1, 0.5
RTOL, ATOL = 1e-5, 1e-4  # fp32
U = 2.0 ** -8  # bf16 unit roundoff
MP_GRAD_TOL = 6e-2  # tests/test_mixed_precision.py's _check_grads tolerance
SEED = 7  # the meta-init case's seed (tests/test_materialize.py)
FRACTION = 0.5  # the memory-limit case: of the unconstrained searched plan's peak (at 0.6 ZeRO alone fits since
# the memory model stopped counting saved operands no gradient needs; 0.5 needs recomputation too)
TIMEOUT = 60.0  # per collective: a case that hangs fails in a minute and the next case runs

BF16_MP = autoshard.MixedPrecision(torch.bfloat16)
MOE = autoshard.MoE(existing=True, expert_axis="data", capacity_factor=None)
PIPE_SMALL = {"hidden": 32, "heads": 4, "seq": 8, "batch": 8}


@dataclass(frozen=True)
class Case:
    factory: str
    fkw: dict = field(default_factory=dict)
    mesh: dict = field(default_factory=lambda: {"data": 2, "model": 2})
    megatron: bool = False
    opts: dict = field(default_factory=dict)
    precision: str = "fp32"  # "fp32", "mp" (MixedPrecision bf16) or "autocast" (bf16 autocast around the forward)
    lazy: bool = False  # no example inputs: the plan is made on the first call
    meta: bool = False  # the model built on meta, sharded.init_weights()
    eval: bool = False  # the second forward under model.eval() + torch.no_grad()
    search_limit: bool = False  # planner="search", memory_limit = FRACTION of the unconstrained searched plan's

    @property
    def pipelined(self) -> bool:
        return "pipeline" in self.opts

    @property
    def bf16(self) -> bool:
        return self.precision != "fp32"


GPT1 = {"layers": 1}
CASES: dict[str, Case] = {
    "dp": Case("gpt", GPT1, {"data": 4}),
    "dp_2x2": Case("gpt", GPT1),
    "tp": Case("gpt", GPT1, megatron=True),
    "tp_sp": Case("gpt", GPT1, megatron=True, opts={"sequence_parallel": True}),
    "zero1": Case("gpt", GPT1, megatron=True, opts={"zero": 1}),
    "zero2": Case("gpt", GPT1, megatron=True, opts={"zero": 2}),
    "zero3": Case("gpt", GPT1, megatron=True, opts={"zero": 3}),
    "recompute_tp": Case("gpt", {"layers": 2}, megatron=True, opts={"recompute": "blocks.*"}),
    "mixed_precision": Case("gpt", GPT1, megatron=True, opts={"precision": BF16_MP}, precision="mp"),
    "autocast": Case("gpt", GPT1, megatron=True, precision="autocast"),
    "moe_ep": Case("hf_mixtral", {"layers": 1}, opts={"moe": MOE}),
    "moe_ep_bf16": Case("hf_mixtral", {"layers": 1}, opts={"moe": MOE, "precision": BF16_MP}, precision="mp"),
    "context_ring": Case("hf_llama", {"batch": 2, "seq": 16, "layers": 1, "hidden": 32},
                         {"data": 2, "context": 2},
                         opts={"context_axis": autoshard.ContextParallel("context", "ring")}),
    # the search with context parallelism; no data axis: ZeRO-3 stores over the context axis (head-tail balanced)
    "context_search_zero3": Case("hf_llama", {"batch": 1, "seq": 16, "layers": 1, "hidden": 32}, {"context": 4},
                                 opts={"context_axis": "context", "planner": "search", "zero": 3}, eval=True),
    "pipeline_1f1b": Case("gpt", {"layers": 2, **PIPE_SMALL}, {"pipe": 2, "data": 2},
                          opts={"pipeline": autoshard.Pipeline(microbatches=4, schedule="1f1b")}),
    "pipeline_interleaved": Case("gpt", {"layers": 4, **PIPE_SMALL}, {"pipe": 2, "data": 2},
                                 opts={"pipeline": autoshard.Pipeline(microbatches=4, schedule="interleaved",
                                                                      stages_per_rank=2)}),
    "eval_mode": Case("gpt", GPT1, megatron=True, eval=True),
    "lazy_compile": Case("gpt", GPT1, megatron=True, lazy=True),
    "meta_init": Case("gpt", GPT1, megatron=True, meta=True),
    "search_memory_limit": Case("gpt", {"layers": 2}, opts={"planner": "search"}, search_limit=True),
}
WORLD = 4
assert all(autoshard.Mesh(**c.mesh).size == WORLD for c in CASES.values())


# ---- models ---------------------------------------------------------------------------------------------------
def build(name: str):
    """(model the ranks compile, args, kwargs, the eager model with the same initial weights)."""
    case = CASES[name]
    if case.meta:
        from tests.test_materialize import eager_init, meta_model

        meta, build_, args, kwargs = meta_model(case.factory, layers=case.fkw.get("layers", 2))
        return meta, tuple(args), kwargs, eager_init(build_, seed=SEED)
    model, args, kwargs = getattr(models, case.factory)(**case.fkw)
    return model, tuple(args), kwargs, copy.deepcopy(model)


_limits: dict[str, float] = {}


def memory_limit(name: str) -> float | None:
    """FRACTION of the unconstrained searched plan's memory per rank (bench/memory_limit_sweep.py's limit)."""
    case = CASES[name]
    if not case.search_limit:
        return None
    if name not in _limits:
        import warnings

        model, args, kwargs, _ = build(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            free = autoshard.compile(model, autoshard.Mesh(**case.mesh), args, kwargs, planner="search").plan
        _limits[name] = FRACTION * free.cost().memory_per_rank
    return _limits[name]


def _full(t):
    t = t.full_tensor() if isinstance(t, DTensor) else t
    return t.detach().clone()


# ---- one rank, as a training script ---------------------------------------------------------------------------
def rank_step(name: str, rank: int, model, args, kwargs, comm=None, limit: float | None = None,
              rng_lock=None) -> dict:
    """This rank's training step of case ``name`` (the module docstring); ``rng_lock`` serialises the seeding
    and ``init_weights`` of simulated ranks, which share torch's one global generator."""
    case = CASES[name]
    mesh = autoshard.Mesh(**case.mesh)
    opts = dict(case.opts)
    if case.megatron:
        opts["plan"] = models.megatron(mesh, case.factory)
    if limit is not None:
        opts["memory_limit"] = limit
    example = () if case.lazy else (args, kwargs)
    sharded = autoshard.compile(model, mesh, *example, comm=comm, timeout=TIMEOUT, **opts)
    if case.meta:
        if rng_lock is not None:  # its collectives (the DeviceMesh's groups) before the lock, not under it
            sharded.materialize()
        with rng_lock or nullcontext():
            torch.manual_seed(SEED)
            sharded.init_weights()
    if case.pipelined:  # a pipeline step takes the global batch
        a, k = args, kwargs
    else:
        a = tuple(autoshard.data_shard(x, mesh, rank) for x in args)
        k = {key: autoshard.data_shard(v, mesh, rank) for key, v in kwargs.items()}

    def forward():
        with torch.autocast("cpu", torch.bfloat16) if case.precision == "autocast" else nullcontext():
            return loss_of(sharded(*a, **k))

    loss1 = forward()
    if not case.pipelined:  # a pipeline's call runs forward and backward
        loss1.backward()
    # built after the first call, as the README's lazy script does (a lazy module has no parameters before it)
    opt = torch.optim.AdamW(sharded.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    grads = {n: _full(p.grad) for n, p in sharded.named_parameters() if p.grad is not None} if case.bf16 else None
    if case.pipelined:  # torch's clip would see one stage's parameters (docs/design.md)
        norm = autoshard.clip_grad_norm_(sharded, MAX_NORM)
    else:
        norm = torch.nn.utils.clip_grad_norm_(sharded.parameters(), MAX_NORM)
    opt.step()
    opt.zero_grad()
    if case.pipelined:
        params = {n: _full(p) for n, p in sharded.named_parameters()}
    else:
        params = {n: v.detach().clone() for n, v in autoshard.full_state_dict(sharded).items()}
    if case.eval:
        sharded.eval()
        with torch.no_grad():
            loss2 = forward()
    else:
        loss2 = forward()
    out = {"losses": [loss1.detach().float().item(), loss2.detach().float().item()],
           "loss_dtype": loss1.dtype, "norm": _full(norm).item(), "params": params, "grads": grads}
    if case.search_limit:
        report = sharded.plan.context.report["plan_search"]
        out["search"] = {"zero_stages": report["zero_stages"], "recomputed": report["recomputed"],
                         "memory": sharded.plan.cost().memory_per_rank}
    return out


def _cast_floating(tree, dtype):
    return torch.utils._pytree.tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)


def eager_step(name: str, model, args, kwargs, precision: str | None = None) -> dict:
    """The same step on one device: the same clip and AdamW; ``precision`` (default the case's): "mp" is
    MixedPrecision's policy on one device (parameters cast to bf16 for compute, fp32 masters and gradients,
    tests/test_mixed_precision.py's reference), "autocast" eager autocast, "fp32" the plain model."""
    case = CASES[name]
    precision = precision or case.precision
    model = copy.deepcopy(model)

    def forward():
        if precision == "mp":
            params = {n: p.to(torch.bfloat16) for n, p in model.named_parameters()}
            a, k = _cast_floating((args, kwargs), torch.bfloat16)
            return loss_of(torch.func.functional_call(model, params, a, k))
        with torch.autocast("cpu", torch.bfloat16) if precision == "autocast" else nullcontext():
            return loss_of(model(*args, **kwargs))

    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    loss1 = forward()
    loss1.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    opt.zero_grad()
    params = {n: v.detach().clone() for n, v in model.state_dict().items()}
    if case.eval:
        model.eval()
        with torch.no_grad():
            loss2 = forward()
    else:
        loss2 = forward()
    first = {}
    for n, p in model.named_parameters(remove_duplicate=False):  # a tied weight: stepped under its first name
        first.setdefault(id(p), n)
    aliases = {n: first[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    return {"losses": [loss1.detach().float().item(), loss2.detach().float().item()], "loss_dtype": loss1.dtype,
            "norm": norm.item(), "params": params, "grads": grads, "aliases": aliases}


def references(name: str) -> dict:
    """{"want": eager under the case's precision, "fp32": the plain fp32 eager run (bf16 cases)}."""
    _, args, kwargs, eager = build(name)
    out = {"want": eager_step(name, eager, args, kwargs)}
    if CASES[name].bf16:
        out["fp32"] = eager_step(name, eager, args, kwargs, precision="fp32")
    return out


# ---- running the cases -------------------------------------------------------------------------------------
def simulate(name: str) -> list[dict]:
    """Case ``name`` on the simulator's ranks (one thread each); the model built once here, one copy per rank."""
    from autoshard.runtime import SimWorld

    case = CASES[name]
    model, args, kwargs, _ = build(name)
    limit = memory_limit(name)
    world = SimWorld(autoshard.Mesh(**case.mesh), timeout=TIMEOUT)
    copies = [copy.deepcopy(model) for _ in range(WORLD)]
    lock = threading.Lock()
    return world.run(lambda rank: rank_step(name, rank, copies[rank], args, kwargs, comm=world.communicator(rank),
                                            limit=limit, rng_lock=lock))


def gloo_all(rank: int, world_size: int, names: list[str], limits: dict) -> dict:
    """Every case in sequence on this gloo process: {name: ("ok", result) | ("error", traceback text)}."""
    out = {}
    for name in names:
        try:
            model, args, kwargs, _ = build(name)
            out[name] = ("ok", rank_step(name, rank, model, args, kwargs, limit=limits.get(name)))
        except BaseException:  # noqa: BLE001 - every case reports its own failure
            out[name] = ("error", f"rank {rank}: " + traceback.format_exc())
    return out


# ---- comparing -----------------------------------------------------------------------------------------------
def _close(got, want, what, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), rtol=rtol, atol=atol,
                               msg=lambda m: f"{what}: {m}")


def _clipped(grads: dict, norm: float) -> dict:
    coef = min(1.0, MAX_NORM / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s coefficient
    return {n: g * coef for n, g in grads.items()}


def _adam_direction(g: torch.Tensor) -> torch.Tensor:
    return g.double() / (g.double().abs() + 1e-8)  # AdamW's first update is lr times this


def check(name: str, results: list[dict], refs: dict) -> None:
    """Every rank's result of case ``name`` against eager (the module docstring's tolerances)."""
    case = CASES[name]
    want = refs["want"]
    seen: set[str] = set()
    for rank, got in enumerate(results):
        where = f"{name}, rank {rank}"
        if not case.bf16:
            for i in range(2):
                _close(got["losses"][i], want["losses"][i], f"{where}: loss of step {i + 1}")
            _close(got["norm"], want["norm"], f"{where}: clipped total norm")
        else:  # tests/test_autocast.py's bound: E = eager bf16's own error against fp32 (at least one rounding)
            for i in range(2):
                e, f, s = want["losses"][i], refs["fp32"]["losses"][i], got["losses"][i]
                bound = max(abs(e - f), U * abs(f))
                assert abs(s - f) <= 2 * bound and abs(s - e) <= 3 * bound, (
                    f"{where}: loss of step {i + 1} {s} against eager bf16 {e} and fp32 {f}")
        for n, value in got["params"].items():
            assert n in want["params"], f"{where}: parameter {n} is not the model's"
            if not case.bf16:
                _close(value, want["params"][n], f"{where}: {n} after the step")
        seen |= set(got["params"])
    if case.pipelined:  # the stages hold the model's parameters between them
        names = {n for n, _ in build(name)[3].named_parameters()}
        assert names <= seen, sorted(names - seen)
    else:
        assert seen == set(want["params"]), sorted(set(want["params"]) ^ seen)
    if case.bf16:
        _check_bf16(name, results, refs)


def _check_bf16(name: str, results: list[dict], refs: dict) -> None:
    case = CASES[name]
    want, fp32 = refs["want"], refs["fp32"]
    for rank, got in enumerate(results):
        where = f"{name}, rank {rank}"
        grads = got["grads"]
        assert set(grads) == set(want["grads"]), sorted(set(grads) ^ set(want["grads"]))
        if case.precision == "mp":
            from tests.test_mixed_precision import _check_grads

            _check_grads(grads, want["grads"], tol=MP_GRAD_TOL)
        else:  # tests/test_autocast.py's bound: within 3 E of eager autocast, E its own error against fp32
            for n, e in want["grads"].items():
                bound = (e - fp32["grads"][n]).abs().max().item()
                assert (grads[n] - e).abs().max().item() <= 3 * bound, f"{where}: gradient of {n}"
        # the norm the ranks returned is the 2-norm of the gradients they computed
        diff = torch.cat([(grads[n].double() - e.double()).flatten() for n, e in want["grads"].items()]).norm()
        assert abs(got["norm"] - want["norm"]) <= diff.item() + RTOL * want["norm"], (
            f"{where}: norm {got['norm']} against eager {want['norm']}, gradients {diff.item():.3g} apart")
        # AdamW's first step from those gradients (clipped by the norms each side returned)
        mine, theirs = _clipped(grads, got["norm"]), _clipped(want["grads"], want["norm"])
        for n, value in got["params"].items():
            p = want["aliases"].get(n)
            if p is None:  # a buffer: not stepped
                _close(value, want["params"][n], f"{where}: {n}")
                continue
            moved = LR * (_adam_direction(mine[p]) - _adam_direction(theirs[p])).abs()
            err = (value.double() - want["params"][n].double()).abs()
            bound = moved + RTOL * want["params"][n].double().abs() + 1e-6
            assert bool((err <= bound).all()), (
                f"{where}: {n} after the step, {int((err > bound).sum())} elements beyond the update from the "
                f"gradients (worst {(err - bound).max().item():.3g})")


def check_same(name: str, sim: list[dict], real: list[dict]) -> None:
    """The simulator and the real processes ran the same programs: the same results (fp32 rounding apart)."""
    case = CASES[name]
    tol = dict(rtol=2 * U, atol=0) if case.bf16 else {}  # bf16: the same program, reduced in another order
    for rank, (s, r) in enumerate(zip(sim, real)):
        where = f"{name}, rank {rank}, simulator vs processes"
        for i in range(2):
            _close(s["losses"][i], r["losses"][i], f"{where}: loss {i + 1}", **tol)
        if not case.bf16:
            _close(s["norm"], r["norm"], f"{where}: norm")
            assert set(s["params"]) == set(r["params"])
            for n, v in s["params"].items():
                _close(v, r["params"][n], f"{where}: {n}")
