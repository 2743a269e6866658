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
from typing import IO, Any, Callable, Mapping, Optional, Sequence

__all__ = ["JsonlMonitor", "keep_metrics_up_to", "read_metrics", "MetricsFileError", "METRICS_FILE"]

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


class MetricsFileError(ValueError):
    """A line of ``metrics.jsonl`` other than a torn last one does not parse (names file and line)."""


def read_metrics(path: str) -> tuple[list[tuple[dict[str, Any], str]], Optional[int]]:
    """``([(row, line)], torn)``: the parsed rows of ``path`` with their text, and the line
    number of a torn last line (not ending in a newline and not JSON: a kill or a full disk
    during its write), which is left out; None when there is none. Any other line that is
    not a JSON object raises :class:`MetricsFileError` naming the file and the line."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    rows: list[tuple[dict[str, Any], str]] = []
    torn = None
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as exc:
            if i == len(lines) and not line.endswith("\n"):
                torn = i
                continue
            raise MetricsFileError(f"{path} line {i} is not JSON ({exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get("step", 0), int):
            raise MetricsFileError(f"{path} line {i} is not a metrics record (a JSON object with an integer step)")
        rows.append((row, line))
    return rows, torn


def keep_metrics_up_to(output_dir: str, step: int, warn: Optional[Callable[..., None]] = None) -> None:
    """A fresh run (``step`` 0) starts a new metrics file; a resumed one keeps the records up
    to its step (a crashed run may have logged steps after its last checkpoint). A torn last
    line is dropped (``warn`` says so); any other unparsable line raises
    :class:`MetricsFileError`."""
    path = os.path.join(output_dir, METRICS_FILE)
    if not os.path.exists(path):
        return
    keep: list[str] = []
    if step > 0:
        rows, torn = read_metrics(path)
        if torn is not None and warn is not None:
            warn("%s: line %d was cut off while being written (the previous run was killed or the disk was "
                 "full): dropped", path, torn)
        keep = [line for row, line in rows if row.get("step", 0) <= step]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(keep)
