"""What the user asks of pipeline parallelism: :class:`Pipeline` (stages, microbatches, schedule, split), and
the bubble of a schedule."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from autoshard.errors import MeshError, PlanError
from autoshard.mesh import Mesh


@dataclass(frozen=True)
class Pipeline:
    """Pipeline options of ``autoshard.compile``.

    ``microbatches``: how many pieces the batch is cut into (must divide it); ``schedule``: ``"gpipe"``,
    ``"1f1b"`` or ``"interleaved"`` (1F1B over ``stages_per_rank`` > 1 stages per rank); ``split``: ``"auto"``
    or the module paths that start stages 1.. (``["transformer.h.2"]``); ``loss_fn(output, target)``: the loss
    of one microbatch (a mean), default the model's own loss (its output, ``.loss`` or first element);
    ``axis``: the mesh axis of the pipeline; ``profile``: the hardware profile that prices the split and the
    stages (None, the default: ``compile``'s ``profile``, the one the plan and ``plan.cost()`` are priced by).
    """

    microbatches: int = 1
    schedule: str = "1f1b"
    split: str | tuple[str, ...] | list[str] = "auto"
    stages_per_rank: int = 1
    loss_fn: Callable | None = field(default=None, compare=False)
    axis: str = "pipe"
    profile: str | None = None

    @classmethod
    def parse(cls, text: str) -> Pipeline:
        """``"microbatches=8,schedule=1f1b,split=transformer.h.2+transformer.h.4"`` → ``Pipeline(...)`` (the CLI's
        ``--pipeline``; ``split`` is ``auto`` or module paths joined by ``+``)."""
        fields: dict = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or key not in ("microbatches", "schedule", "split", "stages_per_rank", "axis", "profile"):
                raise PlanError(f"pipeline options {text!r} have the part {part!r}, but each part is KEY=VALUE with "
                                "KEY one of microbatches, schedule, split, stages_per_rank, axis, profile.")
            if key in ("microbatches", "stages_per_rank"):
                if not value.isdigit():
                    raise PlanError(f"pipeline option {key} is {value!r}, but must be a positive integer.")
                fields[key] = int(value)
            elif key == "split" and value != "auto":
                fields[key] = tuple(v for v in value.split("+") if v)
            else:
                fields[key] = value
        return cls(**fields)

    def check(self, mesh: Mesh) -> None:
        from autoshard.runtime.pipeline import SCHEDULES

        if self.axis not in mesh.names:
            raise MeshError(f"mesh {mesh} has no axis `{self.axis}`, but the pipeline runs on it: add it, e.g. "
                            f"Mesh({self.axis}=2, ...), or pass Pipeline(axis=...).")
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise PlanError(f"Pipeline has microbatches={self.microbatches!r}, but it must be a positive int.")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"Pipeline has schedule={self.schedule!r}, but it must be one of {list(SCHEDULES)}.")
        if isinstance(self.stages_per_rank, bool) or not isinstance(self.stages_per_rank, int) or \
                self.stages_per_rank < 1:
            raise PlanError(f"Pipeline has stages_per_rank={self.stages_per_rank!r}, but it must be a positive int.")
        if self.schedule == "interleaved" and self.stages_per_rank < 2:
            raise PlanError("Pipeline has schedule='interleaved' with stages_per_rank=1, but interleaving needs "
                            "several stages per rank: pass stages_per_rank=2 (or more).")
        stages = mesh.axis_size(self.axis) * self.stages_per_rank
        if self.schedule != "gpipe" and self.microbatches < stages:
            # Schedule1F1B waits for warm-up microbatches that never come when there are fewer than stages.
            raise PlanError(f"Pipeline has {self.microbatches} microbatches for {stages} stages, but schedule "
                            f"{self.schedule!r} needs at least as many microbatches as stages: use "
                            f"microbatches >= {stages} or schedule='gpipe'.")
        if self.schedule == "interleaved" and self.microbatches % mesh.axis_size(self.axis):
            raise PlanError(f"Pipeline has {self.microbatches} microbatches, but the interleaved schedule needs a "
                            f"multiple of the pipe size {mesh.axis_size(self.axis)}.")


def bubble_fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
    """The idle fraction of GPipe and 1F1B with ``stages`` equal ranks: (p - 1) / (m + p - 1); interleaved 1F1B
    with ``virtual`` stages per rank: (p - 1) / (v·m + p - 1)."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


# ---- the plan ---------------------------------------------------------------------------------------------


def microbatches_in_flight(schedule: str, microbatches: int, stages: int, stage: int) -> tuple[int, int]:
    """(at its first backward, at its later ones) the microbatches stage ``stage`` of ``stages`` holds in flight:
    GPipe all of them, then one fewer each time; 1F1B ``stages - stage`` (at most all), kept while more microbatches
    remain to start (its steady state), else one fewer (0: a single microbatch, no later backward)."""
    first = microbatches if schedule == "gpipe" else min(microbatches, stages - stage)
    later = first if schedule != "gpipe" and microbatches > first else first - 1
    return first, later
