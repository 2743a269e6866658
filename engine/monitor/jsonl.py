"""``metrics.jsonl``: one JSON object per optimizer step in ``output_dir``, the monitor
backend of the training loop (:func:`engine.training.trainer.train`).

It takes the step's row (the record the loop builds: ``step``, ``loss``, ``lr``, ...)
where the other backends take DeepSpeed's events; every backend is written by the one
fan-out (:meth:`engine.monitor.Monitor.write_events`). Non-finite floats are written as
``null`` (JSON has no NaN) so every line parses.
"""

from __future__ import annotations

import json
import math
import os
from typing import IO, Any, Mapping, Optional, Sequence

__all__ = ["JsonlMonitor", "keep_metrics_up_to"]

METRICS_FILE = "metrics.jsonl"


class JsonlMonitor:
    def __init__(self, output_dir: str) -> None:
        os.makedirs(output_dir, exist_ok=True)
        self._file: Optional[IO[str]] = open(os.path.join(output_dir, METRICS_FILE), "a", encoding="utf-8")

    def write_events(self, events: Sequence[tuple[str, float, int]], row: Optional[Mapping[str, Any]] = None) -> None:
        if row is None:  # an event without a step row (eval_loss): not a metrics.jsonl line
            return
        assert self._file is not None, "JsonlMonitor.write_events after close()"
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self._file.write(json.dumps(clean, sort_keys=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def keep_metrics_up_to(output_dir: str, step: int) -> None:
    """A fresh run starts a new metrics file; a resumed one keeps the records up to its step
    (a crashed run may have logged steps after its last checkpoint)."""
    path = os.path.join(output_dir, METRICS_FILE)
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        keep = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(keep)
