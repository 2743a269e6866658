"""Parser for DeepSpeed's monitor sections: ``tensorboard``, ``csv_monitor``, ``wandb``.

Pure (no imports of the backends): whether ``wandb`` / ``tensorboard`` are installed is
checked when the monitors are built (:func:`engine.monitor.build_monitor`), on every rank.
"""

from __future__ import annotations

from engine.config.reader import Section
from engine.config.schema import CSVMonitorConfig, MonitorConfig, TensorBoardConfig, WandbConfig

__all__ = ["parse_monitor"]


def _string(s: Section, key: str, default: str) -> str:
    v = s.raw(key, default)
    if not isinstance(v, str):
        raise s.error(key, f"must be a string, got {type(v).__name__}")
    return v


def parse_monitor(top: Section) -> MonitorConfig:
    tb, csv, wb = TensorBoardConfig(), CSVMonitorConfig(), WandbConfig()
    if top.has("tensorboard") and top.raw("tensorboard") is not None:
        s = top.sub("tensorboard", ("enabled", "output_path", "job_name"))
        tb = TensorBoardConfig(enabled=s.bool("enabled", False), output_path=_string(s, "output_path", ""),
                               job_name=_string(s, "job_name", tb.job_name))
    if top.has("csv_monitor") and top.raw("csv_monitor") is not None:
        s = top.sub("csv_monitor", ("enabled", "output_path", "job_name"))
        csv = CSVMonitorConfig(enabled=s.bool("enabled", False), output_path=_string(s, "output_path", ""),
                               job_name=_string(s, "job_name", csv.job_name))
    if top.has("wandb") and top.raw("wandb") is not None:
        s = top.sub("wandb", ("enabled", "group", "team", "project"))
        wb = WandbConfig(enabled=s.bool("enabled", False), group=s.optional_str("group"),
                         team=s.optional_str("team"), project=_string(s, "project", wb.project))
    return MonitorConfig(tensorboard=tb, csv_monitor=csv, wandb=wb)
