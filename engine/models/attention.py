"""The attention kernel call of :class:`engine.models.blocks.Attention`, and document masking
without a materialised ``(B, 1, S, S)`` mask.

Three cases, q (B, nh, S, d), k/v (B, nkv, S, d), ``nh % nkv == 0``:

- no mask: SDPA ``is_causal=True`` (FlashAttention on CUDA, the fused CPU kernel on CPU);
- an explicit boolean mask (B, 1, S, S) (a user's ``attn_mask``, or document masking on
  CPU): SDPA with ``attn_mask``;
- document masking on CUDA: :class:`DocumentBlockMask`, a flex-attention ``BlockMask``
  built from the document ids (B, S) by a compiled ``create_block_mask``: per 128x128 tile
  "empty / full / partial" plus the ``mask_mod`` evaluated inside the compiled
  ``flex_attention`` kernel, so neither the (B, 1, S, S) mask nor the (B, nh, S, S) scores
  exist, and tiles across documents or above the diagonal are skipped (less work than
  causal FlashAttention on a packed row).

Context parallelism (``context_parallel.size`` > 1): the mask is a
:class:`ContextParallelMask` (the rank's :class:`engine.context_parallel.CPLayout`, the GLOBAL
positions of its head-tail shard and, with document masking, the shard's document ids), and
:func:`attend` hands the local q/k/v shards to
:func:`engine.context_parallel.attention.context_parallel_attention`.

Which one document masking uses is chosen by device (:func:`doc_mask_kernel`): ``flex`` on
CUDA, ``sdpa`` (the explicit mask) elsewhere. On CPU flex is no option for training:
torch's flex attention has no backward on CPU (it raises), and its eager forward is the
unfused reference that materialises the full (B, nh, S, S) fp32 scores (more memory than
the bool mask, which CPU SDPA's fused kernel takes directly). Varlen attention
(``torch.nn.attention.varlen``) was not taken: it needs ``cu_seqlens`` with one entry per
document, whose length is only known on the host (a device sync per micro-batch).

Grouped-query attention never copies K/V to nh heads where the kernel takes the kv heads:
``enable_gqa`` for SDPA without a mask (CUDA flash, CPU) and with a mask on CPU (the fused
CPU kernel takes both), flex's own ``enable_gqa``. One exception: an explicit mask on CUDA
repeats K/V, because the only CUDA SDPA kernel that takes a mask (memory-efficient) does not
take GQA, and torch would fall back to the math kernel, which materialises the scores
(worse than the K/V copy). Document masking on CUDA does not go there (flex).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Union, cast

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from engine.context_parallel.attention import context_parallel_attention
from engine.context_parallel.layout import CPLayout
from engine.data.packing import document_causal_mask

__all__ = ["DocumentBlockMask", "ContextParallelMask", "AttnMask", "DocMaskKernel", "doc_mask_kernel", "document_attention_mask",
           "attend"]

DocMaskKernel = Literal["flex", "sdpa"]


@dataclass(frozen=True)
class DocumentBlockMask:
    """Document-causal masking for flex attention: query i attends key j iff ``j <= i`` and
    ``doc_ids[b, i] == doc_ids[b, j]``. ``block_mask`` covers (B, 1 head, S, S) in 128x128
    tiles; ``doc_ids`` (B, S) is what its mask_mod reads."""

    block_mask: BlockMask
    doc_ids: torch.Tensor  # (B, S)


@dataclass(frozen=True)
class ContextParallelMask:
    """Causal (document-causal with ``doc_ids``) attention of this rank's head-tail shard of
    the sequence against the whole sequence, across ``layout``'s groups. ``positions``
    (B, S/C) int64: the global position of each local token (what the causal mask
    compares); ``doc_ids`` (B, S/C): the local tokens' document ids, or None."""

    layout: CPLayout
    positions: torch.Tensor
    doc_ids: Optional[torch.Tensor] = None


AttnMask = Union[torch.Tensor, DocumentBlockMask, ContextParallelMask]  # bool (B, 1, S, S), flex, or CP


def doc_mask_kernel(device: torch.device) -> DocMaskKernel:
    """How document masking runs on ``device``: ``flex`` on CUDA, the explicit mask elsewhere
    (module docstring: flex has no CPU backward)."""
    return "flex" if device.type == "cuda" else "sdpa"


@functools.cache
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    # One compiled wrapper per function per process; a new (B, S) recompiles once.
    return torch.compile(fn, dynamic=False)


def document_attention_mask(doc_ids: torch.Tensor, kernel: Optional[DocMaskKernel] = None) -> AttnMask:
    """The document-causal mask of ``doc_ids`` (B, S) in the form ``kernel`` runs (None: by
    the device of ``doc_ids``, :func:`doc_mask_kernel`): the bool (B, 1, S, S) tensor for
    ``sdpa``, a :class:`DocumentBlockMask` for ``flex`` (compiled on CUDA, so the (B, S, S)
    comparison is never materialised; eager elsewhere, for tests)."""
    kernel = doc_mask_kernel(doc_ids.device) if kernel is None else kernel
    if kernel == "sdpa":
        return document_causal_mask(doc_ids)
    if kernel != "flex":
        raise ValueError(f"document-mask kernel must be 'flex' or 'sdpa', got {kernel!r}")

    def doc_causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (doc_ids[b, q] == doc_ids[b, kv]) & (kv <= q)

    b, s = doc_ids.shape
    make = _compiled(create_block_mask) if doc_ids.device.type == "cuda" else create_block_mask
    return DocumentBlockMask(make(doc_causal, b, None, s, s, device=doc_ids.device), doc_ids)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[AttnMask] = None) -> torch.Tensor:
    """Softmax attention, scale 1/sqrt(d): q (B, nh, S, d), k/v (B, nkv, S, d) -> (B, nh, S, d).
    ``mask`` None means causal."""
    if isinstance(mask, ContextParallelMask):  # q/k/v are the rank's (B, heads, S/C, d) shards
        return context_parallel_attention(q, k, v, mask.layout, positions=mask.positions, doc_ids=mask.doc_ids)
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if isinstance(mask, DocumentBlockMask):
        run = cast(Callable[..., Any], _compiled(flex_attention) if q.device.type == "cuda" else flex_attention)
        out: torch.Tensor = run(q, k, v, block_mask=mask.block_mask, enable_gqa=gqa)  # (B, nh, S, d)
        return out
    if gqa and q.device.type == "cuda":
        # CUDA's masked kernel (memory-efficient) takes no GQA (module docstring): repeat
        # each kv head nh/nkv times, as enable_gqa would.
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, nh, S, d)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        gqa = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)  # mask (B, 1, S, S)
