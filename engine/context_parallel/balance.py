"""Attention work per CP rank, counted exactly, and a document-aware balanced assignment.

Work is the number of unmasked (query, key) pairs: under the causal document mask, query t
sees the keys of its own document at positions <= its own, so its work is its 1-based
offset within its document (its position + 1 without documents). A rank's work is the sum
over the queries it holds: in every mode each rank computes its own queries' rows (ring,
hybrid) or an equal share of the heads of its group's rows (Ulysses, whose work per rank is
the group's mean, so only the split across groups matters).

Head-tail sharding (rank i: chunks i and 2C-1-i of 2C) balances the causal mask exactly,
but not packed documents: the work of a document grows with the square of its length, and
where the long documents fall decides. :func:`balanced_assignment` keeps S/C tokens per
rank and moves whole fine chunks (S/(C m) tokens, m chunks per rank) between ranks until
the work is balanced.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["token_work", "rank_work", "imbalance", "balanced_assignment"]


def token_work(seq_len: int, doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(S,) long: the keys visible to each query of a sequence of ``seq_len`` tokens in
    position order, under the causal mask and, with ``doc_ids`` (S,), the document mask
    (documents need not be contiguous: a query sees earlier tokens with its id)."""
    pos = torch.arange(seq_len)
    if doc_ids is None:
        return pos + 1
    if doc_ids.shape != (seq_len,):
        raise ValueError(f"token_work: doc_ids {tuple(doc_ids.shape)} must be ({seq_len},)")
    order = torch.argsort(doc_ids, stable=True)                              # by document, then position
    sd = doc_ids[order]
    first = torch.ones(seq_len, dtype=torch.bool)
    first[1:] = sd[1:] != sd[:-1]
    start = torch.where(first, pos, torch.zeros_like(pos)).cummax(0).values
    work = torch.empty_like(pos)
    work[order] = pos - start + 1
    return work


def rank_work(work: torch.Tensor, assignment: Sequence[torch.Tensor]) -> list[int]:
    """Each rank's work: the sum of ``work`` (S,) over the token indices it holds."""
    return [int(work[idx].sum()) for idx in assignment]


def imbalance(per_rank: Sequence[int]) -> float:
    """max / mean of the per-rank work (1.0 is perfect balance)."""
    return max(per_rank) * len(per_rank) / sum(per_rank)


def _head_tail_chunks(cp: int, m: int) -> list[list[int]]:
    """Head-tail at fine-chunk granularity: rank i holds the fine chunks of coarse chunks i
    and 2C-1-i (m/2 fine chunks in each)."""
    h = m // 2
    return [list(range(i * h, (i + 1) * h)) + list(range((2 * cp - 1 - i) * h, (2 * cp - i) * h))
            for i in range(cp)]


def _greedy_chunks(w: list[int], cp: int, m: int) -> list[list[int]]:
    """Largest chunk first onto the least-loaded rank with room (m chunks per rank)."""
    ranks: list[list[int]] = [[] for _ in range(cp)]
    load = [0] * cp
    for j in sorted(range(len(w)), key=lambda j: (-w[j], j)):
        r = min((r for r in range(cp) if len(ranks[r]) < m), key=lambda r: (load[r], r))
        ranks[r].append(j)
        load[r] += w[j]
    return ranks


def _refine(ranks: list[list[int]], w: list[int]) -> list[list[int]]:
    """Swap one chunk of the most loaded rank with one of the least loaded while that lowers
    the pair's maximum (finitely many strict improvements of the sorted loads)."""
    for _ in range(64 * len(w)):
        load = [sum(w[j] for j in r) for r in ranks]
        a, b = load.index(max(load)), load.index(min(load))
        gap = load[a] - load[b]
        best = None
        for x in ranks[a]:
            for y in ranks[b]:
                delta = w[x] - w[y]
                if 0 < delta < gap and (best is None or abs(gap - 2 * delta) < abs(gap - 2 * best[2])):
                    best = (x, y, delta)
        if best is None:
            break
        x, y, _ = best
        ranks[a][ranks[a].index(x)], ranks[b][ranks[b].index(y)] = y, x
    return ranks


def balanced_assignment(doc_ids: Optional[torch.Tensor], seq_len: int, cp: int,
                        chunks_per_rank: int = 8) -> list[torch.Tensor]:
    """For each CP rank, the sorted token indices (S/C,) it holds: fine chunks of
    S / (C m) tokens (m = ``chunks_per_rank``, even), m per rank, chosen so that the
    per-rank work (:func:`token_work`) is balanced. Starts from the better of head-tail and
    largest-first, then swaps chunks; never worse than head-tail (whose result it keeps
    for the causal mask, where head-tail is exact). Deterministic: every rank computes the
    same assignment from the same ``doc_ids`` (S,)."""
    m = chunks_per_rank
    if m < 2 or m % 2 or seq_len % (cp * m):
        raise ValueError(f"balanced_assignment: sequence length {seq_len} must be divisible by "
                         f"context_parallel.size x chunks_per_rank = {cp} x {m} (chunks_per_rank even)")
    n = seq_len // (cp * m)
    work = token_work(seq_len, doc_ids).reshape(cp * m, n).sum(dim=1).tolist()
    best = None
    for start in (_head_tail_chunks(cp, m), _greedy_chunks(work, cp, m)):
        ranks = _refine([list(r) for r in start], work)
        score = max(sum(work[j] for j in r) for r in ranks)
        if best is None or score < best[0]:
            best = (score, ranks)
    assert best is not None
    return [torch.cat([torch.arange(j * n, (j + 1) * n) for j in sorted(r)]) for r in best[1]]
