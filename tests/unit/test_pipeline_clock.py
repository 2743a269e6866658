"""Pipeline action timestamps on CUDA come from events resolved after the step.

Fake CUDA events stand in for the GPU (they stamp the host clock when recorded): the
device clock must synchronise once at the start of a recorded step and once when the
records are resolved, never per action, and give the same times the host clock would.
"""

import time

import torch
from fake_cuda import FakeEvent

from engine.pipeline.clock import DeviceClock, HostClock, make_clock


def test_device_clock_syncs_once_per_step_and_resolves_after(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    clock = make_clock(torch.device("cuda", 0))
    assert isinstance(clock, DeviceClock)
    clock.start_step()
    marks = []
    for _ in range(3):
        marks.append(clock.mark())
        time.sleep(0.005)
        marks.append(clock.mark())
    assert len(syncs) == 1  # only the anchor
    times = clock.resolve(marks)
    assert len(syncs) == 1 and times == sorted(times)
    assert all(b - a >= 0.004 for a, b in zip(times[::2], times[1::2]))
    assert abs(times[0] - time.perf_counter()) < 5.0  # on the host's perf_counter clock


def test_host_clock_on_cpu():
    clock = make_clock(torch.device("cpu"))
    assert isinstance(clock, HostClock)
    a, b = clock.mark(), clock.mark()
    assert clock.resolve([a, b]) == [a, b]
