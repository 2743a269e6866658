"""Timestamps of pipeline actions: host time on CPU, CUDA events on a GPU.

On CUDA a compute action's Python call returns once its kernels are queued, so
``time.perf_counter()`` around it measures the enqueue, not the work, and the measured
bubble would be nonsense. :class:`DeviceClock` records a CUDA event pair per action on the
current stream instead and converts them to seconds only after the step
(:meth:`DeviceClock.resolve`), anchored on one event recorded at the start of the step:
no device sync per action. The anchor itself is taken after one synchronisation at the
start of a recorded step, so the times of different ranks on a host share
``time.perf_counter()``'s clock (records are a benchmark feature; training runs with
``record=False`` and pays nothing).
"""

from __future__ import annotations

import time
from typing import Any, Union, cast

import torch

__all__ = ["HostClock", "DeviceClock", "make_clock"]

Mark = Union[float, Any]  # perf_counter seconds, or a recorded torch.cuda.Event


class HostClock:
    """CPU: marks are ``time.perf_counter()`` seconds."""

    def start_step(self) -> None:
        pass

    def mark(self) -> Mark:
        return time.perf_counter()

    def resolve(self, marks: list[Mark]) -> list[float]:
        return [float(m) for m in marks]


class DeviceClock:
    """CUDA: marks are events on the current stream, resolved to seconds after the step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._anchor: Any = None
        self._anchor_s = 0.0

    def start_step(self) -> None:
        torch.cuda.synchronize(self.device)  # once per recorded step: anchors device time to host time
        self._anchor = torch.cuda.Event(enable_timing=True)
        self._anchor.record()
        self._anchor_s = time.perf_counter()

    def mark(self) -> Mark:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def resolve(self, marks: list[Mark]) -> list[float]:
        if not marks:
            return []
        cast(torch.cuda.Event, marks[-1]).synchronize()  # this clock's marks are events
        return [self._anchor_s + self._anchor.elapsed_time(m) / 1e3 for m in marks]


def make_clock(device: torch.device) -> Union[HostClock, DeviceClock]:
    return DeviceClock(device) if device.type == "cuda" else HostClock()
