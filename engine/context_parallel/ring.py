"""Ring attention: KV blocks travel around the ring group while each rank computes its
queries against the block it holds.

Step t (0 <= t < R) on ring rank r works on the KV block of ring rank (r - t) mod R. The
next block (K and V packed in one tensor, positions and document ids in another) is posted
with one batched isend/irecv BEFORE the current block is computed and waited for after, so
the transfer runs behind the computation. Partial outputs merge by their log-sum-exp in
fp32 (fp64 for fp64 inputs; :mod:`.blocks`).

Backward (flash-attention style, nothing but O and lse saved per row): the KV blocks rotate
again in the same order; dK/dV of each block is an fp32 accumulator that travels with it:
rank r adds its contribution to the block's accumulator and sends it on to r + 1; after R
steps every accumulator has visited every rank and the last hop brings it to its owner.
Per rank, forward sends (R-1) KV blocks, backward (R-1) KV blocks and R dK/dV blocks.

Ranks are numbered along the ring group (its ``rank``); ``group.global_rank_of`` gives the
peer's global rank for torch.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from engine.context_parallel import blocks
from engine.distributed import comm
from engine.distributed.groups import AxisGroup

__all__ = ["ring_attention"]


def _ring_size(group: AxisGroup) -> int:
    return group.size


def _exchange(group: AxisGroup, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> list[Any]:
    """Send ``sends`` to the next ring rank and receive ``recvs`` from the previous one, all in
    one batch (every rank posts the same pattern, so the pairs match)."""
    nxt = group.global_rank_of((group.rank + 1) % group.size)
    prv = group.global_rank_of((group.rank - 1) % group.size)
    ops = [comm.p2p_op(dist.isend, t, nxt, group) for t in sends]
    ops += [comm.p2p_op(dist.irecv, t, prv, group) for t in recvs]
    return comm.batch_isend_irecv(ops)


def _rotation(group: AxisGroup, kv: torch.Tensor, meta: torch.Tensor
              ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield (t, kv block, its meta) for t = 0..R-1; the transfer of block t+1 is in flight
    while the caller computes on block t. Two buffers per tensor: ``kv`` (given away by the
    caller: it is written over from t = 1 on; ``meta`` is copied) and one more, because the
    block just computed on has been sent when its step ends and can receive the block after
    next (the caller must be done with a yielded block when it asks for the next)."""
    r = _ring_size(group)
    cur, spare = (kv, meta.clone()), None
    for t in range(r):
        works: list[Any] = []
        if t < r - 1:
            if spare is None:
                spare = (torch.empty_like(kv), torch.empty_like(meta))
            works = _exchange(group, list(cur), list(spare))
        yield t, cur[0], cur[1]
        for w in works:
            w.wait()
        if t < r - 1:
            assert spare is not None
            cur, spare = spare, cur


def _row_groups(vis: list[list[int]]) -> list[tuple[int, int, list[int]]]:
    """Consecutive q pieces that see the same k pieces, joined: (first, end, k pieces)."""
    out: list[tuple[int, int, list[int]]] = []
    for i, ks in enumerate(vis):
        if out and out[-1][2] == ks and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1, ks)
        else:
            out.append((i, i + 1, ks))
    return [g for g in out if g[2]]


def _tiles(groups: list[tuple[int, int, list[int]]], plen: int, per_row: int, budget: int
           ) -> list[tuple[slice, list[int]]]:
    """``groups`` (q pieces [a, b) seeing k pieces ks) cut into row tiles (slices of the
    S_l query rows) whose score matrix (rows x key columns x ``per_row`` = B x local query
    heads entries) holds at most ``budget`` entries (at least one row per tile)."""
    out: list[tuple[slice, list[int]]] = []
    for a, b, ks in groups:
        step = max(1, budget // (len(ks) * plen * per_row))                 # rows per tile
        out.extend((slice(i, min(i + step, b * plen)), ks) for i in range(a * plen, b * plen, step))
    return out


class _Plan:
    """Which (rows, key-column runs) of one block to compute, from the position/doc ranges,
    in row tiles whose score matrix (B, nkv, g, rows, cols) has at most as many entries as
    q (B, nh, S_l, d) (``budget``): rows x cols <= S_l d, so a tile has at least d rows
    (cols <= S_l on the ring, U S_l under Ulysses with nh / U heads). The transients of a
    tile (the scores, their softmax, and in backward dP, dP - D and dS) are then each at
    most the size of q, however many rows could share one matmul, as with flash
    attention's fixed tiles. (With whole-chunk tiles, S_l/2 x S_l per head, a ring rank's
    activation peak at CP 4 was 0.42 of CP 1's: test_cp_train's activation-peak test.)"""

    def __init__(self, qmeta: torch.Tensor, kmeta: torch.Tensor, pieces: int, has_doc: bool,
                 q_ranges: Optional[list], per_row: int, budget: int) -> None:
        s = qmeta.shape[-1]
        self.plen = s // pieces
        k_ranges = blocks.piece_ranges(kmeta, pieces, has_doc)
        vis = blocks.visible_pieces(q_ranges, k_ranges, pieces, pieces)
        self.groups = [(rows, blocks.column_runs(ks, self.plen))
                       for rows, ks in _tiles(_row_groups(vis), self.plen, per_row, budget)]

    @staticmethod
    def take(t: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
        """``t`` restricted to the column ``runs`` along its sequence dim (-1 for meta
        (B, 2, S), -2 for packed K/V (2, B, nkv, S, d))."""
        dim = -1 if t.dim() == 3 else -2
        parts = [t.narrow(dim, a, b - a) for a, b in runs]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _count(stats: Optional[dict], q: torch.Tensor, rows: slice, runs: list[tuple[int, int]]) -> None:
    """stats["pairs_computed"] += B x local query heads x rows x key columns of one block."""
    if stats is not None:
        cols = sum(b - a for a, b in runs)
        work = q.shape[0] * q.shape[1] * (rows.stop - rows.start) * cols
        stats["pairs_computed"] = stats.get("pairs_computed", 0) + work


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it where it is a view into a larger storage: the model's v is a
    slice of its fused q/k/v projection (B, S_l, (nh + 2 nkv) d), which saving the view
    would keep alive until backward (3 times v's bytes with nh = nkv)."""
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.contiguous() if not t.is_contiguous() else t.clone()
    return t


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, meta, has_doc, group, pieces, stats):
        cd = blocks.compute_dtype(q.dtype)
        b, nh, s, d = q.shape
        nkv = k.shape[1]
        scale = d ** -0.5
        q5 = q.to(cd).reshape(b, nkv, nh // nkv, s, d)
        o = q5.new_zeros(q5.shape)
        lse = q5.new_full(q5.shape[:-1], float("-inf"))
        q_ranges = blocks.piece_ranges(meta, pieces, has_doc)
        for _, kv_t, meta_t in _rotation(group, torch.stack([k, v]).contiguous(), meta):
            plan = _Plan(meta, meta_t, pieces, has_doc, q_ranges, b * nh, q.numel())
            for rows, runs in plan.groups:
                kk = _Plan.take(kv_t, runs).to(cd).unsqueeze(3)             # (2, B, nkv, 1, Sk, d)
                mask = blocks.visible(meta[..., rows], _Plan.take(meta_t, runs), has_doc)
                ob, lb = blocks.block_forward(q5[..., rows, :], kk[0], kk[1], mask, scale)
                o[..., rows, :], lse[..., rows] = blocks.merge(o[..., rows, :], lse[..., rows], ob, lb)
                _count(stats, q, rows, runs)
        ctx.save_for_backward(_own(q), _own(k), _own(v), meta, o, lse)
        ctx.has_doc, ctx.group, ctx.pieces = has_doc, group, pieces
        ctx.mark_non_differentiable(lse)
        return o.reshape(b, nh, s, d).to(q.dtype), lse.reshape(b, nh, s)

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, meta, o5, lse = ctx.saved_tensors
        group, pieces, has_doc = ctx.group, ctx.pieces, ctx.has_doc
        cd = o5.dtype
        b, nh, s, d = q.shape
        nkv = k.shape[1]
        scale = d ** -0.5
        q5 = q.to(cd).reshape(o5.shape)
        do5 = do.to(cd).reshape(o5.shape)
        delta = (do5 * o5).sum(dim=-1)                                          # (B, nkv, g, S)
        dq = torch.zeros_like(q5)
        q_ranges = blocks.piece_ranges(meta, pieces, has_doc)
        r = _ring_size(group)
        # dK/dV accumulators (2, B, nkv, S_l, d) in three buffers: ``contrib`` (this step's
        # block), ``acc`` (the accumulator being sent on) and ``recv`` (the one arriving);
        # a sent buffer receives the next step's arrival.
        contrib = torch.zeros((2, b, nkv, s, d), dtype=cd, device=q.device)
        acc = recv = None
        pending: list[Any] = []
        for t, kv_t, meta_t in _rotation(group, torch.stack([k, v]).contiguous(), meta):
            if t > 0:
                contrib.zero_()
            plan = _Plan(meta, meta_t, pieces, has_doc, q_ranges, b * nh, q.numel())
            for rows, runs in plan.groups:
                kk = _Plan.take(kv_t, runs).to(cd).unsqueeze(3)
                mask = blocks.visible(meta[..., rows], _Plan.take(meta_t, runs), has_doc)
                dq_b, dk_b, dv_b = blocks.block_backward(q5[..., rows, :], kk[0], kk[1], do5[..., rows, :],
                                                         lse[..., rows], delta[..., rows], mask, scale)
                dq[..., rows, :] += dq_b
                off = 0
                for a, e in runs:                                              # scatter back to the block's columns
                    contrib[0, ..., a:e, :] += dk_b[..., off:off + e - a, :]
                    contrib[1, ..., a:e, :] += dv_b[..., off:off + e - a, :]
                    off += e - a
                del kk, mask, dq_b, dk_b, dv_b
            for w in pending:
                w.wait()
            if r == 1:
                recv = contrib
                break
            if recv is None:                                                   # t = 0: my own block's first part
                acc, contrib, recv = contrib, torch.empty_like(contrib), torch.empty_like(contrib)
            else:                                                              # the sent buffer receives next
                acc, recv = recv.add_(contrib), acc
            pending = _exchange(group, [acc], [recv])
        for w in pending:
            w.wait()
        final = recv
        assert final is not None
        return (dq.reshape(b, nh, s, d).to(q.dtype), final[0].to(k.dtype), final[1].to(v.dtype),
                None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: torch.Tensor, has_doc: bool,
                   group: AxisGroup, pieces: int, stats: Optional[dict] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o (B, nh, S_l, d) in q's dtype, lse (B, nh, S_l) in the compute dtype) of the local
    queries q (B, nh, S_l, d) against the keys of every member of ``group`` (size 1: the local
    keys only). k, v (B, nkv, S_l, d); ``meta`` (B, 2, S_l) long: global positions
    and document ids of the local tokens; ``pieces``: how many equal pieces of S_l the skip
    plan looks at (2 for a head-tail shard). ``stats``: if given, ``pairs_computed`` counts
    the (batch row, query head, q, k) score entries the forward computed (skipping shows
    as fewer than B nh S_l S)."""
    out: tuple[torch.Tensor, torch.Tensor] = _Ring.apply(q, k, v, meta, has_doc, group, pieces, stats)
    return out
