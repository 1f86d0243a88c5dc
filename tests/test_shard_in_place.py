"""``autoshard.shard``: the user's model sharded in place, as FSDP2's ``fully_shard`` (issue 34).

The object stays the user's (same object, a subclass of its class, its methods and attributes), its parameters
become this rank's DTensor shards (no unsharded tensor left in it), and it trains, evaluates and runs new input
shapes equal to the model on one device — in the simulator and on 4 gloo processes, where ``torch.compile`` (of the
model before or after sharding, ``model.compile()``, a compiled block) compiles the rank programs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

import autoshard
from autoshard.errors import AutoshardError
from autoshard.runtime import SimWorld
from examples import models

MESH = autoshard.Mesh(data=2, model=2)


class TinyGPT(models.GPT):
    """The examples' GPT with what a user's model class carries besides forward: a config, methods that read the
    parameters or call the model."""

    def __init__(self):
        super().__init__(vocab=64, hidden=32, heads=4, layers=2, seq=16)
        self.config = {"block_size": 16}

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def scores(self, ids: torch.Tensor) -> torch.Tensor:
        return self(ids, ids)


def _data(batch: int = 4, seq: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (batch, seq), generator=g), torch.randint(0, 64, (batch, seq), generator=g)


def _mine(rank: int, *tensors):
    dp = MESH.coords(rank)["data"]
    return tuple(t.chunk(2)[dp] for t in tensors)


def _sharded_per_rank(**options):
    torch.manual_seed(0)
    model = TinyGPT()
    copies = [copy.deepcopy(model) for _ in range(MESH.size)]  # built outside the rank threads (shared RNG)
    return model, copies


def test_the_users_object_is_sharded_in_place_and_trains_as_on_one_device():
    model, copies = _sharded_per_rank()
    ids, labels = _data()
    loss = model(ids, labels)
    loss.backward()

    def body(rank):
        m = copies[rank]
        n_before = m.num_params()
        wte_before = m.wte.weight
        out = autoshard.shard(m, MESH, example_inputs=_mine(rank, ids, labels), planner="search")
        loss = m(*_mine(rank, ids, labels))
        loss.backward()
        return dict(
            same=out is m, cls=type(m).__name__, isa=isinstance(m, TinyGPT), config=m.config,
            n=(n_before, m.num_params()), replaced=m.wte.weight is not wte_before,
            all_dtensors=all(isinstance(t, DTensor) for t in [*m.parameters(), *m.buffers()]),
            tied=m.head.weight is m.wte.weight, loss=loss.detach(),
            grads={n: p.grad.full_tensor() for n, p in m.named_parameters()},
            names=[n for n, _ in m.named_parameters()], dp=(m.data_parallel_rank, m.data_parallel_size),
            plan=m.autoshard.plan is not None)

    results = SimWorld(MESH, timeout=120).run(body)
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    for rank, r in enumerate(results):
        assert r["same"] and r["isa"] and r["cls"] == "ShardedTinyGPT" and r["config"] == {"block_size": 16}
        assert r["n"][0] == r["n"][1] == model.num_params()  # global sizes, as on the model
        assert r["replaced"] and r["all_dtensors"] and r["tied"] and r["plan"]
        assert r["names"] == [n for n, _ in model.named_parameters()]
        assert r["dp"] == (MESH.coords(rank)["data"], 2)
        torch.testing.assert_close(r["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
        for name, g in ref_grads.items():
            torch.testing.assert_close(r["grads"][name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_new_shapes_eval_and_methods_that_call_the_model_equal_one_device():
    model, copies = _sharded_per_rank()
    ids, labels = _data()
    model.eval()
    ref = {"eval_other_batch": model(*_data(batch=2, seq=16, seed=3)).detach(),
           "short": model(*_data(batch=4, seq=5, seed=4)).detach()}
    refs_grow = [model.scores(ids[:, :t].contiguous()) for t in range(1, 5)]

    def body(rank):
        m = copies[rank]
        autoshard.shard(m, MESH, example_inputs=_mine(rank, ids, labels))
        m(*_mine(rank, ids, labels)).backward()  # the planned shapes, train mode
        m.eval()
        out = {"eval_other_batch": m(*_mine(rank, *_data(batch=2, seq=16, seed=3))).detach(),
               "short": m(*_mine(rank, *_data(batch=4, seq=5, seed=4))).detach()}
        grow = [m.scores(_mine(rank, ids[:, :t].contiguous())[0]) for t in range(1, 5)]  # a generation loop
        m.train()
        again = m(*_mine(rank, ids, labels)).detach()  # back to the first program
        return out, grow, len(m.autoshard._shape_programs), again

    results = SimWorld(MESH, timeout=180).run(body)
    model.train()
    first = model(ids, labels).detach()
    for out, grow, n_programs, again in results:
        for key, value in ref.items():
            torch.testing.assert_close(out[key], value, rtol=1e-5, atol=1e-6)
        for got, want in zip(grow, refs_grow):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert n_programs == 6  # eval at 2 shapes + 4 generation lengths; train mode's program is the plan's own
        torch.testing.assert_close(again, first, rtol=1e-5, atol=1e-6)


def test_many_new_shapes_get_one_short_notice(monkeypatch):
    monkeypatch.setattr(autoshard.ShardedModule, "NEW_SHAPES_WARNING", 2)
    model, copies = _sharded_per_rank()
    ids, labels = _data()

    def body(rank):
        m = copies[rank]
        autoshard.shard(m, MESH, example_inputs=_mine(rank, ids, labels))
        for t in range(2, 5):
            m.scores(_mine(rank, ids[:, :t].contiguous())[0])

    with pytest.warns(UserWarning, match=r"^autoshard: 2 input shapes beyond the example's planned so far") as seen:
        SimWorld(MESH, timeout=180).run(body)
    assert sum("input shapes beyond" in str(w.message) for w in seen) == 1  # rank 0 only, once


def test_load_state_dict_of_whole_tensors_and_the_checkpoint_helpers_take_the_model():
    model, copies = _sharded_per_rank()
    ids, labels = _data()
    torch.manual_seed(5)
    other = TinyGPT().state_dict()
    model.load_state_dict(other)
    ref = model(ids, labels).detach()

    def body(rank):
        m = copies[rank]
        autoshard.shard(m, MESH, example_inputs=_mine(rank, ids, labels))
        m.load_state_dict(other)
        full = autoshard.full_state_dict(m)
        return m(*_mine(rank, ids, labels)).detach(), {k: v.clone() for k, v in full.items()}

    for loss, full in SimWorld(MESH, timeout=120).run(body):
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
        assert full.keys() == other.keys()
        for k, v in other.items():
            torch.testing.assert_close(full[k], v)


def test_what_shard_refuses_names_the_fix():
    model, copies = _sharded_per_rank()
    ids, labels = _data()

    def body(rank):
        m = copies[rank]
        msgs = []
        for call in (lambda: autoshard.shard(m, MESH),
                     lambda: autoshard.shard(m, MESH, example_inputs=_mine(rank, ids, labels),
                                             pipeline=autoshard.Pipeline(microbatches=2))):
            with pytest.raises(AutoshardError) as info:
                call()
            msgs.append(str(info.value))
        autoshard.shard(m, MESH, example_inputs=_mine(rank, ids, labels))
        for call in (lambda: autoshard.shard(m, MESH, example_inputs=_mine(rank, ids, labels)),
                     lambda: m.to(torch.float64), lambda: m.half()):
            with pytest.raises(AutoshardError) as info:
                call()
            msgs.append(str(info.value))
        return msgs

    msgs = SimWorld(MESH, timeout=120).run(body)[0]
    assert "needs example_inputs=" in msgs[0]
    assert "does not cut pipeline stages" in msgs[1] and "autoshard.compile(model, mesh, pipeline=...)" in msgs[1]
    assert "is sharded already" in msgs[2]
    assert "moving or casting them" in msgs[3] and "Move the model before sharding it" in msgs[3]
    assert "moving or casting them" in msgs[4]


def test_gradient_sync_switches_are_checked_alike_on_every_rank():
    model, copies = _sharded_per_rank()
    ids, labels = _data()

    def body(rank):
        m = copies[rank]
        autoshard.shard(m, MESH, example_inputs=_mine(rank, ids, labels))
        m.require_backward_grad_sync = rank != 1  # a rank that forgot no_sync: the next call says so
        m(*_mine(rank, ids, labels))

    with pytest.raises(AutoshardError, match=r"called differently on its ranks; `gradient sync` is True on ranks "
                                             r"0,2,3, False on ranks 1: every rank must"):
        SimWorld(MESH, timeout=60).run(body)


def test_ranks_calling_with_different_shapes_are_told_so():
    model, copies = _sharded_per_rank()
    ids, labels = _data()

    def body(rank):
        m = copies[rank]
        autoshard.shard(m, MESH, example_inputs=_mine(rank, ids, labels))
        seq = 8 if rank == 3 else 16
        m(*_mine(rank, ids[:, :seq].contiguous(), labels[:, :seq].contiguous()))

    with pytest.raises(AutoshardError, match=r"called differently on its ranks; `inputs` is .* on ranks 0-2, .* on "
                                             r"ranks 3"):
        SimWorld(MESH, timeout=60).run(body)


# ---- real processes: torch.compile, every way a user asks for it ------------------------------------------------
def gloo_compile_modes(rank: int, world: int) -> dict:
    """On each of 4 gloo ranks: for each way of compiling, a fresh model sharded in place, 2 training steps
    (forward, backward) and an eval call at another batch size; losses, gradients and dynamo's graph count."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    ids, labels = _data()
    mine = _mine(rank, ids, labels)
    out = {}
    # (compiling first and sharding after, with inductor, is tests/test_example_nanogpt.py's --compile run)
    for mode in ("after", "method", "block", "eager"):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = TinyGPT()
        # aot_eager (the suite's time: tests/test_example_nanogpt.py runs inductor end to end), which also shows that
        # the user's backend is the one the rank programs are compiled with
        autoshard.shard(model, MESH, example_inputs=mine)
        if mode == "after":
            model = torch.compile(model, backend="aot_eager")
        elif mode == "method":
            model.compile(backend="aot_eager")
        elif mode == "block":
            for i, block in enumerate(model.blocks):
                model.blocks.register_module(str(i), torch.compile(block, backend="aot_eager"))
        losses = []
        for _ in range(2):
            loss = model(*mine)
            loss.backward()
            losses.append(loss.detach())
        model.eval()
        evaluated = model(*_mine(rank, *_data(batch=2, seed=3))).detach()
        inner = model._orig_mod if hasattr(model, "_orig_mod") else model
        options = inner.autoshard._compile_options
        backend = None if options is None else options.get("backend", "inductor")
        out[mode] = dict(losses=losses, eval=evaluated, graphs=counters["stats"]["unique_graphs"],
                         backend=getattr(backend, "compiler_name", getattr(backend, "name", backend)),
                         grads={n.replace("_orig_mod.", ""): p.grad.full_tensor() for n, p in model.named_parameters()})
    return out


@pytest.fixture(scope="module")
def compiled_on_real_ranks():
    from autoshard.runtime import spawn

    return spawn(gloo_compile_modes, MESH.size, timeout=420, start_method="forkserver")


@pytest.mark.gloo
@pytest.mark.parametrize("mode", ["after", "method", "block"])
def test_torch_compile_of_the_sharded_model_compiles_the_rank_programs_on_real_ranks(mode, compiled_on_real_ranks):
    torch.manual_seed(0)
    model = TinyGPT()
    ids, labels = _data()
    losses = []
    for _ in range(2):
        loss = model(ids, labels)
        loss.backward()
        losses.append(loss.detach())
    model.eval()
    evaluated = model(*_data(batch=2, seed=3)).detach()
    for r in compiled_on_real_ranks:
        got = r[mode]
        assert got["graphs"] >= 2  # dynamo captured the training program and the eval program
        assert got["backend"] == "aot_eager"
        assert r["eager"]["graphs"] == 0 and r["eager"]["backend"] is None
        for a, b in zip(got["losses"], losses):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["eval"], evaluated, rtol=1e-5, atol=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name: f"{mode} {n}: {m}")


@pytest.mark.parametrize("planner", ["greedy", "search"])
def test_batch_outputs_are_this_ranks_chunk_whatever_layout_computed_them(planner):
    """As with DDP, an output whose dim 0 is the batch comes back as this rank's chunk (the search may compute the
    logits replicated on the data axis; they are then sliced, not returned whole), in training and in eval."""
    from examples.nanogpt.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=4, n_embd=32))
    copies = [copy.deepcopy(model) for _ in range(MESH.size)]
    ids, labels = _data()
    logits, loss = model(ids, labels)

    def body(rank):
        m = copies[rank]
        mine = _mine(rank, ids, labels)
        autoshard.shard(m, MESH, example_inputs=mine, planner=planner)
        train = m(*mine)
        m.eval()
        evaluated = m(*mine)
        sample = m.generate(mine[0][:1, :4], 2, greedy=True)
        return train[0].detach(), train[1].detach(), evaluated[0], sample

    for rank, (train, train_loss, evaluated, sample) in enumerate(SimWorld(MESH, timeout=120).run(body)):
        chunk = _mine(rank, logits.detach())[0]
        torch.testing.assert_close(train, chunk, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(evaluated, chunk, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(train_loss, loss.detach(), rtol=1e-5, atol=1e-6)
        assert sample.shape == (1, 6)


def test_a_hugging_face_model_keeps_its_class_config_and_helpers():
    """A Hugging Face LlamaForCausalLM sharded in place: its config, device/dtype/num_parameters helpers (which read
    the parameters) and its ModelOutput, with this rank's chunk of the logits and the global batch's loss."""
    model, _, kwargs = models.hf_llama(batch=4, seq=16)
    copies = [copy.deepcopy(model) for _ in range(MESH.size)]
    ref = model(**kwargs)

    def body(rank):
        m = copies[rank]
        dp = MESH.coords(rank)["data"]
        mine = {k: v.chunk(2)[dp] for k, v in kwargs.items()}
        autoshard.shard(m, MESH, example_kwargs=mine, planner="search")
        out = m(**mine)
        return (type(m).__name__, m.config.hidden_size, m.dtype, m.num_parameters(), out.loss.detach(),
                out.logits.detach())

    for rank, (name, hidden, dtype, n, loss, logits) in enumerate(SimWorld(MESH, timeout=200).run(body)):
        assert (name, hidden, dtype, n) == ("ShardedLlamaForCausalLM", model.config.hidden_size, torch.float32,
                                            model.num_parameters())
        torch.testing.assert_close(loss, ref.loss.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(logits, ref.logits.detach().chunk(2)[MESH.coords(rank)["data"]], rtol=1e-4,
                                   atol=1e-5)
