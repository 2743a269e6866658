"""DeepSpeed's monitors: scalars written by rank 0 to TensorBoard, CSV files and Weights &
Biases, under DeepSpeed's tag names.

Events are ``(tag, value, step)`` with ``step`` the number of samples seen
(``engine.global_samples``), as DeepSpeed's ``MonitorMaster.write_events``. The engine
writes after every optimizer step:

- ``Train/Samples/train_loss``: the step's loss (``train_batch``: the mean over
  micro-batches and DP replicas; the DeepSpeed loop: rank 0's mean over the step's
  micro-batches);
- ``Train/Samples/lr``: ``get_lr()[0]`` after the step (the next step's rate);
- ``Train/Samples/loss_scale``: with fp16 only;

and ``Train/Samples/eval_loss`` after ``eval_batch``.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Optional, Sequence

from engine.config.schema import MonitorConfig
from engine.errors import ConfigError
from engine.monitor.csv_monitor import CSVMonitor
from engine.monitor.tensorboard import TensorBoardMonitor

__all__ = ["Monitor", "build_monitor", "Event", "TRAIN_LOSS", "EVAL_LOSS", "LR", "LOSS_SCALE"]

Event = tuple[str, float, int]

TRAIN_LOSS = "Train/Samples/train_loss"
EVAL_LOSS = "Train/Samples/eval_loss"
LR = "Train/Samples/lr"
LOSS_SCALE = "Train/Samples/loss_scale"


class Monitor:
    """The enabled backends of this rank (none except on the writing rank)."""

    def __init__(self, backends: Sequence[Any]) -> None:
        self.backends = list(backends)

    @property
    def enabled(self) -> bool:
        return bool(self.backends)

    def write_events(self, events: Sequence[Event]) -> None:
        for b in self.backends:
            b.write_events(events)

    def close(self) -> None:
        for b in self.backends:
            b.close()


def _require(package: str, section: str, pip_name: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"{section}.enabled is true but the {pip_name!r} package is not installed: "
                          f"pip install {pip_name}, or set {section}.enabled to false")


def build_monitor(cfg: MonitorConfig, *, is_writer: bool) -> Optional[Monitor]:
    """The monitors the config enables (None when none is). Call it on every rank: the
    packages are checked everywhere (so every rank raises the same error), the files are
    opened on the writing rank only (rank 0)."""
    if not cfg.enabled:
        return None
    if cfg.tensorboard.enabled:
        _require("tensorboard", "tensorboard", "tensorboard")
    if cfg.wandb.enabled:
        _require("wandb", "wandb", "wandb")
    if not is_writer:
        return Monitor([])
    backends: list[Any] = []
    if cfg.tensorboard.enabled:
        backends.append(TensorBoardMonitor(cfg.tensorboard.output_path, cfg.tensorboard.job_name))
    if cfg.csv_monitor.enabled:
        backends.append(CSVMonitor(cfg.csv_monitor.output_path, cfg.csv_monitor.job_name))
    if cfg.wandb.enabled:
        from engine.monitor.wandb import WandbMonitor

        backends.append(WandbMonitor(cfg.wandb.project, cfg.wandb.group, cfg.wandb.team))
    return Monitor(backends)
