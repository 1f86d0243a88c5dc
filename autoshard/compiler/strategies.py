"""From a rule's :class:`~autoshard.compiler.ops.dimmap.DimMap` to every valid strategy of an op on a mesh.

Each mesh axis independently picks one option:

* ``R``: nothing sharded on this axis;
* ``S(label)``: every operand dim carrying ``label`` is ``Shard`` on the axis; the output is ``Shard`` along the
  label's output dim, or ``Partial`` when the label is contracted (absent from the output);
* ``P``: a Partial input flows through a linear op (all linear inputs for ``"sum"`` ops, any one of them for
  ``"multi"`` ops), giving a Partial output.

A strategy is one option per axis such that no label is sharded on two axes, and every sharded operand dim is
divisible by the axis size. The engine is the only place that turns labels into placements
(:func:`strategies_for`); ``tests/test_rules.py`` checks every strategy of every rule numerically.
"""

from __future__ import annotations

import itertools

from autoshard.mesh import Mesh
from autoshard.meta import Strategy
from autoshard.compiler.ops.dimmap import DimMap
from autoshard.placements import Partial, Replicate, Shard, Spec


def _axis_options(dm: DimMap, in_shapes, out_shapes, size: int) -> list[tuple]:
    options: list[tuple] = [("R",)]
    if dm.replicate_only or size == 1:
        return options
    order: list[str] = []
    for labels in list(dm.inputs) + list(dm.outputs):
        for lab in labels or ():
            if lab is not None and lab not in order:
                order.append(lab)
    for lab in order:
        ok = True
        for labels, shape in list(zip(dm.inputs, in_shapes)) + list(zip(dm.outputs, out_shapes)):
            if labels is None or shape is None:
                continue
            for d, lab2 in enumerate(labels):
                if lab2 == lab and (shape[d] % size or shape[d] < size):
                    ok = False
        if ok:
            options.append(("S", lab))
    tensor_inputs = [i for i, s in enumerate(in_shapes) if s is not None]
    linear = [i for i in (dm.linear_inputs if dm.linear_inputs is not None else tensor_inputs)
              if i in tensor_inputs and i not in dm.bias]
    if dm.linear == "sum" and linear:
        options.append(("P", tuple(linear)))
    elif dm.linear == "multi":
        options.extend(("P", (i,)) for i in linear)
    return options


def strategies_for(dm: DimMap, in_shapes, out_shapes, mesh: Mesh) -> list[Strategy]:
    """Every valid strategy, in a deterministic order (all-replicated first), then those of ``dm.variants`` that
    place the operands differently (their note prefixed by the variant's name)."""
    out = _strategies(dm, in_shapes, out_shapes, mesh)
    seen = {(s.input_specs, s.output_spec) for s in out}
    for name, variant, valid in dm.variants:
        for s in _strategies(variant, in_shapes, out_shapes, mesh):
            s = Strategy(s.input_specs, s.output_spec, s.grad_sync, f"{name}:{s.note}")
            if (s.input_specs, s.output_spec) in seen or (valid is not None and not valid(s, in_shapes, mesh)):
                continue
            out.append(s)
    return out


def _strategies(dm: DimMap, in_shapes, out_shapes, mesh: Mesh) -> list[Strategy]:
    per_axis = [_axis_options(dm, in_shapes, out_shapes, size) for size in mesh.shape]
    out: list[Strategy] = []
    for combo in itertools.product(*per_axis):
        sharded = [o[1] for o in combo if o[0] == "S"]
        if len(sharded) != len(set(sharded)):
            continue
        out.append(_strategy(dm, combo, in_shapes, mesh))
    return out


def _strategy(dm: DimMap, combo, in_shapes, mesh: Mesh) -> Strategy:
    def placement(labels, option, role, index):
        kind = option[0]
        if kind == "R":
            return Replicate()
        if kind == "S":
            if labels is not None and option[1] in labels:
                return Shard(labels.index(option[1]))
            return Partial() if role == "out" else Replicate()
        # partial passthrough
        if role == "out":
            return Partial()
        return Partial() if index in option[1] else Replicate()

    input_specs: list[Spec | None] = []
    for i, labels in enumerate(dm.inputs):
        if in_shapes[i] is None:
            input_specs.append(None)
            continue
        input_specs.append(tuple(placement(labels, o, "in", i) for o in combo))
    outputs = tuple(tuple(placement(labels, o, "out", 0) for o in combo) for labels in dm.outputs)
    output_spec = outputs[0] if len(outputs) == 1 else outputs
    out_replicated = [all(isinstance(o[a], Replicate) for o in outputs) for a in range(mesh.ndim)]
    out_partial = [any(isinstance(o[a], Partial) for o in outputs) for a in range(mesh.ndim)]
    # A replicated bias added to a Partial output gets its whole gradient on every rank (codegen adds it once in
    # forward but passes the gradient straight through), so it needs no backward all-reduce on that axis.
    grad_sync = tuple(
        () if spec is None else tuple(mesh.names[a] for a in range(mesh.ndim)
                                      if isinstance(spec[a], Replicate) and not out_replicated[a]
                                      and not (i in dm.bias and out_partial[a]))
        for i, spec in enumerate(input_specs))
    note = ",".join("R" if o[0] == "R" else (f"S[{o[1]}]" if o[0] == "S" else "P") for o in combo)
    return Strategy(tuple(input_specs), output_spec, grad_sync, note)
