"""The frontend: from a user's ``nn.Module`` and example inputs to one traced FX graph.

:mod:`.trace` (torch.export), :mod:`.layer_reuse` (repeated layers traced once), :mod:`.precision` (tracing under a
mixed-precision policy), :mod:`.hf_blocks` (Hugging Face MoE blocks run as one static op while tracing),
:mod:`.inputs` (the inputs a graph expects), :mod:`.graph_utils`. It imports only the vocabulary at the package
root (errors, mesh, placements, meta, progress); the compiler and the user API import it.
"""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from e
