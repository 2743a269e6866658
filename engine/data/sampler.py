"""Which sequences form the global batch at each step, and how it is split across ranks.

The global batch at step ``s`` is a pure function of ``(seed, s, global_batch)`` and the
dataset: sample ``k = s * global_batch + j`` (``j`` = row) is position ``k mod N`` of
epoch ``k // N``'s permutation of the ``N`` sequences. Nothing here knows the dp, tp or pp
degree or the micro-batch split, so changing them cannot change the data:

- DP rank ``r`` of ``dp`` takes rows ``[r * G/dp, (r + 1) * G/dp)`` (``dp_slice``);
- its rows are cut into ``G / (dp * micro_batch)`` consecutive micro-batches (``microbatches``);
- TP and PP ranks of one DP replica call the same functions with the same DP rank, so they
  see the same rows (the first and last pipeline stages use inputs and targets).

Concatenating the micro-batches of DP rank 0, then rank 1, ... gives the global batch.

Epoch permutations are derived from a SplitMix64 hash of ``(seed, epoch, index)`` and an
argsort, not from a library RNG, so they are identical across numpy/torch versions and
machines (a resumed run sees the same data).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import List, TypeVar

import numpy as np

from engine.data.errors import DataError
from engine.data.packing import Batch, PackedDataset

__all__ = ["GlobalBatchSampler", "batch_at", "dp_slice", "microbatches", "epoch_permutation",
           "sample_indices", "accumulation_steps"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # odd, so i -> base + i * GOLDEN is injective mod 2**64

T = TypeVar("T")


def _mix64_int(x: int) -> int:
    """SplitMix64 finalizer on a Python int (a bijection of 64-bit words)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix64(x: np.ndarray) -> np.ndarray:
    """The same finalizer on a uint64 array (array arithmetic wraps mod 2**64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise DataError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def epoch_permutation(num_sequences: int, seed: int, epoch: int) -> np.ndarray:
    """The order ``(N,)`` int64 in which epoch ``epoch`` visits the sequences."""
    _check_int("num_sequences", num_sequences, 1)
    _check_int("seed", seed, 0)
    _check_int("epoch", epoch, 0)
    base = _mix64_int(_mix64_int(seed) ^ _mix64_int(epoch + _GOLDEN))
    i = np.arange(num_sequences, dtype=np.uint64)
    # Distinct inputs give distinct keys (both maps are injective), so the order has no ties.
    keys = _mix64(np.uint64(base) + i * np.uint64(_GOLDEN))
    return np.argsort(keys, kind="stable").astype(np.int64)


def sample_indices(step: int, global_batch: int, num_sequences: int, seed: int) -> np.ndarray:
    """Sequence indices ``(global_batch,)`` of the global batch at ``step``."""
    return _Indexer(num_sequences, seed).at(step, global_batch)


class _Indexer:
    """Epoch permutations with a small cache (a batch touches at most a few epochs)."""

    def __init__(self, num_sequences: int, seed: int, cache_size: int = 2) -> None:
        self.n = _check_int("num_sequences", num_sequences, 1)
        self.seed = _check_int("seed", seed, 0)
        self.cache_size = cache_size
        self._perms: "OrderedDict[int, np.ndarray]" = OrderedDict()

    def perm(self, epoch: int) -> np.ndarray:
        if epoch in self._perms:
            self._perms.move_to_end(epoch)
        else:
            self._perms[epoch] = epoch_permutation(self.n, self.seed, epoch)
            while len(self._perms) > self.cache_size:
                self._perms.popitem(last=False)
        return self._perms[epoch]

    def at(self, step: int, global_batch: int) -> np.ndarray:
        step = _check_int("step", step, 0)
        global_batch = _check_int("global batch size", global_batch, 1)
        k = step * global_batch + np.arange(global_batch, dtype=np.int64)  # (G,) sample numbers
        epochs, pos = k // self.n, k % self.n
        out = np.empty(global_batch, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self.perm(int(e))[pos[sel]]
        return out


def accumulation_steps(global_batch: int, micro_batch: int, replicas: int) -> int:
    """Gradient-accumulation steps ``G / (micro_batch * dp)``; raises unless it divides."""
    _check_int("global batch size", global_batch, 1)
    _check_int("micro batch size", micro_batch, 1)
    _check_int("dp size", replicas, 1)
    if global_batch % (micro_batch * replicas):
        raise DataError(f"train_batch_size {global_batch} is not divisible by "
                        f"train_micro_batch_size_per_gpu {micro_batch} x dp {replicas}; choose "
                        "sizes with train_batch_size = micro_batch x accumulation_steps x dp")
    return global_batch // (micro_batch * replicas)


def dp_slice(batch: T, replica: int, replicas: int) -> T:
    """Rows of ``batch`` (a ``Batch``, tensor or array) that ``replica`` (its index in the batch
    role, ``Role.BATCH``: the ranks that read different rows) trains on."""
    _check_int("dp size", replicas, 1)
    if not 0 <= replica < replicas:
        raise DataError(f"dp rank {replica} out of range for dp size {replicas}")
    rows = len(batch)  # type: ignore[arg-type]
    if rows % replicas:
        raise DataError(f"a global batch of {rows} rows cannot be split over dp = {replicas} ranks; "
                        "make train_batch_size a multiple of the data-parallel degree")
    per = rows // replicas
    return _rows(batch, replica * per, (replica + 1) * per)


def microbatches(batch: T, micro_batch: int) -> List[T]:
    """Cut ``batch`` into consecutive micro-batches of ``micro_batch`` rows."""
    _check_int("micro batch size", micro_batch, 1)
    rows = len(batch)  # type: ignore[arg-type]
    if rows % micro_batch:
        raise DataError(f"{rows} rows per data-parallel rank cannot be cut into micro-batches of "
                        f"{micro_batch}; make train_batch_size / dp a multiple of "
                        "train_micro_batch_size_per_gpu")
    return [_rows(batch, i, i + micro_batch) for i in range(0, rows, micro_batch)]


def _rows(batch, start: int, stop: int):
    return batch.rows(start, stop) if isinstance(batch, Batch) else batch[start:stop]


class GlobalBatchSampler:
    """The data of every step for a fixed global batch size and seed.

    ``local_batch`` reads only the rows of one DP rank (what a training rank should call);
    ``batch_at`` reads all of them (references and tests).
    """

    def __init__(self, dataset: PackedDataset, global_batch: int, seed: int) -> None:
        self.dataset = dataset
        self.global_batch = _check_int("global batch size", global_batch, 1)
        self.seed = _check_int("seed", seed, 0)
        self._indexer = _Indexer(len(dataset), self.seed)

    def indices_at(self, step: int) -> np.ndarray:
        """Sequence indices ``(global_batch,)`` at ``step``."""
        return self._indexer.at(step, self.global_batch)

    def batch_at(self, step: int) -> Batch:
        """The whole global batch at ``step``: tokens ``(global_batch, seq_len + 1)``."""
        return self.dataset.batch(self.indices_at(step))

    def local_batch(self, step: int, replica: int, replicas: int) -> Batch:
        """``dp_slice(batch_at(step), replica, replicas)``, reading only those rows."""
        return self.dataset.batch(dp_slice(self.indices_at(step), replica, replicas))

    def local_microbatches(self, step: int, replica: int, replicas: int,
                           micro_batch: int) -> List[Batch]:
        """The micro-batches ``replica`` (of ``replicas`` in the batch role) accumulates over at ``step``."""
        accumulation_steps(self.global_batch, micro_batch, replicas)
        return microbatches(self.local_batch(step, replica, replicas), micro_batch)


def batch_at(dataset: PackedDataset, step: int, global_batch: int, seed: int) -> Batch:
    """The global batch at ``step`` (a one-off ``GlobalBatchSampler(...).batch_at(step)``)."""
    return GlobalBatchSampler(dataset, global_batch, seed).batch_at(step)
