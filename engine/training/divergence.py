"""Stop a run that diverged instead of training on silently (issue 30).

Every precision skips an optimizer step whose gradients are non-finite (engine.precision.mixed);
:class:`DivergenceGuard` watches the records of the training loop and counts the steps in a
row whose loss or global gradient norm is non-finite, or which the optimizer skipped. After
``limit`` of them (the config's ``max_consecutive_nonfinite_steps``; 0: never) it trips and
the loop ends: no final save (the state is that of the last applied step, already saved or
not worth saving), and launch/train.py exits 1 with :meth:`DivergenceGuard.message`.

Every rank decides alike: the loss is the global-batch mean (the same on every rank), the
norm is all-reduced, and the skip is the optimizer's agreed vote.
"""

from __future__ import annotations

import math
from typing import Any, Optional

__all__ = ["DivergenceGuard", "is_nonfinite_step"]


def _finite(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and math.isfinite(v))


def is_nonfinite_step(rec: dict[str, Any]) -> bool:
    """Whether a metrics record is a non-finite step: skipped, or a non-finite loss / norm."""
    return bool(rec.get("skipped")) or not _finite(rec.get("loss")) or not _finite(rec.get("grad_norm"))


class DivergenceGuard:
    """Counts consecutive non-finite steps; :attr:`tripped` after ``limit`` (0: never)."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"max_consecutive_nonfinite_steps must be >= 0, got {limit}")
        self.limit = limit
        self.streak = 0
        self.first_step: Optional[int] = None  # first step of the current streak
        self.last_step: Optional[int] = None
        self.applied = 0  # steps of the streak the optimizer applied (bf16 with check_grad_overflow false)

    def observe(self, rec: dict[str, Any]) -> bool:
        """Record one step; returns whether it was non-finite."""
        if not is_nonfinite_step(rec):
            self.streak, self.first_step, self.applied = 0, None, 0
            return False
        self.streak += 1
        self.applied += 0 if rec.get("skipped") else 1
        self.last_step = int(rec["step"])
        if self.first_step is None:
            self.first_step = self.last_step
        return True

    @property
    def in_streak(self) -> bool:
        return self.streak > 0

    @property
    def tripped(self) -> bool:
        return self.limit > 0 and self.streak >= self.limit

    def _applied(self) -> str:
        return "all skipped" if self.applied == 0 else f"{self.applied} of them applied: check_grad_overflow is off"

    def message(self, last_checkpoint: Optional[str]) -> str:
        """The one line launch/train.py prints when the guard tripped."""
        ck = (f"the last finite checkpoint is {last_checkpoint}" if last_checkpoint is not None
              else "no checkpoint of this run holds a finite state")
        return (f"training diverged: {self.streak} consecutive steps with a non-finite loss or gradient norm "
                f"(steps {self.first_step}-{self.last_step}, {self._applied()}); stopped at step {self.last_step} "
                f"(max_consecutive_nonfinite_steps = {self.limit}); {ck}: resume from it with a lower learning "
                "rate (or more warmup / gradient clipping)")
