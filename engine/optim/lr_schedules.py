"""Learning-rate schedules: DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR (same
parameter names and formulas) plus ``cosine`` (warmup, cosine to a floor ratio) and ``WSD``
(warmup-stable-decay).

Every schedule is a :class:`torch.optim.lr_scheduler.LRScheduler`: it sets the lr of each
param group from a pure function ``f`` of a step index, and has ``state_dict``/
``load_state_dict``. Call ``step()`` after each optimizer step (the engine does, skipping
steps skipped for overflow, as DeepSpeed does); torch's ``last_epoch`` is 0 at construction
and +1 per ``step()``.

DeepSpeed's three (WarmupLR, WarmupDecayLR, WarmupCosineLR) follow DeepSpeed step for step:
``f`` is a function of DeepSpeed's ``last_batch_iteration`` ``s = last_epoch - 1``, which is
-1 at construction, where DeepSpeed sets ``warmup_min_lr`` (ratio 0 for WarmupCosineLR, not
``warmup_min_ratio``). So the ``k``-th optimizer step (0-based) uses ``f(k - 1)`` in both, with
``f(-1)`` that start value. Ours (``cosine``, ``WSD``) use ``f(last_epoch)``: the ``k``-th
step uses ``f(k)``.

Formulas (``W`` warmup steps, ``T`` total steps, ``base`` the param group's lr at construction):

- ``WarmupLR``: ``W' = max(2, W)``; ``g(s) = log(s + 1) / log(W')`` ("log") or ``s / W'``
  ("linear") for ``s < W'``, else 1; ``lr = min_lr + (max_lr - min_lr) * g(s)``.
  ``warmup_max_lr`` defaults to ``base``.
- ``WarmupDecayLR``: as WarmupLR during warmup, then
  ``g(s) = max(0, (T - s) / max(1, T - W'))``.
- ``WarmupCosineLR``: ratio of ``base``. For ``s < W'``: ``r = m + (1 - m) * g(s)`` with
  ``m = warmup_min_ratio``; after: ``p = min(1, (s - W' + 1) / max(1, T - W'))``,
  ``r = max(0, c + (1 - c) * (1 + cos(pi p)) / 2)`` with ``c = cos_min_ratio``.
- ``cosine``: ratio of ``base``. ``r = s / W`` for ``s < W`` (linear warmup from 0; "log"
  uses WarmupLR's log curve); then ``p = clamp((s - W) / max(1, T - W), 0, 1)`` and
  ``r = f + (1 - f) * (1 + cos(pi p)) / 2`` with ``f = min_lr_ratio`` (default 0.1).
- ``WSD``: ratio of ``base``. ``r = s / W`` for ``s < W``; 1 until ``T - D`` (``D`` =
  ``decay_num_steps``); then ``p = clamp((s - (T - D)) / D, 0, 1)`` and
  ``r = f + (1 - f) * d(p)`` with ``d`` = ``1 - p`` ("linear"), ``(1 + cos(pi p)) / 2``
  ("cosine") or ``1 - sqrt(p)`` ("sqrt"); ``f = min_lr_ratio`` (default 0).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Callable, Mapping, Sequence, Union, cast

import torch
from torch.optim.lr_scheduler import LRScheduler

from engine.errors import ConfigError
from engine.validate import check_int

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "CosineWithWarmup", "WSD",
           "build_lr_scheduler", "SCHEDULERS",
           "warmup_gamma", "warmup_decay_gamma", "warmup_cosine_ratio", "cosine_ratio", "wsd_ratio"]

Number = Union[float, int]


# ----------------------------------------------------------------------------- pure formulas
def _check_warmup_type(warmup_type: str, allowed: Sequence[str] = ("log", "linear")) -> None:
    if warmup_type not in allowed:
        raise ConfigError(f"scheduler.params.warmup_type {warmup_type!r} is not one of {list(allowed)}")


def warmup_gamma(step: int, warmup_num_steps: int, warmup_type: str) -> float:
    """DeepSpeed's warmup fraction in [0, 1] (``warmup_num_steps`` is raised to >= 2, as there)."""
    w = max(2, warmup_num_steps)
    if step < w:
        if warmup_type == "log":
            return math.log(step + 1) / math.log(w)
        return step / w
    return 1.0


def warmup_decay_gamma(step: int, warmup_num_steps: int, total_num_steps: int, warmup_type: str) -> float:
    w = max(2, warmup_num_steps)
    if step < w:
        return warmup_gamma(step, warmup_num_steps, warmup_type)
    return max(0.0, float(total_num_steps - step) / float(max(1, total_num_steps - w)))


def warmup_cosine_ratio(step: int, total_num_steps: int, warmup_min_ratio: float, warmup_num_steps: int,
                        cos_min_ratio: float, warmup_type: str) -> float:
    w = max(2, warmup_num_steps)
    if step < w:
        return warmup_min_ratio + warmup_gamma(step, warmup_num_steps, warmup_type) * (1.0 - warmup_min_ratio)
    progress = min(1.0, (step - w + 1) / max(1, total_num_steps - w))
    return max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * (1.0 + math.cos(math.pi * progress)) / 2.0)


def _linear_or_log_warmup(step: int, warmup_num_steps: int, warmup_type: str) -> float:
    if warmup_type == "log":
        return warmup_gamma(step, warmup_num_steps, "log")
    return step / warmup_num_steps


def cosine_ratio(step: int, warmup_num_steps: int, total_num_steps: int, min_lr_ratio: float = 0.1,
                 warmup_type: str = "linear") -> float:
    if step < warmup_num_steps:
        return _linear_or_log_warmup(step, warmup_num_steps, warmup_type)
    progress = min(1.0, max(0.0, (step - warmup_num_steps) / max(1, total_num_steps - warmup_num_steps)))
    return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 + math.cos(math.pi * progress)) / 2.0


_DECAYS: dict[str, Callable[[float], float]] = {
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: (1.0 + math.cos(math.pi * p)) / 2.0,
    "sqrt": lambda p: 1.0 - math.sqrt(p),
}


def wsd_ratio(step: int, warmup_num_steps: int, total_num_steps: int, decay_num_steps: int,
              min_lr_ratio: float = 0.0, decay_type: str = "linear") -> float:
    if step < warmup_num_steps:
        return step / warmup_num_steps
    decay_start = total_num_steps - decay_num_steps
    if step < decay_start or decay_num_steps == 0:
        return 1.0
    progress = min(1.0, (step - decay_start) / decay_num_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * _DECAYS[decay_type](progress)


# ----------------------------------------------------------------------------- checks
def _positive_int(name: str, v: Any, minimum: int = 1) -> int:
    return check_int(f"scheduler.params.{name}", v, minimum=minimum)


def _ratio(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
        raise ConfigError(f"scheduler.params.{name} must be a number in [0, 1], got {v!r}")
    return float(v)


def _per_group(optimizer: torch.optim.Optimizer, value: Union[Number, Sequence[Number]], name: str) -> list[float]:
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ConfigError(f"scheduler.params.{name} has {len(value)} values but the optimizer has {n} "
                              f"param groups: give one value or one per group")
        return [float(v) for v in value]
    return [float(cast(Number, value))] * n


# ----------------------------------------------------------------------------- schedulers
class _StepFunctionLR(LRScheduler):
    """An LRScheduler whose lr for group ``i`` is ``self._lr(i, s)`` at step ``s``."""

    def _lr(self, group: int, step: int) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    # DeepSpeed's schedules count from -1 (their last_batch_iteration); ours from 0
    _step_offset = 0

    def get_lr(self) -> list[Union[float, torch.Tensor]]:  # LRScheduler's type (floats here)
        s = self.last_epoch - self._step_offset
        return [self._lr(i, s) for i in range(len(self.optimizer.param_groups))]

    def _get_closed_form_lr(self) -> list[Union[float, torch.Tensor]]:
        return self.get_lr()


class _DeepSpeedIteration:
    """DeepSpeed's step index: ``last_batch_iteration = last_epoch - 1`` (-1 at construction)."""

    _step_offset = 1
    last_epoch: int

    @property
    def last_batch_iteration(self) -> int:
        return self.last_epoch - 1


class WarmupLR(_DeepSpeedIteration, _StepFunctionLR):
    """DeepSpeed ``WarmupLR``: warm up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold.
    At DeepSpeed's iteration -1 (before the first ``step()``) the lr is ``warmup_min_lr``."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: Union[Number, Sequence[Number]] = 0.0,
                 warmup_max_lr: Union[None, Number, Sequence[Number]] = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_epoch: int = -1):
        _positive_int("warmup_num_steps", warmup_num_steps)
        _check_warmup_type(warmup_type)
        if warmup_max_lr is None:
            warmup_max_lr = [g["lr"] for g in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = warmup_num_steps
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def _gamma(self, step: int) -> float:
        if step < 0:  # DeepSpeed's "before it has started": min_lr
            return 0.0
        return warmup_gamma(step, self.warmup_num_steps, self.warmup_type)

    def _lr(self, group: int, step: int) -> float:
        lo, hi = self.min_lrs[group], self.max_lrs[group]
        return lo + (hi - lo) * self._gamma(step)


class WarmupDecayLR(WarmupLR):
    """DeepSpeed ``WarmupDecayLR``: WarmupLR, then linear decay to 0 at ``total_num_steps``."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_lr: Union[Number, Sequence[Number]] = 0.0,
                 warmup_max_lr: Union[Number, Sequence[Number]] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_epoch: int = -1):
        self.total_num_steps = _positive_int("total_num_steps", total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_epoch)

    def _gamma(self, step: int) -> float:
        if step < 0:
            return 0.0
        return warmup_decay_gamma(step, self.warmup_num_steps, self.total_num_steps, self.warmup_type)


class _RatioLR(_StepFunctionLR):
    """lr of group ``i`` = ``base_lrs[i] * ratio(step)``."""

    def _ratio(self, step: int) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def _lr(self, group: int, step: int) -> float:
        return float(self.base_lrs[group]) * self._ratio(step)


class WarmupCosineLR(_DeepSpeedIteration, _RatioLR):
    """DeepSpeed ``WarmupCosineLR``: ratios of the optimizer's lr; ratio 0 at DeepSpeed's
    iteration -1 (before the first ``step()``), as there."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_epoch: int = -1):
        self.total_num_steps = _positive_int("total_num_steps", total_num_steps)
        self.warmup_min_ratio = _ratio("warmup_min_ratio", warmup_min_ratio)
        self.warmup_num_steps = _positive_int("warmup_num_steps", warmup_num_steps)
        self.cos_min_ratio = _ratio("cos_min_ratio", cos_min_ratio)
        _check_warmup_type(warmup_type)
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def _ratio(self, step: int) -> float:
        if step < 0:  # DeepSpeed returns 0.0 "before it has started", not warmup_min_ratio
            return 0.0
        return warmup_cosine_ratio(step, self.total_num_steps, self.warmup_min_ratio, self.warmup_num_steps,
                                   self.cos_min_ratio, self.warmup_type)


class CosineWithWarmup(_RatioLR):
    """``cosine``: warm up from 0 to the optimizer's lr, cosine down to ``min_lr_ratio``."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_num_steps: int, total_num_steps: int,
                 min_lr_ratio: float = 0.1, warmup_type: str = "linear", last_epoch: int = -1):
        self.warmup_num_steps = _positive_int("warmup_num_steps", warmup_num_steps, minimum=0)
        self.total_num_steps = _positive_int("total_num_steps", total_num_steps)
        if warmup_num_steps > total_num_steps:
            raise ConfigError(f"scheduler.params.warmup_num_steps ({warmup_num_steps}) exceeds total_num_steps "
                              f"({total_num_steps})")
        self.min_lr_ratio = _ratio("min_lr_ratio", min_lr_ratio)
        _check_warmup_type(warmup_type)
        if warmup_type == "log" and warmup_num_steps < 2:
            raise ConfigError("scheduler.params.warmup_type \"log\" needs warmup_num_steps >= 2")
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def _ratio(self, step: int) -> float:
        return cosine_ratio(step, self.warmup_num_steps, self.total_num_steps, self.min_lr_ratio, self.warmup_type)


class WSD(_RatioLR):
    """``WSD``: linear warmup, stable at the optimizer's lr, decay over the last
    ``decay_num_steps`` of ``total_num_steps`` to ``min_lr_ratio``."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_num_steps: int, total_num_steps: int,
                 decay_num_steps: int, min_lr_ratio: float = 0.0, decay_type: str = "linear",
                 last_epoch: int = -1):
        self.warmup_num_steps = _positive_int("warmup_num_steps", warmup_num_steps, minimum=0)
        self.total_num_steps = _positive_int("total_num_steps", total_num_steps)
        self.decay_num_steps = _positive_int("decay_num_steps", decay_num_steps, minimum=0)
        if warmup_num_steps + decay_num_steps > total_num_steps:
            raise ConfigError(f"scheduler.params: warmup_num_steps ({warmup_num_steps}) + decay_num_steps "
                              f"({decay_num_steps}) exceed total_num_steps ({total_num_steps})")
        self.min_lr_ratio = _ratio("min_lr_ratio", min_lr_ratio)
        if decay_type not in _DECAYS:
            raise ConfigError(f"scheduler.params.decay_type {decay_type!r} is not one of {sorted(_DECAYS)}")
        self.decay_type = decay_type
        super().__init__(optimizer, last_epoch)

    def _ratio(self, step: int) -> float:
        return wsd_ratio(step, self.warmup_num_steps, self.total_num_steps, self.decay_num_steps,
                         self.min_lr_ratio, self.decay_type)


SCHEDULERS: dict[str, type] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "cosine": CosineWithWarmup,
    "WSD": WSD,
}


def build_lr_scheduler(optimizer: Any, type: str, params: object) -> LRScheduler:
    """The scheduler named ``type`` (the config's ``scheduler.type``) with ``params``
    (``scheduler.params``, a dict or a config dataclass).

    ``optimizer`` is a torch optimizer, or a wrapper exposing one as ``.optimizer`` (the
    ZeRO optimizers: the schedule then drives the lr of the inner optimizer over the
    flat shards, which is the one that steps).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"build_lr_scheduler needs a torch optimizer (or a wrapper with .optimizer), "
                            f"got {optimizer.__class__.__name__}")
        optimizer = inner
    cls = SCHEDULERS.get(type)
    if cls is None:
        raise ConfigError(f"scheduler.type {type!r} is not one of {list(SCHEDULERS)}")
    if not isinstance(params, Mapping):
        if not dataclasses.is_dataclass(params):
            raise TypeError(f"scheduler params must be a dict or a config dataclass, got {params.__class__.__name__}")
        params = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    accepted = set(inspect.signature(cls).parameters) - {"self", "optimizer", "last_epoch"}
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise ConfigError(f"scheduler.params for {type} has unknown keys {unknown}; accepted: {sorted(accepted)}")
    return cls(optimizer, **dict(params))
