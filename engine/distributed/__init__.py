"""Distributed bring-up and communication.

- :mod:`engine.distributed.env`: launch detection (torchrun / deepspeed / Slurm / Open MPI /
  single), ``init_distributed``, ``shutdown``, ``failure_guard``, op-build settings. The
  only module in ``engine`` that reads environment variables; imports torch lazily.
- :mod:`engine.distributed.failures`: ``failure_guard`` names the rank that died, hung or raised.
- :mod:`engine.distributed.teardown`: ``shutdown`` (drain and destroy every group while Python is
  alive, so no gloo thread meets interpreter finalisation).
- :mod:`engine.distributed.groups`: ``ParallelGroups`` built once from a ``Topology``; one
  ``AxisGroup`` per axis (``groups[Axis.TP]``), never ``None``.
- :mod:`engine.distributed.comm`: typed collective wrappers.

Importing ``engine.distributed`` does not import torch; ``ParallelGroups`` is loaded on first use.
"""

from typing import Any

from engine.distributed.env import (
    DistEnv,
    LaunchError,
    LaunchInfo,
    OpBuildSettings,
    PeerFailureError,
    detect_launch,
    failure_guard,
    init_distributed,
    op_build_settings,
    record_failure,
    shutdown,
)

__all__ = [
    "AxisGroup", "DistEnv", "LaunchError", "LaunchInfo", "OpBuildSettings", "PeerFailureError",
    "ParallelGroups", "detect_launch", "failure_guard", "init_distributed",
    "op_build_settings", "record_failure", "shutdown",
]


def __getattr__(name: str) -> Any:
    if name in ("ParallelGroups", "AxisGroup"):
        from engine.distributed import groups

        return getattr(groups, name)
    raise AttributeError(f"module 'engine.distributed' has no attribute {name!r}")
