"""DeepSpeed's ``csv_monitor``: in ``output_path/job_name``, one file per tag named after
the tag with ``/`` and spaces as ``_`` (``Train_Samples_train_loss.csv``), a header row
``step,<last part of the tag>`` and one ``step,value`` row per event."""

from __future__ import annotations

import csv
import os
from typing import Any, Mapping, Optional, Sequence

__all__ = ["CSVMonitor"]


class CSVMonitor:
    def __init__(self, output_path: str, job_name: str) -> None:
        self.log_dir = os.path.join(output_path, job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self._started: set[str] = set()

    def write_events(self, events: Sequence[tuple[str, float, int]], row: Optional[Mapping[str, Any]] = None) -> None:
        """DeepSpeed's events; the step's ``row`` is metrics.jsonl's, not written here."""
        for tag, value, step in events:
            name = tag.replace("/", "_").replace(" ", "_")
            path = os.path.join(self.log_dir, name + ".csv")
            with open(path, "a", newline="") as f:  # appends across runs, as DeepSpeed
                w = csv.writer(f)
                if name not in self._started:
                    w.writerow(["step", tag.split("/")[-1]])
                    self._started.add(name)
                w.writerow([step, value])

    def close(self) -> None:
        pass
