"""The attention call of a context-parallel block (the one function the model calls).

A thin dispatcher over the three modes, which are one pipeline:

    Ulysses (U > 1): all-to-all q, k, v from sequence shards to head shards (:mod:`.ulysses`)
    ring    (R = C / U > 1): rotate the (gathered) KV blocks around the ring (:mod:`.ring`)
    Ulysses (U > 1): all-to-all the output back to this rank's sequence shard

ring mode is U = 1, ulysses mode is R = 1, hybrid both. Masks compare global positions
(and document ids), so every mode is exact for any assignment of tokens to ranks.
"""

from __future__ import annotations

from typing import Optional

import torch

from engine.context_parallel import ulysses
from engine.context_parallel.layout import CPLayout
from engine.context_parallel.ring import ring_attention
from engine.distributed.groups import AxisGroup

__all__ = ["context_parallel_attention", "attention_with_lse"]

# How many equal pieces of a rank's S/C tokens the skip plan judges separately (the first
# that divides S/C): 8 = 4 per head-tail chunk, and one per chunk of the document-balanced
# order (balanced_document_indices' default chunks_per_rank); finer pieces skip more of
# the causal diagonal and of documents, coarser ones make larger matmuls.
PIECES = (8, 4, 2, 1)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: CPLayout, *,
                               positions: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                               stats: Optional[dict] = None) -> torch.Tensor:
    """Causal (and, with ``doc_ids``, document-causal) softmax attention, scale 1/sqrt(d),
    of this rank's queries against the keys of the whole sequence.

    q (B, nh, S/C, d), k/v (B, nkv, S/C, d): this rank's head-tail shard (rotary already
    applied with the true positions). ``positions`` (B, S/C) long: the global position of
    each local token in the sequence (masking compares them: key j is visible to query i
    iff pos_j <= pos_i and, with ``doc_ids`` (B, S/C), doc_j == doc_i). Returns
    (B, nh, S/C, d) in q's order and dtype. Autograd flows to q, k and v. ``stats``: a
    dict that counts the score entries computed (``pairs_computed``, for benchmarks)."""
    return _attention(q, k, v, layout, positions, doc_ids, stats, with_lse=False)[0]


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: CPLayout, *,
                       positions: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                       stats: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`context_parallel_attention` and its log-sum-exp (B, nh, S/C) per local query
    (fp32; fp64 for fp64 inputs; not differentiable). ``stats`` as in :func:`ring_attention`
    (for tests and benchmarks)."""
    o, lse = _attention(q, k, v, layout, positions, doc_ids, stats, with_lse=True)
    assert lse is not None
    return o, lse


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: CPLayout, positions: torch.Tensor,
               doc_ids: Optional[torch.Tensor], stats: Optional[dict], with_lse: bool
               ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The pipeline of the module docstring; the lse (one more all-to-all under Ulysses) only
    ``with_lse``."""
    _check(q, k, v, layout, positions, doc_ids)
    has_doc = doc_ids is not None
    meta = torch.stack([positions, doc_ids if doc_ids is not None else torch.zeros_like(positions)], dim=1)
    u = layout.ulysses_size
    pieces = next(p for p in PIECES if q.shape[2] % p == 0)
    if u > 1:
        group = layout.ulysses
        assert group is not None
        q = ulysses.seq_to_heads(q, group)
        k = ulysses.seq_to_heads(ulysses.expand_kv_heads(k, u), group)
        v = ulysses.seq_to_heads(ulysses.expand_kv_heads(v, u), group)
        meta = ulysses.gather_meta(meta, group)
        pieces *= u
    ring = layout.ring if layout.ring is not None else AxisGroup.single("cp_ring")  # Ulysses alone: no ring
    o, lse = ring_attention(q, k, v, meta, has_doc, ring, pieces, stats)
    if u > 1:
        assert layout.ulysses is not None
        o = ulysses.heads_to_seq(o, layout.ulysses)
        if with_lse:
            lse = ulysses.heads_to_seq(lse.unsqueeze(-1), layout.ulysses).squeeze(-1)
    return o, lse if with_lse else None


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: CPLayout, positions: torch.Tensor,
           doc_ids: Optional[torch.Tensor]) -> None:
    """Shapes and the layout's groups against the mode; raised identically on every rank
    (same shapes and config everywhere) before any communication."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[::2] != k.shape[::2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"context_parallel_attention: q (B, nh, S/C, d) {tuple(q.shape)} and k, v (B, nkv, S/C, d) "
                         f"{tuple(k.shape)}, {tuple(v.shape)} must agree in B, S/C and d")
    nh, nkv = q.shape[1], k.shape[1]
    if nh % nkv:
        raise ValueError(f"context_parallel_attention: {nh} query heads are not a multiple of {nkv} KV heads")
    if positions.shape != (q.shape[0], q.shape[2]) or (doc_ids is not None and doc_ids.shape != positions.shape):
        raise ValueError(f"context_parallel_attention: positions {tuple(positions.shape)} and doc_ids "
                         f"{None if doc_ids is None else tuple(doc_ids.shape)} must be (B, S/C) = "
                         f"{(q.shape[0], q.shape[2])}")
    u, c = layout.ulysses_size, layout.size
    ring_size = 1 if layout.ring is None else layout.ring.size
    uly_size = 1 if layout.ulysses is None else layout.ulysses.size
    if uly_size != u or ring_size * u != c or (layout.mode == "ring" and u != 1) or \
            (layout.mode == "ulysses" and u != c):
        raise ValueError(f"context_parallel: layout {layout.mode} of size {c} with ulysses_size {u} has a ring group "
                         f"of {ring_size} and a Ulysses group of {uly_size} ranks; expected ring {c // u} x "
                         f"Ulysses {u} (ring mode: ulysses_size 1; ulysses mode: ulysses_size = size)")
    if nh % u:
        raise ValueError(f"context_parallel.ulysses_size {u} does not divide the {nh} query heads: Ulysses gives "
                         f"each rank whole heads. Use mode \"ring\", or \"hybrid\" with a ulysses_size that "
                         f"divides {nh}")
