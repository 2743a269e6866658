"""Token dispatch over the expert-parallel group: all-to-all of uneven splits.

EP rank r of ``ep`` holds global experts ``[r * E/ep, (r+1) * E/ep)``. One micro-batch on one
rank, with ``A`` (token, expert) assignments kept (T * top_k, fewer when a capacity drops some):

1. sort the assignments by global expert (stable: token order within an expert); ``counts``
   (E,) per expert; ``send`` (ep,) rows per destination rank = sums of ``counts`` by rank;
2. exchange the counts first (an all-to-all of ``counts``: rank s learns ``recv_counts``
   (ep, E/ep), what each source sends to each of its experts), read them on the host (the
   one host read a dispatch needs: torch's all-to-all takes its splits as Python ints);
3. all-to-all the token rows (uneven splits; the backward is the reverse all-to-all);
4. regroup the received rows (source-major) by local expert, run the grouped GEMM, undo the
   regrouping, all-to-all back: every row returns to the position it left from.

With ``ep == 1`` steps 2-3 are skipped. A rank whose experts receive no rows takes part in
every collective with empty buffers (no hang) and its experts' matmuls run on zero rows
(zero gradients, no NaN).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from engine.distributed import comm
from engine.distributed.groups import AxisGroup
from engine.distributed.strict import host_sync_allowed

__all__ = ["all_to_all_rows", "dispatch_compute_combine"]


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split by ``send`` to each member, received by ``recv``; the backward sends
    the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: AxisGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), recv, send, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))
        comm.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, ctx.group)
        return out, None, None, None


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group: AxisGroup) -> torch.Tensor:
    """Differentiable all-to-all of the rows of ``x`` (N, ...): ``send[r]`` rows to member r,
    ``recv[r]`` rows from it (identity on a group of one)."""
    if group.size == 1:
        return x
    return _AllToAll.apply(x, send, recv, group)


def _host_ints(t: torch.Tensor) -> list[int]:
    """Split sizes on the host: the dispatch's one documented host read (module docstring)."""
    with host_sync_allowed():
        return [int(v) for v in t.tolist()]


def dispatch_compute_combine(rows: torch.Tensor, counts: torch.Tensor, group: AxisGroup,
                             compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``rows`` (A, H) sorted by global expert with ``counts`` (E,) per expert -> (A, H), each row
    replaced by its expert's output. ``compute(x, local_counts)``: the local experts on rows
    ``x`` sorted by local expert with ``local_counts`` (E/ep,) each."""
    ep = group.size
    if ep == 1:
        return compute(rows, counts)
    e_local = counts.shape[0] // ep
    recv_counts = torch.empty_like(counts)                               # (ep * E/ep,) source-major
    comm.all_to_all_single(recv_counts, counts.contiguous(), [e_local] * ep, [e_local] * ep, group)
    send = _host_ints(counts.view(ep, e_local).sum(1))
    recv_matrix = recv_counts.view(ep, e_local)                          # [source, local expert]
    recv = _host_ints(recv_matrix.sum(1))
    got = all_to_all_rows(rows, send, recv, group)                       # (sum recv, H), source-major
    # regroup source-major blocks by local expert (stable: source order within an expert)
    local_id = torch.arange(e_local, device=rows.device).repeat(ep)
    expert_of_row = torch.repeat_interleave(local_id, recv_matrix.reshape(-1))
    order = torch.argsort(expert_of_row, stable=True)
    out_sorted = compute(got[order], recv_matrix.sum(0))
    out = torch.empty_like(out_sorted).index_copy(0, order, out_sorted)  # back to source-major
    return all_to_all_rows(out, recv, send, group)
