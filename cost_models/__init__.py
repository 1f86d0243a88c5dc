"""Cost models for autoshard: pure functions that price a plan, with no dependency on the passes or codegen.

- :mod:`.profile` — :class:`~.profile.HardwareProfile` (roofline, memory, alpha-beta links per mesh axis),
  the TOML presets in ``profiles/`` (``cpu-gloo``, ``gpu-8x-nvlink``, ``multi-node``), load/save.
- :mod:`.alpha_beta` — collective time by the alpha-beta model, as sympy formulas and a fast float path.
- :mod:`.compute` — FLOPs, bytes and roofline time of an aten op in an FX graph.
- :mod:`.memory` — per-rank parameters, gradients, optimizer state and saved activations.
- :mod:`.workspace` — what ops allocate besides their outputs (kept for backward, or transient), per rank.
- :mod:`.calibrate` — measures a profile on the current machine (``autoshard calibrate``).
"""
