"""``deepspeed.utils.groups``: DeepSpeed's process-group registry (module globals set by
``initialize`` / ``_create_expert_and_data_parallel`` and read by ``_get_*_group()``) has
no counterpart: the engine's groups belong to each engine (``engine.groups``, built from
the config's layout), never to module globals. Every function here is refused with that
reason; read the groups from the engine instead (``engine.groups.dp`` etc.)."""

from __future__ import annotations

from typing import Any

from engine.compat.deepspeed._unsupported import unsupported

__all__ = ["initialize"]

_REASON = ("DeepSpeed's global group registry has no counterpart: the engine's process groups belong to the engine "
           "(engine.groups, from the config's layout); read them there")

initialize = unsupported("deepspeed.utils.groups.initialize", _REASON)


def __getattr__(name: str) -> Any:
    if name.startswith(("_get_", "_create_", "_clone_", "get_")):
        return unsupported(f"deepspeed.utils.groups.{name}", _REASON)
    raise AttributeError(f"module 'deepspeed.utils.groups' has no attribute {name!r}")
