"""The monitors: one fan-out (:class:`Monitor`) over the backends of rank 0: DeepSpeed's
TensorBoard, CSV files and Weights & Biases (under DeepSpeed's tag names) and the training
loop's ``metrics.jsonl`` (:mod:`engine.monitor.jsonl`, one row per step).

Events are ``(tag, value, step)`` with ``step`` the number of samples seen
(``engine.global_samples``), as DeepSpeed's ``MonitorMaster.write_events``. The engine
writes after every optimizer step:

- ``Train/Samples/train_loss``: the step's loss (``train_batch``: the mean over
  micro-batches and DP replicas; the DeepSpeed loop: rank 0's mean over the step's
  micro-batches);
- ``Train/Samples/lr``: ``get_lr()[0]`` after the step (the next step's rate);
- ``Train/Samples/loss_scale``: with fp16 only;

and ``Train/Samples/eval_loss`` after ``eval_batch``. The training loop
(:func:`engine.training.trainer.train`) writes the same events and the step's row in one
call, so TensorBoard has one writer and one set of tags, and the loss is read to the host
once per step whatever the number of backends.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Mapping, Optional, Protocol, Sequence

from engine.config.schema import MonitorConfig
from engine.errors import ConfigError
from engine.monitor.csv_monitor import CSVMonitor
from engine.monitor.jsonl import JsonlMonitor
from engine.monitor.tensorboard import TensorBoardMonitor

__all__ = ["Monitor", "Backend", "build_monitor", "Event", "TRAIN_LOSS", "EVAL_LOSS", "LR", "LOSS_SCALE"]

Event = tuple[str, float, int]
Row = Mapping[str, Any]

TRAIN_LOSS = "Train/Samples/train_loss"
EVAL_LOSS = "Train/Samples/eval_loss"
LR = "Train/Samples/lr"
LOSS_SCALE = "Train/Samples/loss_scale"


class Backend(Protocol):
    """One destination. ``events``: DeepSpeed's ``(tag, value, samples)``; ``row``: the
    step's record, or None (an event-only write such as ``eval_loss``). A backend writes
    what it keeps: the DeepSpeed ones the events, ``metrics.jsonl`` the row."""

    def write_events(self, events: Sequence[Event], row: Optional[Row] = None) -> None: ...

    def close(self) -> None: ...


class Monitor:
    """The enabled backends of this rank (none except on the writing rank)."""

    def __init__(self, backends: Sequence[Backend]) -> None:
        self.backends = list(backends)

    @property
    def enabled(self) -> bool:
        return bool(self.backends)

    def write_events(self, events: Sequence[Event], row: Optional[Row] = None) -> None:
        """The one fan-out: every backend gets the same values (read to the host once)."""
        for b in self.backends:
            b.write_events(events, row)

    def close(self) -> None:
        for b in self.backends:
            b.close()


def _require(package: str, section: str, pip_name: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"{section}.enabled is true but the {pip_name!r} package is not installed: "
                          f"pip install {pip_name}, or set {section}.enabled to false")


def build_monitor(cfg: MonitorConfig, *, is_writer: bool, metrics_dir: Optional[str] = None) -> Optional[Monitor]:
    """The monitors the config enables, plus ``metrics.jsonl`` in ``metrics_dir`` when given
    (None when there is none). Call it on every rank: the packages are checked everywhere (so
    every rank raises the same error), the files are opened on the writing rank only (rank 0)."""
    if not cfg.enabled and metrics_dir is None:
        return None
    if cfg.tensorboard.enabled:
        _require("tensorboard", "tensorboard", "tensorboard")
    if cfg.wandb.enabled:
        _require("wandb", "wandb", "wandb")
    if not is_writer:
        return Monitor([])
    backends: list[Backend] = [] if metrics_dir is None else [JsonlMonitor(metrics_dir)]
    if cfg.tensorboard.enabled:
        backends.append(TensorBoardMonitor(cfg.tensorboard.output_path, cfg.tensorboard.job_name))
    if cfg.csv_monitor.enabled:
        backends.append(CSVMonitor(cfg.csv_monitor.output_path, cfg.csv_monitor.job_name))
    if cfg.wandb.enabled:
        from engine.monitor.wandb import WandbMonitor

        backends.append(WandbMonitor(cfg.wandb.project, cfg.wandb.group, cfg.wandb.team))
    return Monitor(backends)
