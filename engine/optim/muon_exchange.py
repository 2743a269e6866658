"""Distributed Newton–Schulz: each matrix orthogonalised once, whole, on its owner rank.

Input: the Nesterov update of one ZeRO bucket on this rank, ``(shard_numel,)`` fp32 (the
fully reduced, fully accumulated gradient blended with the momentum, element-wise on the
shard). Output: the orthogonalised update of the same elements. Per bucket, in the same
order on every rank of the stage:

1. DP, ZeRO-1/2/3: one all-to-all sends each matrix's pieces (a matrix may straddle shard
   boundaries) from the ranks that hold them to the matrix's DP owner, which then holds its
   owned matrices whole (TP-local) and nothing else. ZeRO-0: every rank holds the bucket.
2. TP (only on the DP rank that owns some TP-sharded matrices of the bucket, with all TP
   ranks of that DP rank): all-gather the TP slices of those matrices; each matrix's TP
   owner rebuilds the full matrix (``unshard_tensors``), runs Newton–Schulz once per part,
   and the slices go back by one reduce-scatter (every other rank contributes zeros, so the
   sum is exact). A TP-replicated matrix is computed by its TP owner and summed the same way.
3. DP, ZeRO-1/2/3: the reverse all-to-all returns every rank its pieces of the results.
   ZeRO-0: the owners write their results into a zero copy of the bucket and one all-reduce
   gives everyone every result (exact for the same reason).

Communication per step over DP (ZeRO-1/2/3): each element of a Muon matrix travels at most
once to its owner and once back (elements already on their owner do not move): at most
2 x 4 B x Muon parameters / DP sent per rank on average. Memory: the owner holds only its
own matrices whole (a transient of its share, ~1/DP of the bucket). Over TP: twice the
TP-sharded matrices owned by each DP rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from engine.distributed import comm
from engine.optim.muon_plan import MuonMatrix
from engine.tensor_parallel.layers import shard_tensor, unshard_tensors
from engine.zero.shard_view import BucketView, ShardView

__all__ = ["ExchangeStats", "orthogonalize_bucket", "orthogonalize_full"]

NsFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class ExchangeStats:
    """Counters of this rank: Newton–Schulz calls, wall and CPU seconds (the CPU time is what
    the rank computed, also when ranks share cores; on CUDA both are launch times, the
    kernels being asynchronous), elements passed to the collectives."""

    ns_calls: int = 0
    ns_seconds: float = 0.0
    ns_cpu_seconds: float = 0.0
    comm_elements: int = 0
    per_step: list[int] = field(default_factory=list)


def orthogonalize_full(full: torch.Tensor, m: MuonMatrix, ns: NsFn, stats: ExchangeStats) -> torch.Tensor:
    """The orthogonalised full matrix (fp32), one Newton–Schulz per part of ``m``."""
    t0, c0 = time.perf_counter(), time.process_time()
    outs = []
    for part in full.split(list(m.parts), dim=m.part_dim):
        outs.append(ns(part).to(torch.float32))
        stats.ns_calls += 1
    stats.ns_seconds += time.perf_counter() - t0
    stats.ns_cpu_seconds += time.process_time() - c0
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=m.part_dim)


def _tp_exchange(view: ShardView, updates: dict[int, torch.Tensor], bv: BucketView, mats: Sequence[MuonMatrix],
                 ns: NsFn, stats: ExchangeStats) -> dict[int, torch.Tensor]:
    """Results ``{slot: (numel,) fp32}`` for this DP rank's ``mats`` of one bucket, from
    their TP-local updates ``{slot: (numel,)}``."""
    out: dict[int, torch.Tensor] = {}
    world, rank = view.tp_size, view.tp_rank

    def local(m: MuonMatrix) -> torch.Tensor:
        return updates[m.slot]

    if world == 1:
        for m in mats:
            out[m.slot] = orthogonalize_full(local(m).view(m.local_shape), m, ns, stats).reshape(-1)
        return out
    sharded = [m for m in mats if m.tp_dim is not None]
    replicated = [m for m in mats if m.tp_dim is None]
    if sharded:
        offs, n = [], 0
        for m in sharded:
            offs.append(n)
            n += bv.params[m.slot].numel
        send = torch.cat([local(m) for m in sharded])                       # (n,)
        gathered = torch.empty(world * n, dtype=send.dtype, device=send.device)
        comm.all_gather(gathered, send, view.tp_group)                      # (tp * n,)
        result = torch.zeros_like(gathered)
        for m, o in zip(sharded, offs):
            if m.tp_owner != rank or m.tp_dim is None:
                continue
            k = bv.params[m.slot].numel
            slices = [gathered[t * n + o:t * n + o + k].view(m.local_shape) for t in range(world)]
            parts = m.parts if len(m.parts) > 1 else None
            whole = orthogonalize_full(unshard_tensors(slices, m.tp_dim, parts), m, ns, stats)  # full_shape
            for t in range(world):
                result[t * n + o:t * n + o + k] = shard_tensor(whole, m.tp_dim, t, world, parts).reshape(-1)
        mine = torch.empty(n, dtype=send.dtype, device=send.device)
        comm.reduce_scatter(mine, result, view.tp_group)
        stats.comm_elements += 2 * world * n
        for m, o in zip(sharded, offs):
            out[m.slot] = mine[o:o + bv.params[m.slot].numel]
    if replicated:
        offs, n = [], 0
        for m in replicated:
            offs.append(n)
            n += bv.params[m.slot].numel
        buf = torch.zeros(n, dtype=torch.float32, device=local(replicated[0]).device)
        for m, o in zip(replicated, offs):
            if m.tp_owner == rank:
                buf[o:o + bv.params[m.slot].numel] = orthogonalize_full(
                    local(m).view(m.local_shape), m, ns, stats).reshape(-1)
        comm.all_reduce(buf, view.tp_group)
        stats.comm_elements += n
        for m, o in zip(replicated, offs):
            out[m.slot] = buf[o:o + bv.params[m.slot].numel]
    return out


def _piece(bv: BucketView, slot: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of parameter ``slot`` (its own flat indices) inside DP shard ``rank``."""
    s = bv.params[slot]
    a, b = bv.layout.shard_range(rank)
    lo, hi = max(s.bucket_offset, a), min(s.bucket_offset + s.numel, b)
    return (lo - s.bucket_offset, hi - s.bucket_offset) if lo < hi else (0, 0)


def _to_owners(view: ShardView, bv: BucketView, update: torch.Tensor, mats: Sequence[MuonMatrix],
               stats: ExchangeStats) -> dict[int, torch.Tensor]:
    """ZeRO-1/2/3: every rank sends the pieces of each matrix in its shard to the matrix's
    DP owner (one all-to-all); returns the owner's whole TP-local updates ``{slot: (numel,)}``."""
    dp, me = view.grad_size, view.grad_rank
    shard_lo = bv.layout.shard_range(me)[0]
    send, in_splits = [], [0] * dp
    for m in sorted(mats, key=lambda m: m.dp_owner):                   # grouped by destination
        lo, hi = _piece(bv, m.slot, me)
        if hi > lo:
            off = bv.params[m.slot].bucket_offset - shard_lo
            send.append(update[off + lo:off + hi])
            in_splits[m.dp_owner] += hi - lo
    mine = [m for m in mats if m.dp_owner == me]
    out_splits = [sum(_piece(bv, m.slot, r)[1] - _piece(bv, m.slot, r)[0] for m in mine) for r in range(dp)]
    recv = torch.empty(sum(out_splits), dtype=update.dtype, device=update.device)
    inp = torch.cat(send) if send else update.new_empty(0)
    comm.all_to_all_single(recv, inp, out_splits, in_splits, view.grad_group)
    stats.comm_elements += inp.numel()
    full = {m.slot: torch.empty(bv.params[m.slot].numel, dtype=update.dtype, device=update.device) for m in mine}
    pos = 0
    for r in range(dp):                                                # source order, then matrix order
        for m in mine:
            lo, hi = _piece(bv, m.slot, r)
            full[m.slot][lo:hi] = recv[pos:pos + hi - lo]
            pos += hi - lo
    return full


def _from_owners(view: ShardView, bv: BucketView, results: dict[int, torch.Tensor], mats: Sequence[MuonMatrix],
                 like: torch.Tensor, stats: ExchangeStats) -> torch.Tensor:
    """The reverse all-to-all: each owner returns every rank its pieces of the results;
    ``(shard_numel,)``, zero where no Muon matrix lies (padding)."""
    dp, me = view.grad_size, view.grad_rank
    mine = [m for m in mats if m.dp_owner == me]
    send, in_splits = [], [0] * dp
    for r in range(dp):
        for m in mine:
            lo, hi = _piece(bv, m.slot, r)
            if hi > lo:
                send.append(results[m.slot][lo:hi])
                in_splits[r] += hi - lo
    ordered = sorted(mats, key=lambda m: m.dp_owner)
    out_splits = [0] * dp
    for m in ordered:
        lo, hi = _piece(bv, m.slot, me)
        out_splits[m.dp_owner] += hi - lo
    recv = torch.empty(sum(out_splits), dtype=like.dtype, device=like.device)
    inp = torch.cat(send) if send else like.new_empty(0)
    comm.all_to_all_single(recv, inp, out_splits, in_splits, view.grad_group)
    stats.comm_elements += inp.numel()
    out = torch.zeros_like(like)
    shard_lo, pos = bv.layout.shard_range(me)[0], 0
    for m in ordered:
        lo, hi = _piece(bv, m.slot, me)
        if hi > lo:
            off = bv.params[m.slot].bucket_offset - shard_lo
            out[off + lo:off + hi] = recv[pos:pos + hi - lo]
            pos += hi - lo
    return out


def orthogonalize_bucket(view: ShardView, bv: BucketView, update: torch.Tensor, mats: Sequence[MuonMatrix],
                         ns: NsFn, stats: ExchangeStats) -> torch.Tensor:
    """``update`` (shard_numel,) fp32 of bucket ``bv`` -> its orthogonalised update, same
    shape; ``mats``: the bucket's Muon matrices with their owners (every rank passes the
    same list). Collective over the DP group (and the TP group of the owning DP rank)."""
    dp = view.grad_size
    mine = [m for m in mats if m.dp_owner == view.grad_rank]
    if bv.sharded and dp > 1:
        results = _tp_exchange(view, _to_owners(view, bv, update, mats, stats), bv, mine, ns, stats)
        return _from_owners(view, bv, results, mats, update, stats)
    # ZeRO-0 (or one DP rank): the whole bucket is here; the owners' results are summed
    # into everyone's copy (each element written by exactly one owner, exact).
    local = {m.slot: update[bv.params[m.slot].bucket_offset:bv.params[m.slot].bucket_offset + bv.params[m.slot].numel]
             for m in mine}
    results = _tp_exchange(view, local, bv, mine, ns, stats)
    out = torch.zeros_like(update)
    for m in mine:
        s = bv.params[m.slot]
        out[s.bucket_offset:s.bucket_offset + s.numel] = results[m.slot]
    if dp > 1:
        comm.all_reduce(out, view.grad_group)
        stats.comm_elements += out.numel()
    return out
