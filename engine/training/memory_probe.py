"""The one-step memory probe behind ``memory.json``'s ``activation_peak_bytes``.

The trainer runs ONE step (the run's second, so that state made lazily in the first step,
gradient accumulators and buffers, counts as held before) with a probe active; the engine
opens the probe's ``forward_backward`` phase around that step's forward and backward
passes. The phase's value is the high-water mark of tensor bytes allocated inside it over
those alive at its entry: the activations (saved for backward and transient), the
gradients being produced, communication buffers; not the parameters, gradient
accumulators and optimizer state the rank held already.

- CPU (and any non-CUDA device): :class:`engine.zero.peak.LiveMemoryTracker`, a dispatch
  mode counting every storage an operator returns, exactly (a Python call per operator,
  so that step's tokens/s is lower); every tensor alive when the probe starts is
  registered first and the phase counts over those bytes, so that state first touched in
  the step through a view (a weight's ``.t()``, a slice of a flat buffer) is not counted;
- CUDA: :class:`CudaPeakProbe`, the caching allocator's own counters
  (``max_memory_allocated`` over ``memory_allocated`` at the phase's entry; no dispatch mode,
  which compiled kernels such as flex attention would not run under).
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from typing import Iterator

import torch

from engine.engine import Engine
from engine.zero.peak import LiveMemoryTracker

__all__ = ["CudaPeakProbe", "memory_probe"]


class CudaPeakProbe:
    """Per-phase peak of allocated CUDA bytes over those allocated at the phase's entry."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phases: dict[str, int] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - base
            self.phases[name] = max(self.phases.get(name, 0), peak)


@contextlib.contextmanager
def memory_probe(engine: Engine, on: bool) -> Iterator[None]:
    """``engine.memory_probe`` set for the block when ``on`` (module docstring)."""
    if not on:
        yield
        return
    if engine.device.type == "cuda":
        engine.memory_probe = CudaPeakProbe(engine.device)
        try:
            yield
        finally:
            engine.memory_probe = None
        return
    with LiveMemoryTracker() as tracker:
        # every tensor alive now (parameters, gradient accumulators, flat ZeRO buffers,
        # optimizer state) counts as held before the phase: the tracker registers a storage
        # it has not seen when an operator first returns a view of it (a weight's .t(), a
        # slice of a flat buffer), which would otherwise count state as activations
        with warnings.catch_warnings():  # isinstance on deprecated torch.distributed names warns
            warnings.simplefilter("ignore")
            tracker.track([o for o in gc.get_objects() if isinstance(o, torch.Tensor)])
        tracker.current = 0  # the phase's peak is then over the bytes alive now (as on CUDA)
        tracker.reset_peak()
        engine.memory_probe = tracker
        try:
            yield
        finally:
            engine.memory_probe = None
