"""The one place that decides which torch APIs this process may use.

The engine is pinned to torch 2.13 on CPU but must run on older images (the GPU machines
carry torch 2.11). Every call whose name is newer than the oldest torch ``setup.py``
accepts goes through here: ``available(name)`` says whether torch has it, and the
wrappers below fall back to the older spelling with the same semantics.

``ENGINE_HIDE_NEWER_TORCH=1`` in the environment makes every newer-only API look absent,
so the test suite can run a smoke subset through the fallbacks on the pinned torch (a
call that bypasses this module and needs a newer torch then fails there, not on a GPU
image).

Newer-only APIs and their fallbacks:
- ``dist.reduce_scatter_single`` (2.13) -> ``dist.reduce_scatter_tensor`` (1.13+)
- ``dist.all_gather_single`` (2.13) -> ``dist.all_gather_into_tensor`` (1.13+)
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["NEWER_ONLY", "available", "hidden", "reduce_scatter_single", "all_gather_single"]

# name -> (module, attribute): APIs that exist only in torch newer than setup.py's minimum
NEWER_ONLY: dict[str, tuple[Any, str]] = {
    "dist.reduce_scatter_single": (dist, "reduce_scatter_single"),
    "dist.all_gather_single": (dist, "all_gather_single"),
}


def hidden() -> bool:
    """Whether newer-only APIs are hidden for this process (``ENGINE_HIDE_NEWER_TORCH=1``)."""
    return os.environ.get("ENGINE_HIDE_NEWER_TORCH", "") not in ("", "0")


def available(name: str) -> bool:
    """Whether torch has the newer-only API ``name`` (a key of :data:`NEWER_ONLY`) and it
    is not hidden."""
    module, attr = NEWER_ONLY[name]
    return not hidden() and hasattr(module, attr)


def _newer(name: str) -> Callable[..., Any]:
    module, attr = NEWER_ONLY[name]
    fn: Callable[..., Any] = getattr(module, attr)
    return fn


def reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, op: Any, group: Any, async_op: bool) -> Any:
    """``out`` (N, ...) <- this member's slice of the reduction of ``inp`` (world*N, ...)."""
    if available("dist.reduce_scatter_single"):
        return _newer("dist.reduce_scatter_single")(out, inp, op=op, group=group, async_op=async_op)
    return dist.reduce_scatter_tensor(out, inp, op=op, group=group, async_op=async_op)


def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool) -> Any:
    """``out`` (world*N, ...) <- every member's ``inp`` (N, ...) concatenated along dim 0."""
    if available("dist.all_gather_single"):
        return _newer("dist.all_gather_single")(out, inp, group=group, async_op=async_op)
    return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)
