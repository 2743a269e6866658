"""Document masking on CUDA: the compiled flex-attention path (engine.models.attention) against
the explicit (B, 1, S, S) mask, forward and backward (CPU cannot run flex's backward).

Marked gpu: skipped without CUDA (tests/conftest.py). fp32 inputs, tolerance 1e-4 absolute on
outputs and gradients of O(1): the two kernels tile the sums differently; masked keys are
exact zeros in both.
"""

import pytest
import torch

from engine.data import document_causal_mask
from engine.models.attention import DocumentBlockMask, attend, document_attention_mask

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("nkv", [2, 8])
def test_compiled_flex_equals_the_explicit_mask(nkv):
    b, nh, s, d = 2, 8, 384, 64
    lens = [[100, 200, 84], [384]]
    doc_ids = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in lens]).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=g, requires_grad=True) for h in (nh, nkv, nkv))
    gy = torch.randn(b, nh, s, d, device="cuda", generator=g)
    flex_mask = document_attention_mask(doc_ids)                     # by device: flex on CUDA
    assert isinstance(flex_mask, DocumentBlockMask)
    out = attend(q, k, v, flex_mask)
    grads = torch.autograd.grad(out, (q, k, v), gy)
    ref = attend(q, k, v, document_causal_mask(doc_ids))
    ref_grads = torch.autograd.grad(ref, (q, k, v), gy)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, atol=1e-4, rtol=0)
