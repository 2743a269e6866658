"""The job's lifecycle around the :class:`~engine.training.trainer.Trainer`: the one owner of
the logs folder, the failure records and the model-section check, which launch/train.py (a
thin CLI: flags, launch environment, exit codes, printing) calls.

- :func:`logs_dir`: ``OUTPUT/logs``: per-rank tracebacks (``rank<R>.log``) and failure
  records (``rank<R>.failed`` / ``.stopped``, read by the peers when the failing rank
  hosted the rendezvous store; :func:`engine.distributed.env.failure_guard` writes them);
- :func:`clear_failure_records`: a new run's folder holds only its own records;
- :func:`record_failure`: this rank's failure as one line, its traceback in the log file;
- :func:`require_model`: the trainer trains the reference GPT of the ``model`` section.
"""

from __future__ import annotations

import os
import traceback
from typing import Optional

from engine.config import Config
from engine.errors import ConfigError
from engine.models import ModelConfig

__all__ = ["logs_dir", "clear_failure_records", "record_failure", "require_model"]


def logs_dir(output: str) -> str:
    """Per-rank tracebacks and failure records of a job writing into ``output``."""
    return os.path.join(output, "logs")


def clear_failure_records(output: str) -> None:
    logs = logs_dir(output)
    for name in os.listdir(logs) if os.path.isdir(logs) else []:
        if name.endswith((".failed", ".stopped")):
            os.remove(os.path.join(logs, name))


def require_model(cfg: Config, source: str = "the config") -> ModelConfig:
    """The config's ``model`` section; a :class:`ConfigError` naming ``source`` without one."""
    if cfg.model is None:
        raise ConfigError(f"{source} has no \"model\" section: launch/train.py trains the reference GPT it "
                          "describes; add one with vocab_size, hidden_size, num_layers, num_heads and seq_len "
                          "(see configs/default.json)")
    return cfg.model


def record_failure(output: str, rank: Optional[int], exc: BaseException, *, keep_traceback: bool = True
                   ) -> tuple[str, str]:
    """``(line, traceback)`` of this rank's failure: one line naming the rank and the error.
    With ``keep_traceback`` the traceback is appended to ``OUTPUT/logs/rank<R>.log`` and the
    line names the file; otherwise (``--debug``) the caller shows the returned traceback."""
    who = "?" if rank is None else rank
    first = (str(exc).strip().splitlines() or [""])[0][:1000]
    tb = "".join(traceback.format_exception(exc))
    where = ""
    if keep_traceback:
        try:
            path = os.path.join(logs_dir(output), f"rank{who}.log")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(tb)
            where = f" (traceback: {path}; or run with --debug)"
        except OSError:
            where = " (run with --debug for the traceback)"
    return f"error: rank {who}: {type(exc).__name__}: {first}{where}", tb
