"""Which half of a split backward is running (zero-bubble schedules).

:mod:`engine.pipeline.split_backward` sets it around its input-gradient and weight-gradient
passes; autograd functions whose one backward computes both gradients (the FP8 linear,
:mod:`engine.precision.fp8`) read it and compute only the half asked for. It lives here,
below both, so the FP8 layer does not import the pipeline.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Literal, Optional

__all__ = ["Phase", "backward_phase", "in_phase"]

Phase = Literal["input", "weight"]

# A process-wide value, not thread-local: on CUDA autograd runs the backward on its own
# device thread. One backward runs at a time per process.
_PHASE: Optional[Phase] = None


def backward_phase() -> Optional[Phase]:
    """The half of a split backward now running: ``"input"`` (only input gradients are
    wanted), ``"weight"`` (restarted junctions: only parameter gradients), None for an
    ordinary backward (both)."""
    return _PHASE


@contextmanager
def in_phase(phase: Phase) -> Iterator[None]:
    """``backward_phase()`` is ``phase`` inside the block (restored after, nesting allowed)."""
    global _PHASE
    prev, _PHASE = _PHASE, phase
    try:
        yield
    finally:
        _PHASE = prev
