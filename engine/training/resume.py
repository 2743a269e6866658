"""What a resumed run checks before it builds anything (issue 30).

- :func:`model_differences`: the checkpoint's ``model`` section (its metadata keeps the
  whole config) against the run's. Parameter shapes cannot see every change: ``num_heads``
  (same hidden size), ``seq_len``, ``rope_theta`` or ``norm_eps`` load without complaint
  and train another model, so a resume refuses any difference (``--finetune`` allows them).
- :func:`metrics_problem`: ``metrics.jsonl`` of the output a resumed run continues parses
  (the loop rewrites it up to the resumed step): a torn LAST line (a kill or a full disk
  during a write) is dropped later with a warning; any other line that does not parse is
  an error naming the file and the line.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from engine.errors import ConfigError
from engine.models import ModelConfig
from engine.monitor.jsonl import METRICS_FILE, MetricsFileError, read_metrics

__all__ = ["model_differences", "metrics_problem"]


def _normal(section: dict[str, Any]) -> dict[str, Any]:
    """The section with its defaults filled in (an older checkpoint omits keys added since)."""
    try:
        return ModelConfig.from_dict(dict(section)).to_dict()
    except (ConfigError, TypeError, ValueError):
        return dict(section)


def model_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``[(key, checkpoint's value, run's value)]`` for every key of the ``model`` section
    that differs (None for a key one side lacks), in sorted key order."""
    a, b = _normal(saved), _normal(current)
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def metrics_problem(output: str) -> Optional[str]:
    """None when ``OUTPUT/metrics.jsonl`` is absent or parses (but for a torn last line)."""
    path = os.path.join(output, METRICS_FILE)
    if not os.path.exists(path):
        return None
    try:
        read_metrics(path)
    except MetricsFileError as exc:
        return f"{exc}: a resumed run continues this file; repair or remove the line (or the file)"
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    return None
