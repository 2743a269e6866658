"""The only module in ``engine`` that reads environment variables.

Everything here is a pure function of an ``environ`` mapping passed in (defaulting to
``os.environ``), so every launcher layout can be tested without launching anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

__all__ = ["OpBuildSettings", "op_build_settings", "env_flag"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_flag(name: str, default: bool = False, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Boolean environment flag: 1/true/yes/on or 0/false/no/off (case-insensitive)."""
    environ = os.environ if environ is None else environ
    raw = environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean: set it to 1/true/yes/on or 0/false/no/off")


@dataclass(frozen=True)
class OpBuildSettings:
    """How the op builder should get compiled extensions.

    build_ops: compile ahead of time (``ENGINE_BUILD_OPS``) instead of JIT-loading.
    extensions_dir: where built extensions live (``ENGINE_EXTENSIONS_DIR``), None = torch default.
    cuda_arch_list: ``TORCH_CUDA_ARCH_LIST`` passed through, None = let torch decide.
    """

    build_ops: bool = False
    extensions_dir: Optional[str] = None
    cuda_arch_list: Optional[str] = None


def op_build_settings(environ: Optional[Mapping[str, str]] = None) -> OpBuildSettings:
    environ = os.environ if environ is None else environ
    return OpBuildSettings(
        build_ops=env_flag("ENGINE_BUILD_OPS", False, environ),
        extensions_dir=environ.get("ENGINE_EXTENSIONS_DIR") or None,
        cuda_arch_list=environ.get("TORCH_CUDA_ARCH_LIST") or None,
    )
