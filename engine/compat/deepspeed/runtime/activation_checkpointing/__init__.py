"""``deepspeed.runtime.activation_checkpointing``: its ``checkpointing`` module is
:mod:`engine.compat.deepspeed.checkpointing` (imported on first use)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["checkpointing"]


def __getattr__(name: str) -> Any:
    if name == "checkpointing":
        try:
            return importlib.import_module("engine.compat.deepspeed.checkpointing")
        except ModuleNotFoundError as e:  # hasattr() must stay an attribute question
            if e.name != "engine.compat.deepspeed.checkpointing":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute 'checkpointing' (not installed)") from e
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
