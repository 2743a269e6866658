"""One block of context-parallel attention: local queries against one block of keys, with
the log-sum-exp that lets partial results merge exactly.

Every mode (ring, Ulysses, hybrid) ends in these functions. The maths is explicit (matmul,
masked softmax) in a compute dtype of fp32 (fp64 for fp64 inputs), also for bf16 inputs,
so that merging partial outputs by their log-sum-exp is exact to rounding:

    forward   S = Q K^T / sqrt(d), masked -inf;  lse = logsumexp_j S;  O_b = softmax(S) V
    merge     lse = logaddexp(lse_a, lse_b);     O = e^(lse_a - lse) O_a + e^(lse_b - lse) O_b
    backward  P = e^(S - lse_final);  dV = P^T dO;  dP = dO V^T;  dS = P o (dP - D),
              D = rowsum(dO o O_final);  dQ = dS K / sqrt(d);  dK = dS^T Q / sqrt(d)

Shapes (GQA without materialising repeated KV heads): q (B, nkv, g, Sq, d) with g = nh / nkv
query heads per KV head, k/v (B, nkv, 1, Sk, d), lse (B, nkv, g, Sq). Masks come from the
tokens' GLOBAL positions and document ids (key j visible to query i iff pos_j <= pos_i and
doc_j == doc_i), so any assignment of tokens to ranks masks correctly.

Skipping: a block is cut into pieces (a rank's head and tail chunks); a (q piece, k piece)
pair whose position ranges or document ranges rule out every pair is not computed.
"""

from __future__ import annotations

from typing import Optional

import torch

from engine.distributed.strict import host_sync_allowed

__all__ = ["compute_dtype", "visible", "block_forward", "block_backward", "merge", "piece_ranges",
           "visible_pieces", "column_runs"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64 (the 1e-12 checks); every other dtype computes and merges in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def visible(qmeta: torch.Tensor, kmeta: torch.Tensor, has_doc: bool) -> torch.Tensor:
    """The mask (B, 1, 1, Sq, Sk): ``qmeta`` (B, 2, Sq), ``kmeta`` (B, 2, Sk) hold global
    positions in row 0 and document ids in row 1."""
    m = kmeta[:, 0, None, :] <= qmeta[:, 0, :, None]                       # (B, Sq, Sk)
    if has_doc:
        m = m & (kmeta[:, 1, None, :] == qmeta[:, 1, :, None])
    return m[:, None, None]


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale                        # (B, nkv, g, Sq, Sk)
    return s.masked_fill(~mask, float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with fully masked rows (-inf) set to 0, so exp(S - lse) is exp(-inf) = 0 there."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(O_b (B, nkv, g, Sq, d), lse_b (B, nkv, g, Sq)) of one block, in q's (compute) dtype;
    rows with no visible key give O_b = 0 and lse_b = -inf (they merge as nothing)."""
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse)[..., None])
    return torch.matmul(p, v), lse


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
                   delta: torch.Tensor, mask: torch.Tensor, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq (B, nkv, g, Sq, d), dk (B, nkv, Sk, d), dv (B, nkv, Sk, d)) of one block, recomputed
    from the FINAL lse (B, nkv, g, Sq) and ``delta`` = rowsum(dO o O) (B, nkv, g, Sq)."""
    p = torch.exp(_scores(q, k, mask, scale) - _finite(lse)[..., None])     # (B, nkv, g, Sq, Sk)
    dv = torch.matmul(p.transpose(-1, -2), do).sum(dim=2)
    dp = torch.matmul(do, v.transpose(-1, -2))
    ds = p * (dp - delta[..., None])
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(dim=2) * scale
    return dq, dk, dv


def merge(o_acc: torch.Tensor, lse_acc: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial softmax results over disjoint key sets (see the module docstring);
    -inf on both sides (no key yet) stays -inf with output 0."""
    lse = torch.logaddexp(lse_acc, lse_b)
    safe = _finite(lse)
    wa = torch.where(torch.isinf(lse_acc), torch.zeros_like(lse), torch.exp(lse_acc - safe))
    wb = torch.where(torch.isinf(lse_b), torch.zeros_like(lse), torch.exp(lse_b - safe))
    return o_acc * wa[..., None] + o_b * wb[..., None], lse


# ----------------------------------------------------------------------------- skipping
Ranges = tuple[list[int], list[int], list[int], list[int]]  # per batch row: min pos, max pos, min doc, max doc


def piece_ranges(meta: torch.Tensor, pieces: int, has_doc: bool) -> Optional[list[Ranges]]:
    """Per piece (equal slices of the sequence dim of ``meta`` (B, 2, S)), the host values
    (min pos, max pos, min doc, max doc) over the batch rows, as a conservative summary
    (a pair is skipped only if it is hidden for every row). ``None`` off the CPU: reading
    them would stall the device queue, so non-CPU devices compute every block (masked)."""
    if meta.device.type != "cpu":
        return None
    b, _, s = meta.shape
    parts = meta.reshape(b, 2, pieces, s // pieces)
    lo, hi = parts.amin(dim=-1), parts.amax(dim=-1)                          # (B, 2, pieces)
    with host_sync_allowed():  # CPU tensors: no device sync
        lo_l, hi_l = lo.tolist(), hi.tolist()
    out: list[Ranges] = []
    for i in range(pieces):
        pos_lo = [lo_l[r][0][i] for r in range(b)]
        pos_hi = [hi_l[r][0][i] for r in range(b)]
        doc_lo = [lo_l[r][1][i] if has_doc else 0 for r in range(b)]
        doc_hi = [hi_l[r][1][i] if has_doc else 0 for r in range(b)]
        out.append((pos_lo, pos_hi, doc_lo, doc_hi))
    return out


def _hidden(qr: Ranges, kr: Ranges) -> bool:
    """True iff for every batch row, no key of piece ``kr`` is visible to any query of ``qr``:
    every key comes after every query, or the document ranges do not overlap."""
    for b in range(len(qr[0])):
        later = kr[0][b] > qr[1][b]
        disjoint = kr[3][b] < qr[2][b] or kr[2][b] > qr[3][b]
        if not (later or disjoint):
            return False
    return True


def visible_pieces(q_ranges: Optional[list[Ranges]], k_ranges: Optional[list[Ranges]], nq: int, nk: int) -> list[list[int]]:
    """For each q piece, the k pieces that are not fully hidden (all of them without ranges)."""
    if q_ranges is None or k_ranges is None:
        return [list(range(nk)) for _ in range(nq)]
    return [[j for j in range(nk) if not _hidden(q_ranges[i], k_ranges[j])] for i in range(nq)]


def column_runs(pieces: list[int], piece_len: int) -> list[tuple[int, int]]:
    """The key columns of ``pieces`` as maximal [start, end) runs (adjacent pieces joined)."""
    runs: list[tuple[int, int]] = []
    for j in pieces:
        start, end = j * piece_len, (j + 1) * piece_len
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end)
        else:
            runs.append((start, end))
    return runs
