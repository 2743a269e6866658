"""Exact high-water marks of the tensor memory a process holds, per phase.

:class:`LiveMemoryTracker` is a ``TorchDispatchMode``: every tensor an operator returns
while it is active has its storage registered once (bytes, keyed by the storage) with a
weak reference whose callback subtracts the bytes when the storage is freed. ``current``
is therefore the exact number of bytes of tensor storage alive that the tracker has seen
(or was told about with :meth:`track`), and ``peak`` its maximum, updated at every
operator. Per-phase maxima (``with tracker.phase("forward"):``) nest.

Why this method (on CPU, where torch keeps no allocator statistics):

- it is exact and deterministic: it does not depend on glibc's arenas, the interpreter,
  other processes or page-level reuse, so a test can bound it tightly;
- it sees every storage created through the dispatcher on this thread and the autograd
  engine's (parameters, gradients, optimizer state, activations, communication buffers
  the engine allocates). It does NOT see memory a backend allocates in C++ outside the
  dispatcher (e.g. gloo's internal staging buffers) or Python objects; the process RSS
  (:func:`engine.metrics.peak_memory_bytes` with ``MALLOC_MMAP_THRESHOLD_`` fixed, so freed
  large tensors leave the RSS at once) is the cross-check that includes them, and
  ``benchmarks/memory.py`` reports both.

On CUDA use ``torch.cuda.max_memory_allocated`` (:func:`engine.metrics.peak_memory_bytes`);
the tracker works there too but is slower than the allocator's own counters.

The mode costs a Python call per operator: use it in tests and benchmarks, not in training.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Iterable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveMemoryTracker", "saved_activation_bytes"]


class LiveMemoryTracker(TorchDispatchMode):
    """Exact live tensor bytes and their high-water mark (see the module docstring).

    ``with LiveMemoryTracker() as t: ...`` then ``t.peak``, ``t.current``, ``t.phases``
    (name -> peak bytes reached inside ``with t.phase(name):``, max over repetitions).
    ``device``: count only storages on this device type (default: all).
    """

    def __init__(self, device: Optional[str] = None):
        super().__init__()
        self.device = device
        self.current = 0
        self.peak = 0
        self.phases: dict[str, int] = {}
        self._open: list[list[Any]] = []  # [name, peak inside] of the phases entered
        self._live: dict[int, tuple[int, Any]] = {}  # storage key -> (bytes, weakref)

    # ------------------------------------------------------------------ bookkeeping
    def track(self, tensors: Iterable[Optional[torch.Tensor]]) -> None:
        """Count tensors that existed before the tracker started (each storage once)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._register(t)
        self._bump()

    def _register(self, t: torch.Tensor, add: bool = True) -> None:
        if self.device is not None and t.device.type != self.device:
            return
        if t.is_meta or t.layout != torch.strided:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
            return
        key = st._cdata
        nbytes = st.nbytes()
        if key in self._live:
            old, ref = self._live[key]
            if old != nbytes:  # resized in place
                self.current += nbytes - old
                self._live[key] = (nbytes, ref)
            return
        if not add:
            return
        ref = weakref.ref(st, functools.partial(self._freed, key))
        self._live[key] = (nbytes, ref)
        self.current += nbytes

    def _freed(self, key: int, _ref: Any) -> None:  # weakref callback
        self._free(key)

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[0]

    def _bump(self) -> None:
        if self.current > self.peak:
            self.peak = self.current
        for ph in self._open:
            if self.current > ph[1]:
                ph[1] = self.current

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._register(t)
        # in-place ops can resize an argument's storage (resize_, set_, and the storage
        # resize ZeRO-3 frees gathered parameters with, whose schema is not marked mutable):
        # re-read the size of every tracked storage an op touched
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                self._register(t, add=False)
        self._bump()
        return out

    # ------------------------------------------------------------------ phases
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record the peak reached inside the block as ``phases[name]`` (max over uses)."""
        entry: list[Any] = [name, self.current]
        self._open.append(entry)
        try:
            yield
        finally:
            self._open.remove(entry)
            self.phases[name] = max(self.phases.get(name, 0), entry[1])

    def live_storage_bytes(self) -> list[int]:
        """The size of every tracked storage alive now (bytes, one entry per storage)."""
        return [nbytes for nbytes, _ in self._live.values()]

    def reset_peak(self) -> None:
        """Start a new high-water mark from the bytes alive now."""
        self.peak = self.current


def saved_activation_bytes(module: torch.nn.Module, fn: Any) -> int:
    """Bytes of the activations one call ``out = fn()`` keeps for backward: the storages of
    every tensor autograd saves during it, each once, parameters of ``module`` excluded,
    plus the output (its gradient has the same size). Run it on an unsharded module (in a
    ZeRO-3 model the saved parameter views would count as activations)."""
    params = {p.untyped_storage()._cdata for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in params:
            seen[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return sum(seen.values()) + sum(t.untyped_storage().nbytes() for t in outs
                                    if t.untyped_storage()._cdata not in seen)
