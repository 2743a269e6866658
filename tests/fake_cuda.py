"""CUDA events on a CPU machine, for tests of code that times the GPU without draining it.

``patch_cuda_timing(monkeypatch, what)`` replaces ``torch.cuda.Event`` by :class:`FakeEvent`
(host clock, milliseconds like CUDA's) and makes ``torch.cuda.synchronize`` raise, naming
``what``: a test then fails if the code under test drains the device where it must not.
"""

from __future__ import annotations

import time

import torch


class FakeEvent:
    """``torch.cuda.Event(enable_timing=True)`` on the host clock."""

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "timing events must be created with enable_timing=True"
        self.t: float | None = None

    def record(self, stream: object = None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "FakeEvent") -> float:
        assert self.t is not None and other.t is not None, "elapsed_time before both events were recorded"
        return (other.t - self.t) * 1e3


def patch_cuda_timing(monkeypatch, what: str) -> None:
    def no_sync(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"device-wide synchronize in {what}")

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
