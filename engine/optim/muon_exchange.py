"""Distributed Newton–Schulz: each matrix orthogonalised once, whole, on its owner rank.

Input: the Nesterov update of one ZeRO bucket on this rank, ``(shard_numel,)`` fp32 (the
fully reduced, fully accumulated gradient blended with the momentum, element-wise on the
shard). Output: the orthogonalised update of the same elements. Per bucket, in the same
order on every rank of the stage:

1. DP: all-gather the bucket's update shards -> ``(padded_numel,)`` on every DP rank
   (skipped for ZeRO-0, where every rank holds the whole bucket).
2. TP (only on the DP rank that owns some TP-sharded matrices of the bucket, with all TP
   ranks of that DP rank): all-gather the TP slices of those matrices; each matrix's TP
   owner rebuilds the full matrix (``unshard_tensors``), runs Newton–Schulz once per part,
   and the slices go back by one reduce-scatter (every other rank contributes zeros, so the
   sum is exact). A TP-replicated matrix is computed by its TP owner and summed the same way.
3. DP: every owner writes its results into a zero ``(padded_numel,)`` buffer and one
   reduce-scatter (all-reduce for ZeRO-0) returns each rank its shard, exact for the same
   reason.

Communication per step: twice the Muon parameters' size in fp32 over DP (as one
all-reduce), plus, on TP, twice the TP-sharded matrices owned by each DP rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from engine.dist import comm
from engine.optim.muon_plan import MuonMatrix
from engine.tensor_parallel.layers import shard_tensor, unshard_tensors
from engine.zero.shard_view import BucketView, ShardView

__all__ = ["ExchangeStats", "orthogonalize_bucket", "orthogonalize_full"]

NsFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class ExchangeStats:
    """Counters of this rank: Newton–Schulz calls, wall and CPU seconds (the CPU time is what
    the rank computed, also when ranks share cores), elements sent by collectives."""

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


def _tp_exchange(view: ShardView, full: torch.Tensor, bv: BucketView, mats: Sequence[MuonMatrix], ns: NsFn,
                 stats: ExchangeStats) -> dict[int, torch.Tensor]:
    """Results ``{slot: (numel,) fp32}`` for this DP rank's ``mats`` of one bucket."""
    out: dict[int, torch.Tensor] = {}
    world, rank = view.tp_size, view.tp_rank

    def local(m: MuonMatrix) -> torch.Tensor:
        s = bv.params[m.slot]
        return full[s.bucket_offset:s.bucket_offset + s.numel]

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
        buf = torch.zeros(n, dtype=full.dtype, device=full.device)
        for m, o in zip(replicated, offs):
            if m.tp_owner == rank:
                buf[o:o + bv.params[m.slot].numel] = orthogonalize_full(
                    local(m).view(m.local_shape), m, ns, stats).reshape(-1)
        comm.all_reduce(buf, view.tp_group)
        stats.comm_elements += n
        for m, o in zip(replicated, offs):
            out[m.slot] = buf[o:o + bv.params[m.slot].numel]
    return out


def orthogonalize_bucket(view: ShardView, bv: BucketView, update: torch.Tensor, mats: Sequence[MuonMatrix],
                         ns: NsFn, stats: ExchangeStats) -> torch.Tensor:
    """``update`` (shard_numel,) fp32 of bucket ``bv`` -> its orthogonalised update, same
    shape; ``mats``: the bucket's Muon matrices with their owners (every rank passes the
    same list). Collective over the DP group (and the TP group of the owning DP rank)."""
    dp = view.dp_size
    gather = bv.sharded and dp > 1
    if gather:
        full = torch.empty(bv.layout.padded_numel, dtype=update.dtype, device=update.device)
        comm.all_gather(full, update, view.dp_group)                        # (padded,)
        stats.comm_elements += full.numel()
    else:
        full = update                                                       # the whole bucket is here
    mine = [m for m in mats if m.dp_owner == view.dp_rank]
    results = _tp_exchange(view, full, bv, mine, ns, stats)
    if dp == 1:
        out = torch.zeros_like(update)
    else:
        out = torch.zeros(bv.layout.padded_numel, dtype=update.dtype, device=update.device)
    for m in mine:
        s = bv.params[m.slot]
        out[s.bucket_offset:s.bucket_offset + s.numel] = results[m.slot]
    if dp == 1:
        return out
    stats.comm_elements += out.numel()
    if bv.sharded:
        shard = torch.empty_like(update)
        comm.reduce_scatter(shard, out, view.dp_group)
        return shard
    comm.all_reduce(out, view.dp_group)
    return out
