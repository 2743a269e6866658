"""``deepspeed.utils.logging``: ``logger`` (the standard-library logger named ``"DeepSpeed"``,
as DeepSpeed's; the engine adds no handler, so configure logging in the script) and
``log_dist`` / ``print_dist`` with DeepSpeed's rank rule: before ``torch.distributed`` is
initialised every process writes; after, only the ranks listed (``[-1]``: all; None or
``[]``: none), prefixed ``[Rank r]``."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch.distributed as dist

__all__ = ["logger", "log_dist", "print_dist", "get_dist_msg"]

logger = logging.getLogger("DeepSpeed")


def get_dist_msg(message: str, ranks: Optional[Sequence[int]] = None) -> Optional[str]:
    """``"[Rank r] message"`` when this rank should write it (rule above), else None."""
    initialised = dist.is_initialized()
    rank = dist.get_rank() if initialised else -1
    wanted = list(ranks or [])
    if not initialised or (wanted and (wanted[0] == -1 or rank in wanted)):
        return f"[Rank {rank}] {message}"
    return None


def log_dist(message: str, ranks: Optional[Sequence[int]] = None, level: int = logging.INFO) -> None:
    msg = get_dist_msg(message, ranks)
    if msg is not None:
        logger.log(level, msg)


def print_dist(message: str, ranks: Optional[Sequence[int]] = None) -> None:
    msg = get_dist_msg(message, ranks)
    if msg is not None:
        print(msg)  # noqa: T201 (DeepSpeed's print_dist prints, whatever the log level)
