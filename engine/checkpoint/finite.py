"""No checkpoint with non-finite state is ever published (issue 30).

A diverged run (NaN or inf in its fp32 master weights or optimizer moments) must not write
that state as a checkpoint: ``latest`` would name it, a resume would load it, and
``checkpoint.keep_last`` would delete the last good checkpoints to make room for it. So
every save first checks, on every rank, the tensors that rank would write (its owned
master shards and their element-wise optimizer state) and agrees on the outcome with one
all-reduce; any non-finite value anywhere refuses the save on every rank with
:class:`NonFiniteStateError`, before anything is written.

Cost: one ``aminmax`` pass over each tensor (no temporary of the tensor's size; NaN
propagates through ``max``), one host read, one all-reduce of a flag; the names are
gathered only when something is wrong.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from engine.checkpoint.format import CheckpointError, tensor_key
from engine.checkpoint.target import Checkpointable
from engine.distributed import comm
from engine.distributed.groups import AxisGroup

__all__ = ["NonFiniteStateError", "check_finite_state"]


class NonFiniteStateError(CheckpointError):
    """The state to save holds inf/NaN: nothing was written, ``latest`` is unchanged."""


def _local_tensors(engine: Checkpointable) -> list[tuple[str, torch.Tensor]]:
    """(key, tensor) of what this rank would write: its owned master shards and their state."""
    view = engine.optimizer.shard_view()
    out: list[tuple[str, torch.Tensor]] = []
    for gi, g in enumerate(view.groups):
        if not g.owner:
            continue
        st = view.group_state(gi)
        out.append((tensor_key(gi, "master"), st.master))
        out += [(tensor_key(gi, k), v) for k, v in st.elementwise.items()]
    return [(k, t) for k, t in out if t.is_floating_point() and t.numel() > 0]


def _not_finite(t: torch.Tensor) -> torch.Tensor:
    """0-dim bool on ``t``'s device: whether any element is inf or NaN."""
    lo, hi = torch.aminmax(t.detach().reshape(-1))
    return ~(torch.isfinite(lo) & torch.isfinite(hi))


def _first_bad(tensors: list[tuple[str, torch.Tensor]]) -> Optional[str]:
    for key, t in tensors:
        if bool(_not_finite(t)):
            return key
    return None


def check_finite_state(engine: Checkpointable) -> None:
    """Collective over the world: raise :class:`NonFiniteStateError` on every rank when any
    rank's master weights or optimizer state hold a non-finite value."""
    tensors = _local_tensors(engine)
    bad = torch.zeros((), dtype=torch.int32, device=engine.device)
    if tensors:
        flags = torch.stack([_not_finite(t).to(engine.device) for _, t in tensors])
        bad = flags.any().to(torch.int32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        comm.all_reduce(bad, AxisGroup.world(), op=dist.ReduceOp.MAX)
    if not bool(bad):
        return
    mine = _first_bad(tensors)
    everyone: list[Optional[str]] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    where = next(f"rank {r}: {k}" for r, k in enumerate(everyone) if k is not None)
    raise NonFiniteStateError(
        f"not saved at step {engine.global_steps}: the master weights or optimizer state hold inf/NaN ({where}); "
        "a checkpoint of a diverged state is never published ('latest' still names the previous one)")
