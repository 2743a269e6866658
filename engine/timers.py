"""Per-phase wall-clock timers for ``wall_clock_breakdown`` (DeepSpeed's key of that name).

The engine times its phases with :meth:`PhaseTimers.phase`; each optimizer step the
accumulated seconds are closed into one record (:meth:`PhaseTimers.end_step`), which the
engine logs every ``steps_per_print`` steps and the trainer writes into ``metrics.jsonl``.

Phases (milliseconds per optimizer step, summed over its micro-batches):

- ``forward`` / ``backward``: the DeepSpeed loop's calls (``backward`` includes the bucket
  reductions the hooks launch when ``overlap_comm`` is on);
- ``reduce``: the gradient reductions left after backward, waited for (DP all-reduce or
  reduce-scatter, tied-weight sums), and unscaling;
- ``step``: global norm, clipping, the optimizer update and publishing the new parameters
  (the ZeRO-1/2/3 all-gather), the LR schedule;
- ``offload_copy_out`` / ``offload_cpu_step`` / ``offload_copy_back`` (inside ``step``, with
  ``zero_optimization.offload_optimizer``): the reduced gradient shards copied to the host,
  the optimizer step on the CPU, the updated shards copied back to the device and published;
- ``pipeline``: with pipeline parallelism, the whole schedule (forward, backward and the
  point-to-point transfers interleave, so they are not separable here; the executor's
  ``record`` gives per-action times).

On a GPU each boundary synchronises the device so that a phase is charged with its own
kernels; that costs throughput, which is why the timers are off by default. Disabled,
:meth:`phase` is a no-op context.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional

import torch

__all__ = ["PhaseTimers"]


class PhaseTimers:
    """Seconds per named phase, accumulated over one optimizer step."""

    def __init__(self, enabled: bool, device: Optional[torch.device] = None) -> None:
        self.enabled = bool(enabled)
        self._sync = device is not None and device.type == "cuda"
        self._current: dict[str, float] = {}
        self.last: dict[str, float] = {}  # milliseconds per phase of the last finished step

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        t0 = self._now()
        try:
            yield
        finally:
            self._current[name] = self._current.get(name, 0.0) + self._now() - t0

    def end_step(self) -> dict[str, float]:
        """Close the step: its phases in milliseconds become :attr:`last` (empty when off)."""
        self.last = {k: v * 1e3 for k, v in self._current.items()}
        self._current = {}
        return self.last

    def summary(self) -> str:
        """``"forward 12.3 | backward 25.0 | ..."`` (ms) of the last step."""
        return " | ".join(f"{k} {v:.1f}" for k, v in self.last.items())
