"""The compiler's own pieces, which the one pass list (:mod:`autoshard.passes`) and its drivers use.

:mod:`.plan` (the Plan value and the driver ``build_plan``), :mod:`.rank_programs` (the rank phase's driver),
:mod:`.context` (what every pass receives), :mod:`.ops` (one registry entry per op), :mod:`.strategies`,
:mod:`.redistribute` and :mod:`.collective_kinds` (one table per collective kind), :mod:`.report`, and the options and
records of :mod:`.moe`, :mod:`.pipeline` and :mod:`.context_parallel`. It may import the frontend, the runtime's
collective ops (the generated code calls them) and the root vocabulary; never the user API.
"""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from e
