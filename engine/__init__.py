"""engine: a 3D-parallel (DP x TP x PP) training engine for transformers on PyTorch.

``engine.initialize(...)`` (DeepSpeed's ``deepspeed.initialize``), ``engine.init_distributed``,
``engine.add_config_arguments`` and ``engine.Engine`` are loaded on first use, so that ``import engine`` (and the torch-free modules such as the
topology and launch detection) does not import torch.
"""

from typing import Any

from engine.topology import Axis, Coord, Topology, TopologyError  # noqa: E402
from engine.version import __version__

__all__ = ["Axis", "Coord", "Topology", "TopologyError", "__version__", "initialize", "Engine", "init_distributed",
           "add_config_arguments"]


def __getattr__(name: str) -> Any:
    if name == "initialize":
        from engine.assembly.initialize import initialize

        return initialize
    if name in ("init_distributed", "add_config_arguments"):
        from engine.compat import api

        return getattr(api, name)
    if name == "Engine":
        from engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
