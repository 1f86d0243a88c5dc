"""Logical device meshes: ordered named axes with sizes, no process group needed.

Ranks are laid out row-major over the axes in the order given (the layout of
``torch.distributed.device_mesh.DeviceMesh``), so ``Mesh(data=2, model=2)`` puts ranks 0,1 in the same
data-slice and ranks 0,2 in the same model-slice::

    >>> m = Mesh(data=2, model=2)
    >>> m.coords(3), m.group_of(1, "model"), m.group_of(1, "data")
    ({'data': 1, 'model': 1}, (0, 1), (1, 3))
"""

from __future__ import annotations

import itertools
import functools
import math
from dataclasses import dataclass

from autoshard.errors import MeshError


@dataclass(frozen=True)
class Mesh:
    """Named mesh axes and their sizes, e.g. ``Mesh(data=2, model=2)``."""

    axes: tuple[tuple[str, int], ...]

    def __init__(self, axes: dict[str, int] | tuple[tuple[str, int], ...] | None = None, **sizes: int):
        items = tuple((axes or {}).items()) if isinstance(axes, dict) else tuple(axes or ())
        items = items + tuple(sizes.items())
        if not items:
            raise MeshError("Mesh has no axes, but needs at least one. Write e.g. Mesh(data=2, model=2).")
        seen = set()
        for name, size in items:
            if not isinstance(name, str) or not name.isidentifier():
                raise MeshError(f"Mesh axis name {name!r} is not an identifier. Use names like 'data', 'model'.")
            if name in seen:
                raise MeshError(f"Mesh axis `{name}` is given twice. Give each axis once.")
            seen.add(name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise MeshError(f"Mesh axis `{name}` has size {size!r}, but sizes are positive integers.")
        object.__setattr__(self, "axes", items)

    @classmethod
    def parse(cls, text: str) -> Mesh:
        """``"data=2,model=2"`` → ``Mesh(data=2, model=2)`` (the CLI's ``--mesh``)."""
        items = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, size = part.partition("=")
            if not sep or not size.strip().isdigit():
                raise MeshError(f"Mesh text {text!r} has the part {part!r}, but each part is NAME=SIZE.")
            items.append((name.strip(), int(size)))
        return cls(tuple(items))

    @classmethod
    def from_device_mesh(cls, device_mesh) -> Mesh:
        names = device_mesh.mesh_dim_names
        if names is None:
            raise MeshError("DeviceMesh has no mesh_dim_names, but autoshard needs named axes. "
                            "Create it with init_device_mesh(..., mesh_dim_names=('data', 'model')).")
        return cls(tuple(zip(names, device_mesh.mesh.shape)))

    # ---- shape -------------------------------------------------------------------------------------------
    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    @functools.cached_property
    def shape(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.axes)

    @property
    def ndim(self) -> int:
        return len(self.axes)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, axis: str | int) -> int:
        return self.shape[self.index(axis)]

    def index(self, axis: str | int) -> int:
        if isinstance(axis, int):
            if not 0 <= axis < self.ndim:
                raise MeshError(f"Mesh {self} has {self.ndim} axes, but axis index {axis} was asked for.")
            return axis
        try:
            return self.names.index(axis)
        except ValueError:
            raise MeshError(f"Mesh {self} has no axis `{axis}`; its axes are {list(self.names)}.") from None

    # ---- ranks -------------------------------------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        self._check_rank(rank)
        out = {}
        for name, size in reversed(self.axes):
            out[name] = rank % size
            rank //= size
        return {n: out[n] for n in self.names}

    def rank_of(self, coords: dict[str, int]) -> int:
        rank = 0
        for name, size in self.axes:
            rank = rank * size + coords[name]
        return rank

    def group_of(self, rank: int, axis: str) -> tuple[int, ...]:
        """The ranks that share every coordinate with ``rank`` except along ``axis``, in axis order."""
        c = self.coords(rank)
        return tuple(self.rank_of({**c, axis: i}) for i in range(self.axis_size(axis)))

    def groups(self, axis: str) -> list[tuple[int, ...]]:
        """Every group along ``axis`` (what ``new_group`` must be called with, in the same order on all ranks)."""
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.size):
            seen.setdefault(self.group_of(r, axis), None)
        return list(seen)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.size:
            raise MeshError(f"Rank {rank} is outside mesh {self} of {self.size} ranks (0..{self.size - 1}).")

    def to_device_mesh(self, device_type: str = "cpu"):
        """The ``DeviceMesh`` of this logical mesh over the current process group."""
        from torch.distributed.device_mesh import init_device_mesh

        dm = init_device_mesh(device_type, self.shape, mesh_dim_names=self.names)
        if dm.ndim > 1:
            # A value Partial over every axis (the 2-norm of gradients that are partial on data and on model) is
            # then reduced by one all-reduce over the flattened axis, not one per axis in turn (DTensor looks the
            # flattened mesh up by its layout; torchtitan flattens its meshes for the same reason).
            dm._flatten()
        return dm

    def __iter__(self):
        return iter(itertools.product(*(range(s) for s in self.shape)))

    def __str__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in self.axes) + ")"

    __repr__ = __str__


def as_mesh(mesh) -> Mesh:
    """Accept a :class:`Mesh`, a ``DeviceMesh`` or a dict of axis sizes."""
    if isinstance(mesh, Mesh):
        return mesh
    if isinstance(mesh, dict):
        return Mesh(mesh)
    if type(mesh).__name__ == "DeviceMesh":
        return Mesh.from_device_mesh(mesh)
    raise MeshError(f"mesh has type {type(mesh).__name__}, but must be autoshard.Mesh, DeviceMesh or a dict "
                    "of axis sizes such as {'data': 2, 'model': 2}.")
