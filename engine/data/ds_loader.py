"""The loader ``initialize(training_data=...)`` returns, ordered as DeepSpeed 0.19.8's.

DeepSpeed's ``deepspeed_io`` (runtime/engine.py, runtime/dataloader.py), per data-parallel rank:

- engine without a pipeline: a ``DistributedSampler(dataset, num_replicas=replicas, rank=replica)``
  with torch's defaults (``shuffle=True``, ``seed=0``, ``drop_last=False``: the index list is
  padded by wrapping round to a multiple of ``dp``), micro-batches of
  ``train_micro_batch_size_per_gpu``, and the last short micro-batch kept unless the config's
  ``dataloader_drop_last`` is true. DeepSpeed never calls ``set_epoch``: every pass over the
  loader repeats the first one's order unless the script calls
  ``loader.data_sampler.set_epoch(e)``.
- pipeline engine (its first and last stages read data): the same sampler with
  ``shuffle=False``, the loader wrapped in a :class:`RepeatingLoader` (it never runs out).

So the rows rank ``r`` reads are a pure function of (dataset length, dp, r, micro-batch size,
drop_last, pipeline), independent of the config's ``seed``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = ["DeepSpeedDataLoader", "RepeatingLoader", "deepspeed_loader"]


class DeepSpeedDataLoader(DataLoader):
    """A ``DataLoader`` with DeepSpeed's attribute names: ``data_sampler`` is the sampler
    (``loader.data_sampler.set_epoch(e)`` reshuffles, as in DeepSpeed)."""

    @property
    def data_sampler(self) -> Any:
        return self.sampler


class RepeatingLoader:
    """DeepSpeed's ``RepeatingLoader``: iterates ``loader`` forever, restarting it when it
    runs out (a new ``iter(loader)``, so the same order again unless its sampler's epoch moved)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter: Iterator[Any] = iter(loader)

    def __iter__(self) -> "RepeatingLoader":
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def deepspeed_loader(data: Dataset, micro_batch: int, replicas: int, replica: int, *,
                     collate_fn: Optional[Callable] = None, drop_last: bool = False, pipeline: bool = False,
                     pin_memory: bool = False) -> Any:
    """This DP rank's loader over ``data`` as DeepSpeed builds it (module docstring):
    a :class:`DeepSpeedDataLoader`, or with ``pipeline`` a :class:`RepeatingLoader` over an
    unshuffled one."""
    if not isinstance(data, Dataset):
        raise TypeError(f"training_data must be a torch.utils.data.Dataset, got {type(data).__name__}")
    sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=replicas, rank=replica,
                                                          shuffle=not pipeline)  # seed 0, no drop: DeepSpeed's
    loader = DeepSpeedDataLoader(data, batch_size=micro_batch, sampler=sampler, collate_fn=collate_fn,
                                 drop_last=drop_last, pin_memory=pin_memory)
    return RepeatingLoader(loader) if pipeline else loader
