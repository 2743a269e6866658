"""Distributed bring-up and communication.

- :mod:`engine.dist.env`: launch detection (torchrun / deepspeed / Slurm / Open MPI /
  single), ``init_distributed``, ``shutdown``, ``failure_guard``, op-build settings. The
  only module in ``engine`` that reads environment variables; imports torch lazily.
- :mod:`engine.dist.failures`: ``failure_guard`` names the rank that died, hung or raised.
- :mod:`engine.dist.teardown`: ``shutdown`` (drain and destroy every group while Python is
  alive, so no gloo thread meets interpreter finalisation).
- :mod:`engine.dist.groups`: ``ParallelGroups`` built once from a ``Topology``; one
  ``AxisGroup`` per axis (``groups[Axis.TP]``), never ``None``.
- :mod:`engine.dist.comm`: typed collective wrappers.

Importing ``engine.dist`` does not import torch; ``ParallelGroups`` is loaded on first use.
"""

from typing import Any

from engine.dist.env import (
    DistEnv, LaunchError, LaunchInfo, OpBuildSettings, PeerFailureError, detect_launch,
    failure_guard, init_distributed, op_build_settings, record_failure, shutdown,
)

__all__ = [
    "AxisGroup", "DistEnv", "LaunchError", "LaunchInfo", "OpBuildSettings", "PeerFailureError",
    "ParallelGroups", "detect_launch", "failure_guard", "init_distributed",
    "op_build_settings", "record_failure", "shutdown",
]


def __getattr__(name: str) -> Any:
    if name in ("ParallelGroups", "AxisGroup"):
        from engine.dist import groups

        return getattr(groups, name)
    raise AttributeError(f"module 'engine.dist' has no attribute {name!r}")
