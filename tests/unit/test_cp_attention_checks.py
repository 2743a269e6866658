"""Context-parallel attention in one process (CP 1) and its refusals.

- CP 1 (a ring of one: the block skipping and LSE merge of the two head-tail pieces) equals
  one-process SDPA with the causal-document mask: fp64 within 1e-12 for the output and
  dq, dk, dv, with GQA (4 query heads on 1 KV head). The multi-rank modes are in
  tests/distributed/test_cp_attention.py.
- Query heads that U does not divide, and groups that do not match the mode, are errors
  that name the key and the fix (raised before any communication).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.context_parallel import CPLayout
from engine.context_parallel.attention import context_parallel_attention
from engine.distributed.groups import AxisGroup


def test_cp1_equals_sdpa_fp64():
    g = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 4, 24, 8
    q = torch.randn(b, h, s, d, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, 1, s, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    doc = torch.randint(0, 4, (b, s), generator=g).sort(dim=1).values
    pos = torch.arange(s).expand(b, s)
    layout = CPLayout("ring", 1, 0, 1, AxisGroup.single("cp"), None)
    o = context_parallel_attention(q, k, v, layout, positions=pos, doc_ids=doc)
    mask = (pos[:, None, :, None] >= pos[:, None, None, :]) & (doc[:, None, :, None] == doc[:, None, None, :])
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    do = torch.randn_like(o)
    for a, r in zip((o, *torch.autograd.grad(o, (q, k, v), do)), (ref, *torch.autograd.grad(ref, (q, k, v), do))):
        assert (a - r).abs().max().item() <= 1e-12


def _group(n: int) -> AxisGroup:
    return AxisGroup("cp", tuple(range(n)), 0, handle=object())  # type: ignore[arg-type]  # never used: refused first


def test_heads_not_divisible_by_ulysses_size_is_refused():
    layout = CPLayout("ulysses", 4, 0, 4, None, _group(4))
    q, k = torch.zeros(1, 6, 8, 4), torch.zeros(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"ulysses_size 4 does not divide the 6 query heads.*\"ring\".*\"hybrid\""):
        context_parallel_attention(q, k, k, layout, positions=torch.zeros(1, 8, dtype=torch.long))


def test_groups_not_matching_the_mode_are_refused():
    layout = CPLayout("ring", 4, 0, 1, _group(2), None)
    q = torch.zeros(1, 4, 8, 4)
    with pytest.raises(ValueError, match="expected ring 4 x Ulysses 1"):
        context_parallel_attention(q, q, q, layout, positions=torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="positions"):
        context_parallel_attention(q, q, q, CPLayout("ring", 1, 0, 1, AxisGroup.single("cp"), None),
                                   positions=torch.zeros(1, 7, dtype=torch.long))
