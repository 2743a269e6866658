"""Weights & Biases (DeepSpeed's ``wandb`` section): ``wandb.init(project, group, entity)``
on the writing rank, each event logged as ``{tag: value}`` at ``step``."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

__all__ = ["WandbMonitor"]


class WandbMonitor:
    def __init__(self, project: str, group: Optional[str], team: Optional[str]) -> None:
        import wandb

        self._wandb = wandb
        wandb.init(project=project, group=group, entity=team)

    def write_events(self, events: Sequence[tuple[str, float, int]], row: Optional[Mapping[str, Any]] = None) -> None:
        """DeepSpeed's events; the step's ``row`` is metrics.jsonl's, not written here."""
        for tag, value, step in events:
            self._wandb.log({tag: value}, step=step)

    def close(self) -> None:
        self._wandb.finish()
