"""TensorBoard scalars in ``output_path/job_name`` (DeepSpeed's ``tensorboard`` section)."""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence

__all__ = ["TensorBoardMonitor"]


class TensorBoardMonitor:
    def __init__(self, output_path: str, job_name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.log_dir = os.path.join(output_path, job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, events: Sequence[tuple[str, float, int]], row: Optional[Mapping[str, Any]] = None) -> None:
        """DeepSpeed's events; the step's ``row`` is metrics.jsonl's, not written here."""
        for tag, value, step in events:
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # as DeepSpeed: readable while the job runs

    def close(self) -> None:
        self.writer.close()
