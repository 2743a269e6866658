"""DeepSpeed's ``torch_autocast`` section at run time (runtime/torch_autocast.py's meaning).

- The engine's forward runs under ``torch.autocast(device, dtype)`` when the section is
  enabled. As DeepSpeed's ``autocast_if_enabled``: an autocast the script opened around the
  call is replaced by the section's (enabled) or switched off inside the forward (the section
  disabled: the bf16 / fp16 sections decide the precision then).
- ``lower_precision_safe_modules`` (default Linear, Conv1d/2d/3d): classes whose parameters'
  gradients DeepSpeed reduces in the autocast dtype, the others in their own dtype. Each name
  must import (DeepSpeed raises the same ValueError otherwise). The reduction dtype here is
  ``communication_data_type`` for every gradient (fp32 when unset: exact); see
  docs/deepspeed_compat.md.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from typing import Iterator, Optional

import torch

from engine.config.schema import TorchAutocastConfig

__all__ = ["autocast_forward", "autocast_dtype", "lower_precision_safe_classes", "DEFAULT_SAFE_MODULES"]

logger = logging.getLogger(__name__)
_WARNED: set[str] = set()  # device types whose switched-off outer autocast was reported (once per process)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_SAFE_MODULES = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def autocast_dtype(cfg: TorchAutocastConfig) -> Optional[torch.dtype]:
    return _DTYPES[cfg.dtype] if cfg.dtype is not None else None


def lower_precision_safe_classes(cfg: TorchAutocastConfig) -> tuple[type, ...]:
    """The classes ``lower_precision_safe_modules`` names (DeepSpeed's default when unset)."""
    if cfg.lower_precision_safe_modules is None:
        return DEFAULT_SAFE_MODULES
    out = []
    for name in cfg.lower_precision_safe_modules:
        package, _, cls = name.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(package), cls))
        except Exception as e:  # noqa: BLE001 (any import failure is the user's name)
            raise ValueError(f"torch_autocast.lower_precision_safe_modules: failed to import {name!r} ({e}); "
                             "give the class's full dotted path, e.g. \"torch.nn.modules.linear.Linear\"") from e
    return tuple(out)


@contextlib.contextmanager
def autocast_forward(cfg: TorchAutocastConfig, device_type: str) -> Iterator[None]:
    """The region the engine's forward runs in (module docstring)."""
    outside = torch.is_autocast_enabled(device_type)
    if cfg.enabled:
        with torch.autocast(device_type=device_type, dtype=autocast_dtype(cfg), enabled=True):
            yield
    elif outside:
        if device_type not in _WARNED:  # as DeepSpeed warns: the script's own autocast stops applying here
            _WARNED.add(device_type)
            logger.warning("torch.autocast is enabled around the engine's forward but the config's torch_autocast "
                           "section is not: the forward runs without it (the bf16 / fp16 sections decide the "
                           "precision); enable torch_autocast in the config to use torch's autocast")
        with torch.autocast(device_type=device_type, enabled=False):
            yield
    else:
        yield
