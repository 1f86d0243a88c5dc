"""The user's Mixture-of-Experts options: :class:`MoE` (which dense FFNs become MoE layers, and how) and
:func:`capacity_of` (the static expert capacity those options give a routing group).

``autoshard.compile(model, mesh, example_inputs, moe=autoshard.MoE(layers="blocks.*.mlp", every=2, ...))`` hands
these options to ``passes/expert_rewrite.py``, which reads them and never rewrites them.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from dataclasses import dataclass

from autoshard.errors import PlanError
from autoshard.runtime.moe.routing import capacity

__all__ = ["MoE", "capacity_of"]


@dataclass(frozen=True)
class MoE:
    """Which dense FFNs become Mixture-of-Experts layers, and how.

    ``layers``: a glob over module paths (``"transformer.h.*.mlp"``) or an explicit list of paths. ``every``: of
    the matched layers in graph order, rewrite those with ``(index + 1) % every == 0`` (``every=2``: the 2nd, 4th,
    ...; Switch/GShard's every other layer). ``init``: ``"upcycle"`` copies the dense FFN into every expert (plus
    Gaussian ``noise`` times each weight's std), ``"random"`` draws fresh weights like ``nn.Linear``. The router
    (float32 even when the model is not) is drawn from ``N(0, router_std²)`` with ``seed``.
    ``expert_axis``: the mesh axis the experts are sharded over (when the mesh has it). ``groups``: routing groups
    (default: the size of the expert axis, one per data rank). ``capacity_factor=None``: dropless (capacity = every
    token of a group, so nothing is ever dropped).

    ``existing=True``: the model already has sparse-MoE blocks (Hugging Face Mixtral, Qwen2-MoE, others on
    transformers' experts interface; :mod:`autoshard.frontend.hf_blocks`): nothing is created, the blocks' own router,
    experts and auxiliary loss are kept, and their experts run sharded over ``expert_axis`` with all-to-all
    dispatch. Only ``expert_axis``, ``capacity_factor``, ``groups`` and (to pick some blocks) ``layers``/``every``
    apply; the expert count, top-k and losses are the model's.
    """

    layers: str | tuple[str, ...] = "*.mlp"
    every: int = 1
    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float | None = 1.25
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 1e-3
    expert_axis: str = "data"
    init: str = "upcycle"  # upcycle | random
    noise: float = 0.0
    router_std: float = 0.02
    seed: int = 0
    groups: int | None = None
    existing: bool = False

    def __post_init__(self):
        if isinstance(self.layers, list):
            object.__setattr__(self, "layers", tuple(self.layers))
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise PlanError(f"MoE num_experts has {self.num_experts!r}, but must be an int >= 1. Use e.g. 8.")
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.num_experts:
            raise PlanError(f"MoE top_k has {self.top_k!r}, but must lie in [1, num_experts={self.num_experts}]. "
                            "Use top_k=1 (Switch) or top_k=2 (GShard) with at least that many experts.")
        cf = self.capacity_factor
        if not isinstance(self.existing, bool):
            raise PlanError(f"MoE existing has {self.existing!r}, but must be True (the model's own MoE blocks) or "
                            "False (turn dense FFNs into MoE layers).")
        if self.existing:
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            own = [name for name in ("num_experts", "top_k", "init", "noise", "router_std", "seed", "aux_loss_weight",
                                     "z_loss_weight") if getattr(self, name) != defaults[name]]
            if own:
                raise PlanError(f"MoE(existing=True) has {', '.join(f'{n}={getattr(self, n)!r}' for n in own)}, but "
                                "with existing=True the expert count, top-k, router and auxiliary losses are the "
                                "model's own. Leave them out; set only expert_axis, capacity_factor (None: "
                                "dropless), groups, layers/every.")
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float))
                               or not (math.isfinite(cf) and cf > 0)):
            raise PlanError(f"MoE capacity_factor has {cf!r}, but must be a finite number > 0, or None (dropless). "
                            "Use 1.0-2.0 for training (1.25 is common), None to drop nothing.")
        if not isinstance(self.every, int) or self.every < 1:
            raise PlanError(f"MoE every has {self.every!r}, but must be an int >= 1 (2: every other layer).")
        if self.init not in ("upcycle", "random"):
            raise PlanError(f"MoE init has {self.init!r}, but must be 'upcycle' (copy the dense FFN into every "
                            "expert) or 'random'.")
        if self.groups is not None and (not isinstance(self.groups, int) or self.groups < 1):
            raise PlanError(f"MoE groups has {self.groups!r}, but must be None (one per expert-axis rank) or an "
                            "int >= 1.")

    @classmethod
    def parse(cls, text: str) -> MoE:
        """``"layers=blocks.*.mlp,every=2,num_experts=8,top_k=2"`` → ``MoE(...)`` (the CLI's ``--moe``; an explicit
        list of layers is joined by ``+``)."""
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        fields: dict = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = (s.strip() for s in part.partition("="))
            if not sep or key not in types:
                raise PlanError(f"MoE options {text!r} have the part {part!r}, but each part is KEY=VALUE with KEY "
                                f"one of {', '.join(types)}.")
            if key == "layers":
                fields[key] = tuple(value.split("+")) if "+" in value else value
            elif key in ("every", "num_experts", "top_k", "seed", "groups"):
                if not value.lstrip("-").isdigit():
                    raise PlanError(f"MoE option {key} is {value!r}, but must be an integer.")
                fields[key] = int(value)
            elif key == "existing":
                if value.lower() not in ("true", "false", "1", "0"):
                    raise PlanError(f"MoE option existing is {value!r}, but must be true or false.")
                fields[key] = value.lower() in ("true", "1")
            elif key == "capacity_factor" and value.lower() == "none":
                fields[key] = None
            elif key in ("capacity_factor", "aux_loss_weight", "z_loss_weight", "noise", "router_std"):
                try:
                    fields[key] = float(value)
                except ValueError:
                    raise PlanError(f"MoE option {key} is {value!r}, but must be a number.") from None
            else:
                fields[key] = value
        return cls(**fields)

    def select(self, paths: list[str]) -> list[str]:
        """The module paths (from ``paths``, in graph order) this option rewrites."""
        if isinstance(self.layers, str):
            matched = [p for p in paths if fnmatch.fnmatchcase(p, self.layers)]
        else:
            matched = [p for p in paths if p in self.layers]
            missing = [p for p in self.layers if p not in paths]
            if missing:
                raise PlanError(f"MoE layers names {missing}, but the model has no module at that path. Module "
                                f"paths look like: {', '.join(paths[:6])}, ...")
        if not matched:
            raise PlanError(f"MoE layers={self.layers!r} matches no module of the model, but must match at least "
                            f"one FFN. Module paths look like: {', '.join(paths[:6])}, ...")
        return [p for i, p in enumerate(matched) if (i + 1) % self.every == 0]


def capacity_of(tokens_per_group: int, options: MoE) -> int:
    """Slots per expert per routing group of ``tokens_per_group`` tokens under ``options``
    (:func:`autoshard.runtime.moe.routing.capacity`); ``capacity_factor=None`` (dropless): every token of the group."""
    if options.capacity_factor is None:
        return tokens_per_group
    return capacity(tokens_per_group, options.num_experts, options.top_k, options.capacity_factor)
