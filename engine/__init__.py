"""engine: a 3D-parallel (DP x TP x PP) training engine for transformers on PyTorch."""

__version__ = "0.1.0"

from engine.topology import Axis, Coord, Topology, TopologyError  # noqa: E402

__all__ = ["Axis", "Coord", "Topology", "TopologyError", "__version__"]
