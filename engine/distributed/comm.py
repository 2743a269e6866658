"""Typed wrappers for the collectives and batched point-to-point transfers the engine uses.

One place to adapt to torch's collective API (the ``*_single`` names of torch 2.13 or the
older ``*_tensor`` ones, chosen by :mod:`engine.torch_api`), to check shapes before a
collective (a shape mismatch otherwise hangs or corrupts silently on some backends), and
to keep the group an explicit argument. No hidden device syncs: async calls return the ``Work`` handle.

Strict NCCL-rules mode (:mod:`engine.distributed.strict`, on in the distributed test suite, off
by default): every call here is also checked for what NCCL requires and gloo forgives
(device type, contiguity, the same collective/dtype/size on every member, send/receive
headers, the per-group sequence of collectives).
"""

from __future__ import annotations

import zlib
from typing import Any, Sequence, Union

import torch
import torch.distributed as dist

from engine import torch_api
from engine.distributed import strict
from engine.distributed.groups import AxisGroup

__all__ = ["all_reduce", "reduce_scatter", "all_gather", "all_to_all_single", "broadcast", "batch_isend_irecv",
           "p2p_op", "group_size", "group_rank", "check_sequence", "no_host_sync"]

no_host_sync = strict.no_host_sync


def group_size(group: AxisGroup) -> int:
    return group.size


def group_rank(group: AxisGroup) -> int:
    """This rank's index in ``group``."""
    return group.rank


# torch's stubs type ``dist.ReduceOp.SUM`` etc. as the nested ``RedOpType`` enum, not ``ReduceOp``
ReduceOpLike = Union[dist.ReduceOp, dist.ReduceOp.RedOpType]


def _op_code(op: ReduceOpLike) -> int:
    return zlib.crc32(str(op).encode()) % 1000


def all_reduce(t: torch.Tensor, group: AxisGroup, op: ReduceOpLike = dist.ReduceOp.SUM,
               async_op: bool = False):
    """In place; a no-op on a group of one."""
    if group_size(group) == 1:
        return None
    strict.check_collective("all_reduce", t, group.process_group, extra=_op_code(op))
    return dist.all_reduce(t, op=op, group=group.process_group, async_op=async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: AxisGroup,
                   op: ReduceOpLike = dist.ReduceOp.SUM, async_op: bool = False, inp_is_scratch: bool = False):
    """``out`` (N,) <- this rank's slice of the reduction of ``inp`` (world*N,) along dim 0.
    ``inp_is_scratch``: the caller does not read ``inp`` afterwards, which lets gloo between
    two ranks reduce in place, one ``reduce`` per owner (:func:`_reduces_by_owner`)."""
    world = group_size(group)
    if inp.shape[0] != out.shape[0] * world or inp.shape[1:] != out.shape[1:]:
        raise ValueError(f"reduce_scatter: input {tuple(inp.shape)} must be {world} x output {tuple(out.shape)} along dim 0")
    if world == 1:
        out.copy_(inp)
        return None
    strict.check_tensor(inp, "reduce_scatter input")
    strict.check_collective("reduce_scatter", out, group.process_group, extra=_op_code(op))
    if inp_is_scratch and _reduces_by_owner(group):
        return _reduce_scatter_by_owner(out, inp, group, op, async_op)
    return torch_api.reduce_scatter_single(out, inp, op=op, group=group.process_group, async_op=async_op)


def _reduces_by_owner(group: AxisGroup) -> bool:
    """gloo between two ranks: gloo's reduce-scatter reduces the WHOLE tensor on every rank
    (an all-reduce, then the slice: each rank sends and receives the full size), while one
    ``reduce`` per owner moves each half once. Measured (2 CPU ranks, medians of 40, a shared
    machine): 2M fp32 4.6-9.6 ms vs 9.6-14.8 ms (reduce_scatter_single) and 8-16 ms (all_reduce);
    at 500k about even. NCCL's native reduce-scatter is already the optimal algorithm and is
    used as it is."""
    return group_size(group) == 2 and dist.get_backend(group.process_group) == dist.Backend.GLOO


def _reduce_scatter_by_owner(out: torch.Tensor, inp: torch.Tensor, group: AxisGroup, op: ReduceOpLike,
                             async_op: bool) -> Any:
    """``reduce_scatter`` as one ``reduce`` per member onto its own slice: slice r of ``inp``
    (N,) summed onto member r, which then holds it in ``inp``'s slice and copies it to ``out``
    (the reductions are in place, so the slices other members own come back unchanged only
    on their owners; ``inp`` is scratch, as for every caller here)."""
    n = out.shape[0]
    works = [dist.reduce(inp[r * n:(r + 1) * n], dst=group.global_rank_of(r), op=op, group=group.process_group,
                         async_op=True) for r in range(group_size(group))]
    handle = _CopyAfter(works, out, inp[group_rank(group) * n:(group_rank(group) + 1) * n])
    if async_op:
        return handle
    handle.wait()
    return None


class _CopyAfter:
    """The async handle of :func:`_reduce_scatter_by_owner`: waits for the reductions, then
    copies this member's reduced slice into ``out`` (once; later waits return at once)."""

    def __init__(self, works: Sequence[Any], out: torch.Tensor, mine: torch.Tensor):
        self.works, self.out, self.mine = list(works), out, mine

    def wait(self) -> bool:
        if self.works:
            for w in self.works:
                w.wait()
            self.works = []
            self.out.copy_(self.mine)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: AxisGroup, async_op: bool = False):
    """``out`` (world*N, ...) <- concatenation along dim 0 of every rank's ``inp`` (N, ...)."""
    world = group_size(group)
    if out.shape[0] != inp.shape[0] * world or out.shape[1:] != inp.shape[1:]:
        raise ValueError(f"all_gather: output {tuple(out.shape)} must be {world} x input {tuple(inp.shape)} along dim 0")
    if world == 1:
        out.copy_(inp)
        return None
    strict.check_tensor(out, "all_gather output")
    strict.check_collective("all_gather", inp, group.process_group)
    return torch_api.all_gather_single(out, inp, group=group.process_group, async_op=async_op)


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
                      group: AxisGroup) -> None:
    """``out`` <- the pieces every member sent this rank (``out_splits[r]`` rows from member
    r), ``inp`` split by ``in_splits`` (rows for each member), along dim 0. Blocking."""
    if group.size == 1:
        out.copy_(inp)
        return
    strict.check_all_to_all(inp, out, in_splits, out_splits, group.process_group)
    dist.all_to_all_single(out, inp, list(out_splits), list(in_splits), group=group.process_group)


def broadcast(t: torch.Tensor, src: int, group: AxisGroup, async_op: bool = False):
    """``src`` is a GLOBAL rank, as in torch.distributed."""
    if group_size(group) == 1:
        return None
    if src not in group.ranks:
        raise ValueError(f"broadcast: source rank {src} is not in the {group.name} group {list(group.ranks)}")
    strict.check_collective("broadcast", t, group.process_group, extra=src)
    return dist.broadcast(t, src=src, group=group.process_group, async_op=async_op)


def p2p_op(op: Any, t: torch.Tensor, peer: int, group: AxisGroup) -> dist.P2POp:
    """A send or receive (``dist.isend`` / ``dist.irecv``) to global rank ``peer`` over
    ``group``'s communicator, for :func:`batch_isend_irecv`."""
    if peer not in group.ranks or peer == group.global_rank:
        raise ValueError(f"p2p: peer {peer} must be another member of the {group.name} group {list(group.ranks)}")
    return dist.P2POp(op, t, peer, group.process_group)


def batch_isend_irecv(ops: Sequence[dist.P2POp]) -> list[Any]:
    """Post a batch of sends and receives (``dist.P2POp`` with the group's communicator, so no
    pairwise communicator is created); returns the works to wait for. Ops between two ranks
    must be posted in the same order on both. Strict mode adds a shape/dtype header to each."""
    if not ops:
        return []
    if strict.enabled():
        return strict.checked_batch_isend_irecv(list(ops))
    return dist.batch_isend_irecv(list(ops))


def check_sequence(groups: Sequence[AxisGroup], where: str, device: torch.device) -> None:
    """Strict mode: compare each group's running hash of collectives across its members (call
    at step boundaries, same groups in the same order on every rank). Free when off; size-1
    groups carry no collectives and are skipped."""
    strict.check_sequence([g.process_group for g in groups if g.size > 1], where, device)
