"""``deepspeed.runtime.utils``: :func:`set_random_seed`, :func:`move_to_device`,
:func:`see_memory_usage`, :func:`noop_context`, with DeepSpeed's meaning."""

from __future__ import annotations

import contextlib
import gc
import random
from typing import Any, Callable, Iterator, Optional

import numpy
import torch
import torch.distributed as dist

from engine.compat.deepspeed.accelerator import get_accelerator

__all__ = ["set_random_seed", "move_to_device", "see_memory_usage", "noop_context"]


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy (``seed mod 2**32``) and torch (``seed mod 2**63``), as
    DeepSpeed does (the same three generators, the same reductions)."""
    random.seed(seed)
    numpy.random.seed(seed % (2**32))
    torch.manual_seed(seed % (2**63))


def move_to_device(item: Any, device: Any, criterion_func: Optional[Callable[[Any], bool]] = None) -> Any:
    """DeepSpeed's: ``item`` (a tensor, or lists / tuples / dicts of them, nested) moved to
    ``device``; an item ``criterion_func`` accepts is moved in place (its ``.data``
    replaced) and returned as the same object."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device)


def see_memory_usage(message: str, force: bool = False) -> None:
    """DeepSpeed's: with ``force``, rank 0 prints ``message``, the accelerator's allocated /
    reserved memory (GB, current and peak) and the host's used memory, then resets the peak."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    import psutil

    gc.collect()
    acc, gb = get_accelerator(), 1024**3
    print(message)  # noqa: T201 (DeepSpeed's see_memory_usage prints)
    print(f"MA {acc.memory_allocated() / gb:.2f} GB Max_MA {acc.max_memory_allocated() / gb:.2f} GB "  # noqa: T201
          f"CA {acc.memory_reserved() / gb:.2f} GB Max_CA {acc.max_memory_reserved() / gb:.2f} GB")
    vm = psutil.virtual_memory()
    print(f"CPU Virtual Memory:  used = {(vm.total - vm.available) / gb:.2f} GB, percent = {vm.percent}%")  # noqa: T201
    acc.reset_peak_memory_stats()


@contextlib.contextmanager
def noop_context() -> Iterator[None]:
    yield
