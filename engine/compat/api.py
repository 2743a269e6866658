"""``init_distributed`` and ``add_config_arguments`` with DeepSpeed's signatures and meaning.

Both are reachable as ``engine.init_distributed`` / ``engine.add_config_arguments`` and
through :mod:`engine.compat.deepspeed`.
"""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import argparse

__all__ = ["init_distributed", "add_config_arguments", "DEFAULT_TIMEOUT"]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)  # torch's default process-group timeout
_BACKENDS = ("nccl", "gloo")


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: datetime.timedelta = DEFAULT_TIMEOUT, init_method: Optional[str] = None,
                     dist_init_required: Optional[bool] = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """DeepSpeed's ``deepspeed.init_distributed``: initialise the default process group from
    the launcher's environment (torchrun, the deepspeed launcher, srun, mpirun), or return
    at once when it is already initialised (as DeepSpeed does).

    ``dist_backend``: ``"nccl"`` (CUDA) or ``"gloo"`` (CPU); None picks the one for the
    device. ``timeout`` bounds the rendezvous and every collective. The launcher gives the
    address and port, so ``distributed_port`` is not used; ``verbose`` and ``config`` (comms
    logging) have no effect. ``init_method`` / ``rank`` / ``world_size`` (manual rendezvous)
    are refused: launch with one of the launchers above instead.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError("dist_init_required=False but torch.distributed is not initialised: initialise it "
                           "first, or pass dist_init_required=None")
    if init_method is not None or rank != -1 or world_size != -1:
        raise ValueError("init_method / rank / world_size (a manual rendezvous) are not supported: launch with "
                         "torchrun, the deepspeed launcher, srun or mpirun, which describe the job in the "
                         "environment, and call init_distributed() without them")
    if dist_backend is not None and dist_backend.lower() not in _BACKENDS:
        raise ValueError(f"dist_backend {dist_backend!r} is not supported: use 'nccl' (CUDA) or 'gloo' (CPU), or "
                         "None to pick the one for the device")
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    from engine.distributed.env import init_distributed as _init

    device = None if dist_backend is None else ("cuda" if dist_backend.lower() == "nccl" else "cpu")
    _init(timeout_s=timeout.total_seconds(), backend=dist_backend, device=device)


def add_config_arguments(parser: "argparse.ArgumentParser") -> "argparse.ArgumentParser":
    """DeepSpeed's ``deepspeed.add_config_arguments``: a "DeepSpeed" argument group with
    ``--deepspeed`` (a flag for the script's own use), ``--deepspeed_config PATH`` (read by
    ``initialize(args=args)``) and the deprecated ``--deepscale`` / ``--deepscale_config``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (a flag for the script; no effect on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help="Deprecated: use --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated: use --deepspeed_config")
    return parser
