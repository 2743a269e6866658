"""Loss scaling for fp16 training, with DeepSpeed's semantics.

The optimizer multiplies the loss by ``loss_scale`` before backward, divides the reduced
gradients by it before the step, and reports each step's outcome with
:meth:`DynamicLossScaler.update` (``overflow`` must already be agreed by every rank, so
every rank takes the same decision and the scales never diverge).

Dynamic rules (DeepSpeed ``DynamicLossScaler``; config keys of the ``fp16`` section):

- the scale starts at ``2 ** initial_scale_power``;
- on an overflow, if the hysteresis budget (``hysteresis``, DeepSpeed's "delayed shift")
  has more than one left, one is spent and the scale is kept; otherwise the scale is halved,
  but never below ``min_loss_scale``. An overflow while the scale already *equals*
  ``min_loss_scale`` raises :class:`LossScaleAtMinimumError` (DeepSpeed raises a generic
  ``Exception`` there and stops the run; ``raise_error_at_min_scale=False`` keeps stepping
  at the minimum instead, as DeepSpeed allows);
- the step counter ``cur_iter`` counts every update; after an overflow at iteration ``k``
  (or from the start, ``k = -1``) the scale doubles at the first clean iteration ``i`` with
  ``i - k - 1`` a positive multiple of ``loss_scale_window`` (so the first doubling comes on
  the ``window + 1``-th clean step after an overflow, exactly as DeepSpeed counts);
  when it doubles, the hysteresis budget is refilled;
- with ``consecutive_hysteresis`` the budget is also refilled on every clean step, so only
  ``hysteresis`` overflows *in a row* halve the scale;
- ``loss_scale > 0`` in the config selects a static scale that never changes.
"""

from __future__ import annotations

import logging
from typing import Any, Union

import torch

from engine.errors import ConfigError

__all__ = ["LossScaleAtMinimumError", "StaticLossScaler", "DynamicLossScaler", "build_loss_scaler"]

logger = logging.getLogger(__name__)


class LossScaleAtMinimumError(RuntimeError):
    """Gradients overflowed while the loss scale was already at ``min_loss_scale``."""


class StaticLossScaler:
    """A fixed scale (1.0 for bf16/fp32: no scaling)."""

    dynamic = False

    def __init__(self, scale: float = 1.0):
        if not scale > 0:
            raise ConfigError(f"fp16.loss_scale must be > 0 for a static scale, got {scale}")
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> None:
        if overflow:
            logger.warning("non-finite gradients with static loss scale %s: step skipped", self.cur_scale)

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.cur_scale = float(sd["cur_scale"])


class DynamicLossScaler:
    """DeepSpeed's dynamic loss scaler (see the module docstring for the rules)."""

    dynamic = True

    def __init__(self, init_scale: float = 2.0 ** 16, scale_window: int = 1000, min_scale: float = 1.0,
                 hysteresis: int = 2, consecutive_hysteresis: bool = False,
                 raise_error_at_min_scale: bool = True, scale_factor: float = 2.0):
        if not init_scale > 0:
            raise ConfigError(f"initial loss scale must be > 0, got {init_scale} (fp16.initial_scale_power)")
        if scale_window < 1:
            raise ConfigError(f"fp16.loss_scale_window must be >= 1, got {scale_window}")
        if not min_scale > 0:
            raise ConfigError(f"fp16.min_loss_scale must be > 0, got {min_scale}")
        if hysteresis < 1:
            raise ConfigError(f"fp16.hysteresis must be >= 1, got {hysteresis}")
        self.cur_scale = float(init_scale)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.hysteresis = int(hysteresis)
        self.cur_hysteresis = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.scale_factor = float(scale_factor)
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> None:
        """Record one step's outcome (``overflow`` agreed across all ranks)."""
        if overflow:
            self._on_overflow()
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                self.cur_hysteresis = self.hysteresis
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        if self.hysteresis > 1 and self.cur_hysteresis > 1:
            self.cur_hysteresis -= 1
            logger.info("gradient overflow at loss scale %s: step skipped, hysteresis now %d",
                        self.cur_scale, self.cur_hysteresis)
            return
        if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
            raise LossScaleAtMinimumError(
                f"fp16 gradients overflowed with the loss scale already at its minimum "
                f"({self.min_scale}); the run is diverging or the model needs a wider format: "
                f"lower the learning rate, use bf16, or lower fp16.min_loss_scale")
        new_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
        logger.info("gradient overflow at loss scale %s: step skipped, scale now %s", self.cur_scale, new_scale)
        self.cur_scale = new_scale

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("cur_scale", "cur_hysteresis", "cur_iter", "last_overflow_iter")}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.cur_scale = float(sd["cur_scale"])
        self.cur_hysteresis = int(sd["cur_hysteresis"])
        self.cur_iter = int(sd["cur_iter"])
        self.last_overflow_iter = int(sd["last_overflow_iter"])


def build_loss_scaler(compute_dtype: torch.dtype, *, loss_scale: float = 0.0, initial_scale_power: int = 16,
                      loss_scale_window: int = 1000, hysteresis: int = 2, consecutive_hysteresis: bool = False,
                      min_loss_scale: float = 1.0, raise_error_at_min_scale: bool = True,
                      ) -> Union[StaticLossScaler, DynamicLossScaler]:
    """The scaler for a compute dtype and the ``fp16`` config section's values.

    Only fp16 scales the loss; bf16 and fp32 get a static scale of 1 (their range needs none).
    """
    if compute_dtype != torch.float16:
        return StaticLossScaler(1.0)
    if loss_scale < 0:
        raise ConfigError(f"fp16.loss_scale must be >= 0 (0 = dynamic), got {loss_scale}")
    if loss_scale > 0:
        return StaticLossScaler(loss_scale)
    if not 0 <= initial_scale_power <= 63:
        raise ConfigError(f"fp16.initial_scale_power must be in [0, 63], got {initial_scale_power}")
    return DynamicLossScaler(init_scale=2.0 ** initial_scale_power, scale_window=loss_scale_window,
                             min_scale=min_loss_scale, hysteresis=hysteresis,
                             consecutive_hysteresis=consecutive_hysteresis,
                             raise_error_at_min_scale=raise_error_at_min_scale)

