"""One test per user-facing error message of the compiler and its API: trace, mesh, placements, annotations,
options, propagation, the pass driver, ShardedModule, and a mesh that does not match the process group.

Each test asserts the three parts a message must have (STYLE.md "Errors"): the subject (the node, option,
annotation or input, by name), the cause ("has X, but Y"), and the next step. Warnings that keep a run going
(unsupported op replicated, indivisible batch) are checked together with the numbers they still produce.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from autoshard.passes.manager import run_passes
from autoshard.passes.prepare import MarkRequiresGrad, SeedSpecs
from autoshard.passes.propagate import Propagate
from torch import nn

import autoshard
from autoshard.compiler.context import Context, Options
from autoshard.errors import AutoshardError, MeshError, PlanError, RuntimeShapeError, TraceError, UnsupportedOpError
from autoshard.mesh import Mesh, as_mesh
from autoshard.compiler.ops import rule_for
from autoshard.placements import Partial, Replicate, Shard, parse_placement
from autoshard.compiler.plan import loss_of
from autoshard.runtime import SimWorld, spawn, use
from autoshard.frontend.trace import trace

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------
class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(x)


class Flipping(nn.Module):
    """A linear layer, then torch.renorm (no sharding rule) over the batch dim inside a submodule."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Module()
        self.inner.fc = nn.Linear(8, 4)
        self.block = FlipBlock()

    def forward(self, x):
        h = self.inner.fc(x)
        return (self.block(h) * (torch.arange(4) - 1.5)).square().mean()


class FlipBlock(nn.Module):
    def forward(self, h):
        return torch.renorm(h, 2, 0, 1.0)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: torch.export cannot trace it
            return self.fc(x)
        return -self.fc(x)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return self.down(F.gelu(self.up(x))).square().mean()


def _x(batch: int = 8) -> torch.Tensor:
    return torch.randn(batch, 8, generator=torch.Generator().manual_seed(0))


def _eager(model, x):
    model.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_close(actual, expected, where: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")


def _check_simulation(model, plan, x):
    ref_loss, ref_grads = _eager(model, x)
    sim = plan.simulate((x,))
    for rank, out in enumerate(sim.outputs):
        _assert_close(loss_of(out).detach(), ref_loss, f"loss on rank {rank}")
    assert set(sim.grads) == set(ref_grads)
    for name, g in sim.grads.items():
        _assert_close(g, ref_grads[name], f"grad {name}")


def _line_of(func, text: str) -> int:
    lines, start = inspect.getsourcelines(func)
    return start + next(i for i, line in enumerate(lines) if text in line)


# ---------------------------------------------------------------------------------------------------------
# Unsupported ops
# ---------------------------------------------------------------------------------------------------------
def test_unsupported_op_names_op_node_module_and_source_line():
    assert rule_for(aten.renorm.default) is None, "pick another op without a rule for this test"
    line = _line_of(FlipBlock.forward, "torch.renorm")
    with pytest.raises(UnsupportedOpError) as info:
        autoshard.compile(Flipping(), Mesh(data=2), (_x(),), on_unsupported="error")
    msg = str(info.value)
    assert "node `renorm` (aten.renorm.default)" in msg  # subject: node and op
    assert "in module `block`" in msg  # where in the model
    assert re.search(rf'test_errors\.py", line {line}\b', msg), msg  # the user's source line
    assert "has no sharding rule" in msg  # cause
    # the two ways out
    assert "autoshard/compiler/ops (op(..., rule=...))" in msg and "on_unsupported='replicate'" in msg


@pytest.mark.parametrize("planner", ["greedy", "search"])
def test_unsupported_op_replicated_on_request_warns_and_stays_correct(planner):
    model = Flipping()
    x = _x()
    with pytest.warns(UserWarning, match=r"(?s)1 op\(s\) have no sharding rule and run replicated.*node `renorm` "
                                         r"\(aten\.renorm\.default\) in module `block`"):
        sm = autoshard.compile(model, Mesh(data=2), (x,), on_unsupported="replicate", planner=planner)
    _check_simulation(model, sm.plan, x)


def test_invalid_on_unsupported_option():
    with pytest.raises(PlanError, match=r"^option on_unsupported is 'ignore', but must be 'error' or 'replicate'\.$"):
        autoshard.compile(Mlp(), Mesh(data=2), (_x(),), on_unsupported="ignore")


# ---------------------------------------------------------------------------------------------------------
# Other options of compile
# ---------------------------------------------------------------------------------------------------------
def test_invalid_planner_option():
    with pytest.raises(PlanError, match=r"^option planner is 'fast', but must be 'search' or 'greedy'\.$"):
        autoshard.compile(Mlp(), Mesh(data=2), (_x(),), planner="fast")


def test_invalid_optimizer_option():
    with pytest.raises(PlanError, match=r"^option optimizer is 'lion', but must be one of adam, adamw, sgd, "):
        autoshard.compile(Mlp(), Mesh(data=2), (_x(),), optimizer="lion")


def test_invalid_data_axis_option():
    with pytest.raises(PlanError, match=r"^option data_axis is 0, but must be a mesh axis name such as 'data'\.$"):
        autoshard.compile(Mlp(), Mesh(data=2), (_x(),), data_axis=0)


def test_invalid_memory_limit_option():
    with pytest.raises(PlanError, match=r"^memory_limit is 'lots', but must be a number of bytes or text like "
                                        r"'2GiB'"):
        autoshard.compile(Mlp(), Mesh(data=2), (_x(),), memory_limit="lots")


# ---------------------------------------------------------------------------------------------------------
# Annotations and placements
# ---------------------------------------------------------------------------------------------------------
def test_annotation_with_indivisible_dim():
    with pytest.raises(PlanError) as info:
        autoshard.compile(Head(), Mesh(model=2), (_x(),), annotations={"fc.weight": (Shard(0),)})
    msg = str(info.value)
    assert msg.startswith("annotation 'fc.weight' on `")  # subject
    assert "has dim 0 of size 3 sharded on axis `model` of size 2, but 3 is not divisible by 2" in msg  # cause
    assert msg.endswith("shard another dim or use Replicate().")  # fix


def test_annotation_naming_no_parameter_lists_examples():
    with pytest.raises(PlanError) as info:
        autoshard.compile(Mlp(), Mesh(model=2), (_x(),), annotations={"up.wieght": (Shard(0),)})
    msg = str(info.value)
    assert msg.startswith("annotation 'up.wieght' names no parameter or input of the model")
    assert "but every annotation must match at least one" in msg
    assert "Parameters look like: up.weight, up.bias, down.weight, down.bias" in msg
    assert "inputs are ['x']" in msg


def test_placement_dim_out_of_range():
    with pytest.raises(PlanError) as info:
        autoshard.compile(Head(), Mesh(model=2), (_x(),), annotations={"fc.weight": (Shard(5),)})
    msg = str(info.value)
    assert msg.startswith("annotation 'fc.weight' on `")
    assert "has Shard(5) on axis `model`, but the tensor has shape [3, 8] (2 dims)" in msg
    assert msg.endswith("use a dim in [-2, 1].")


def test_placement_tuple_of_wrong_length():
    with pytest.raises(PlanError) as info:
        autoshard.compile(Mlp(), Mesh(data=2, model=2), (_x(),), annotations={"up.weight": (Shard(0),)})
    msg = str(info.value)
    assert msg.startswith("annotation 'up.weight' on `")
    assert ("has a placement tuple of length 1, but mesh Mesh(data=2, model=2) has 2 axes ['data', 'model']"
            in msg)
    assert msg.endswith("give one placement per axis, e.g. (Replicate(), Shard(0)).")


def test_annotation_that_is_not_a_tuple():
    with pytest.raises(PlanError, match=r"^annotation 'up\.weight' has 'S\(0\)', but must be a tuple with one "
                                        r"placement per mesh axis \['data', 'model'\], e\.g\. \(Replicate\(\), "
                                        r"Shard\(0\)\)\.$"):
        autoshard.compile(Mlp(), Mesh(data=2, model=2), (_x(),), annotations={"up.weight": "S(0)"})


def test_same_dim_sharded_on_two_axes():
    with pytest.raises(PlanError) as info:
        autoshard.compile(Mlp(), Mesh(data=2, model=2), (_x(),), annotations={"up.weight": (Shard(0), Shard(0))})
    msg = str(info.value)
    assert msg.startswith("annotation 'up.weight' on `")
    assert "shards dim 0 on both axes `data` and `model`" in msg
    assert msg.endswith("but a dim may be sharded on one mesh axis only.")


def test_placement_that_is_not_a_placement():
    with pytest.raises(PlanError) as info:
        autoshard.compile(Mlp(), Mesh(model=2), (_x(),), annotations={"up.weight": (42,)})
    msg = str(info.value)
    assert msg.startswith("annotation 'up.weight' on `")
    assert msg.endswith("has placement 42 on axis `model`, but placements are Shard(d), Replicate() or Partial().")


def test_partial_annotation_on_a_parameter_is_refused():
    with pytest.raises(PlanError) as info:
        autoshard.compile(Mlp(), Mesh(model=2), (_x(),), annotations={"up.bias": (Partial(),)})
    msg = str(info.value)
    assert msg.startswith("annotation 'up.bias' on `")
    assert "has Partial(), but a parameter cannot be Partial" in msg
    assert msg.endswith("use Shard(d) or Replicate().")


def test_placement_text_that_does_not_parse():
    with pytest.raises(PlanError, match=r"^placement text 'X\(1\)' is not one of R, P, S\(d\) \(or Replicate\(\), "
                                        r"Partial\(\), Shard\(d\)\)\.$"):
        autoshard.compile(Mlp(), Mesh(model=2), (_x(),), annotations={"up.weight": ("X(1)",)})
    assert parse_placement("S(1)") == Shard(1) and parse_placement("R") == Replicate()
    assert parse_placement("P") == Partial()


# ---------------------------------------------------------------------------------------------------------
# Meshes
# ---------------------------------------------------------------------------------------------------------
def test_mesh_without_axes():
    with pytest.raises(MeshError, match=r"^Mesh has no axes, but needs at least one\. Write e\.g\. "
                                        r"Mesh\(data=2, model=2\)\.$"):
        Mesh()


def test_mesh_with_duplicate_axis():
    with pytest.raises(MeshError, match=r"^Mesh axis `data` is given twice\. Give each axis once\.$"):
        Mesh((("data", 2), ("data", 2)))


@pytest.mark.parametrize("size", [0, -1, 2.0, True])
def test_mesh_axis_size_not_positive_int(size):
    with pytest.raises(MeshError, match=rf"^Mesh axis `data` has size {re.escape(repr(size))}, but sizes are "
                                        r"positive integers\.$"):
        Mesh(data=size)


def test_mesh_axis_name_not_identifier():
    with pytest.raises(MeshError, match=r"^Mesh axis name '2d' is not an identifier\. Use names like 'data', "
                                        r"'model'\.$"):
        Mesh({"2d": 2})


def test_mesh_text_that_does_not_parse():
    with pytest.raises(MeshError, match=r"^Mesh text 'data=x' has the part 'data=x', but each part is NAME=SIZE\.$"):
        Mesh.parse("data=x")
    assert Mesh.parse("data=2, model=2") == Mesh(data=2, model=2)


def test_mesh_of_wrong_type():
    with pytest.raises(MeshError, match=r"^mesh has type int, but must be autoshard\.Mesh, DeviceMesh or a dict "):
        autoshard.compile(Mlp(), 4, (_x(),))
    assert as_mesh({"data": 2}) == Mesh(data=2)


def test_device_mesh_without_names():
    with pytest.raises(MeshError, match=r"^DeviceMesh has no mesh_dim_names, but autoshard needs named axes\. "
                                        r"Create it with init_device_mesh\(.*mesh_dim_names="):
        Mesh.from_device_mesh(SimpleNamespace(mesh_dim_names=None, mesh=torch.zeros(2, 2)))


def test_mesh_axis_that_does_not_exist():
    with pytest.raises(MeshError, match=r"^Mesh Mesh\(data=2\) has no axis `model`; its axes are \['data'\]\.$"):
        Mesh(data=2).axis_size("model")
    with pytest.raises(MeshError, match=r"^Mesh Mesh\(data=2\) has 1 axes, but axis index 3 was asked for\.$"):
        Mesh(data=2).index(3)


def test_rank_outside_mesh():
    with pytest.raises(MeshError, match=r"^Rank 4 is outside mesh Mesh\(data=2, model=2\) of 4 ranks \(0\.\.3\)\.$"):
        autoshard.compile(Mlp(), Mesh(data=2, model=2), (_x(),)).code(rank=4)


def wrong_mesh(rank: int, world_size: int) -> None:
    from autoshard.runtime.dist import DistCommunicator

    DistCommunicator(Mesh(data=2, model=2))  # 4 ranks on a world of 2


@pytest.mark.gloo
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo")
def test_mesh_larger_than_the_process_group():
    with pytest.raises(MeshError) as info:
        spawn(wrong_mesh, 2, timeout=30, start_method="forkserver")
    msg = str(info.value)
    assert "mesh Mesh(data=2, model=2) has 4 ranks, but the process group has world size 2" in msg
    assert "launch 4 processes (torchrun --nproc-per-node 4) or use a mesh whose axis sizes multiply to 2" in msg


def test_dist_communicator_without_process_group():
    from autoshard.runtime.dist import DistCommunicator

    assert not dist.is_initialized()
    with pytest.raises(MeshError, match=r"^DistCommunicator for mesh Mesh\(data=2\) needs torch\.distributed, but "
                                        r"no process group is initialised: call torch\.distributed\."
                                        r"init_process_group"):
        DistCommunicator(Mesh(data=2))


def test_sharded_module_called_without_process_group_or_simulator():
    sm = autoshard.compile(Mlp(), Mesh(data=2), (_x(),))
    assert not dist.is_initialized()
    with pytest.raises(MeshError, match=r"^mesh Mesh\(data=2\) has 2 ranks, but torch\.distributed is not "
                                        r"initialised\. Launch with torchrun .* or run the plan in the simulator "):
        sm(_x(4))


# ---------------------------------------------------------------------------------------------------------
# Tracing
# ---------------------------------------------------------------------------------------------------------
def test_untraceable_model_names_class_and_fix():
    with pytest.raises(TraceError) as info:
        autoshard.compile(Branchy(), Mesh(data=2), (_x(),))
    msg = str(info.value)
    assert msg.startswith("model Branchy could not be traced by torch.export (strict=False): ")  # subject, cause
    assert "remove data-dependent Python control flow (branches on tensor values, .item())" in msg  # fix
    assert isinstance(info.value.__cause__, Exception)  # torch.export's own error stays attached


def test_model_that_is_not_a_module():
    with pytest.raises(TraceError, match=r"^model has type function, but autoshard traces torch\.nn\.Module "
                                         r"instances\.$"):
        trace(lambda x: x + 1, (_x(),))


# ---------------------------------------------------------------------------------------------------------
# ShardedModule: lazy compilation and runtime shapes
# ---------------------------------------------------------------------------------------------------------
def test_lazy_module_parameters_before_first_call():
    sm = autoshard.compile(Mlp(), Mesh(data=2))
    with pytest.raises(AutoshardError, match=r"^ShardedModule has no parameters before its first call \(the plan "
                                             r"decides how they are sharded\)\. Call it once with a batch before "
                                             r"building the optimizer, or pass example_inputs= "):
        sm.parameters()


def test_lazy_module_plan_before_first_call():
    sm = autoshard.compile(Mlp(), Mesh(data=2))
    with pytest.raises(AutoshardError, match=r"^this ShardedModule has no plan yet: it compiles on its first call\. "
                                             r"Call it once with a batch, or pass example_inputs= "):
        sm.code(0)


def test_runtime_input_of_wrong_shape():
    # each rank is compiled for a local batch of 4; new_shapes="error": not planned for another (the default plans)
    sm = autoshard.compile(Mlp(), Mesh(data=2), (_x(8),), new_shapes="error")
    world = SimWorld(Mesh(data=2), timeout=10)
    with use(world.communicator(0)), pytest.raises(RuntimeShapeError) as info:
        sm(_x(3))
    msg = str(info.value)
    assert msg.startswith("input `x` has local shape [3, 8], but the plan was compiled for [4, 8] on this rank.")
    assert "pad or batch to the compiled shape, or compile a new ShardedModule for the new shape" in msg


def test_batch_not_divisible_by_data_axis_warns_and_stays_correct():
    model = Mlp()
    x = _x(3)
    with pytest.warns(UserWarning, match=r"^input `x` has batch size 3, not divisible by axis `data` of size 2: it "
                                         r"is replicated on that axis \(every rank passes the whole batch\)\.$"):
        sm = autoshard.compile(model, Mesh(data=2), (x,))
    _check_simulation(model, sm.plan, x)


def test_data_shard_of_indivisible_batch():
    with pytest.raises(PlanError, match=r"^batch of size 3 is not divisible by axis `data` of size 2: use a global "
                                        r"batch that is a multiple of 2\.$"):
        autoshard.data_shard(_x(3), Mesh(data=2), rank=0)


def test_output_without_a_loss():
    with pytest.raises(AutoshardError, match=r"^output of type dict has no loss: return a scalar tensor, a tuple "
                                             r"whose first element is the loss, or an object with a \.loss "):
        loss_of({"logits": torch.zeros(2)})


# ---------------------------------------------------------------------------------------------------------
# The pass driver
# ---------------------------------------------------------------------------------------------------------
class _Broken:
    name = "broken"

    def run(self, gm, ctx):
        raise ValueError("something inside the pass")


def test_pass_failure_names_the_pass_and_those_before_it():
    gm = trace(Mlp(), (_x(),))
    with pytest.raises(AutoshardError, match=r"^An error occurred when running the 'broken' pass after the "
                                             r"following passes: \['seed_specs', 'mark_requires_grad', 'propagate'\]: "
                                             r"ValueError: something inside the pass$") as info:
        run_passes(gm, Context(Mesh(data=2), Options()), passes=(SeedSpecs(), MarkRequiresGrad(), Propagate(),
                                                                  _Broken()))
    assert isinstance(info.value.__cause__, ValueError)


def test_the_verifier_keeps_checking_rank_programs():
    """After localize a rank program still carries specs and strategies: a rank pass that leaves a consumer reading
    an input in another spec than its strategy needs is caught and named."""
    from autoshard import meta as M
    from autoshard.compiler.collective_kinds import kind_of
    from autoshard.passes.manager import verify

    program = autoshard.compile(Mlp(), Mesh(data=2, model=2), (_x(),)).plan.rank_program(1)
    ran = list(program.meta[M.PASSES_RUN])
    assert "localize" in ran
    verify(program, ran)
    node, x = next((n, x) for n in program.graph.nodes if M.STRATEGY in n.meta and kind_of(n) is None
                   for x, want in zip(n.all_input_nodes, n.meta[M.STRATEGY].input_specs) if want is not None)
    x.meta[M.SPEC] = (Partial(), Partial())
    with pytest.raises(AutoshardError, match=rf"^pass 'spoil' left node `{node.name}` \(.*\) reading input 0 "
                                             rf"`{x.name}` as \(Partial\(.*\), but its strategy needs .*'localize'"):
        verify(program, ran + ["spoil"])


def test_untraceable_model_error_names_the_source_line_and_stays_short():
    import traceback

    with pytest.raises(TraceError) as info:
        autoshard.compile(Branchy(), Mesh(data=2), (_x(),))
    err = info.value
    msg = str(err)
    line = next(n for n, text in enumerate(Path(__file__).read_text().splitlines(), 1) if "if x.sum() > 0:" in text)
    # the model's own line (file:line and code) and torch.export's one-line cause
    assert f"{__file__}:{line} in forward, `if x.sum() > 0:" in msg, msg
    assert "`, raised GuardOnDataDependentSymNode: Could not guard on data-dependent expression" in msg, msg
    assert "\n" not in msg
    # printed without its chain: a few lines, ending at the model's line, none of torch's internal frames
    own = "".join(traceback.format_exception(err, chain=False))
    assert len(own.splitlines()) <= 25, own
    assert "site-packages/torch" not in own and own.splitlines()[-3].strip().startswith("if x.sum() > 0:"), own
    # the cause is kept (torch.export's own exception, with only the model's frames) and so is the full text
    assert type(err.__cause__).__name__ == "GuardOnDataDependentSymNode"
    printed = "".join(traceback.format_exception(err))
    assert len(printed.splitlines()) < 80 and "site-packages/torch" not in printed, printed
    assert "symbolic_shapes.py" in err.export_traceback
