"""Attention kernels (engine.models.attention): document masking through a flex-attention block
mask (what CUDA runs; here its eager forward), GQA without K/V copies, the choice by device.

Tolerances (fp32, logits of O(1)): flex vs the explicit (B, 1, S, S) mask and vs each
document run alone: atol 2e-5, as tests/unit/test_doc_masking_model.py (masked keys give
exp(-inf) = 0 exactly in both; only the order of fp32 sums differs, measured <= 2e-7).
enable_gqa vs repeating K/V: the CPU fused kernel computes the same sums in the same
order (measured: bitwise equal); checked to 1e-6.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from engine.data import document_causal_mask
from engine.models import GPT, ModelConfig
from engine.models.attention import DocumentBlockMask, attend, doc_mask_kernel, document_attention_mask
from engine.models.blocks import attention_inputs, forward_layers

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

ATOL = 2e-5
CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=24)


def _packed(lengths: list[list[int]], seed: int = 0):
    """ids (B, S), doc_ids (B, S), the documents of each row."""
    g = torch.Generator().manual_seed(seed)
    rows, id_rows, docs = [], [], []
    for lens in lengths:
        row_docs = [torch.randint(0, CFG.vocab_size, (n,), generator=g) for n in lens]
        rows.append(torch.cat(row_docs))
        id_rows.append(torch.cat([torch.full((n,), i) for i, n in enumerate(lens)]))
        docs.append(row_docs)
    return torch.stack(rows), torch.stack(id_rows), docs


def test_the_kernel_is_chosen_by_device():
    assert doc_mask_kernel(torch.device("cuda")) == "flex"
    assert doc_mask_kernel(torch.device("cpu")) == "sdpa"
    _, doc_ids, _ = _packed([[5, 19]])
    mask, _ = attention_inputs(CFG.seq_len, doc_ids)                  # CPU: the explicit mask
    assert torch.equal(mask, document_causal_mask(doc_ids))
    assert isinstance(attention_inputs(CFG.seq_len, doc_ids, doc_kernel="flex")[0], DocumentBlockMask)
    with pytest.raises(ValueError, match="'flex' or 'sdpa'"):
        document_attention_mask(doc_ids, "varlen")  # type: ignore[arg-type]


def test_why_cpu_does_not_train_with_flex():
    """torch's flex attention has no backward on CPU: document masking on CPU must be the
    explicit mask (if torch adds one, revisit doc_mask_kernel)."""
    _, doc_ids, _ = _packed([[5, 19]])
    mask = document_attention_mask(doc_ids, "flex")
    q = torch.randn(1, 4, CFG.seq_len, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        attend(q, q.detach()[:, :2], q.detach()[:, :2], mask)


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_flex_document_mask_equals_explicit_mask_and_documents_alone(kv_heads):
    cfg = ModelConfig(**{**CFG.to_dict(), "num_kv_heads": kv_heads})
    model = GPT(cfg, seed=5)
    ids, doc_ids, docs = _packed([[5, 11, 8], [24], [1, 9, 14]])
    with torch.no_grad():
        flex = forward_layers(model.layers, ids, *attention_inputs(cfg.seq_len, doc_ids, doc_kernel="flex"))
        explicit = forward_layers(model.layers, ids, *attention_inputs(cfg.seq_len, doc_ids, doc_kernel="sdpa"))
        torch.testing.assert_close(flex, explicit, atol=ATOL, rtol=0)
        for r, row_docs in enumerate(docs):
            start = 0
            for d in row_docs:
                torch.testing.assert_close(flex[r, start:start + len(d)], model(d[None])[0], atol=ATOL, rtol=0)
                start += len(d)
        assert (flex[0, 5:] - model(ids)[0, 5:]).abs().max() > 1e-2  # the mask matters


def test_the_block_mask_skips_tiles_across_documents_and_above_the_diagonal():
    """Two documents of 128 tokens in a row of 256 (128x128 tiles): query tile 1 reads only key
    tile 1 (tile 0 is the other document), and that tile is partial (the diagonal); query
    tile 0 likewise. Causal attention alone would read 3 tiles, this reads 2."""
    doc_ids = torch.cat([torch.zeros(128), torch.ones(128)]).long()[None]   # (1, 256)
    bm = document_attention_mask(doc_ids, "flex").block_mask
    partial = bm.kv_num_blocks[0, 0].tolist()
    full = (bm.full_kv_num_blocks[0, 0].tolist() if bm.full_kv_num_blocks is not None else [0, 0])
    assert [p + f for p, f in zip(partial, full)] == [1, 1]
    assert bm.kv_indices[0, 0, 1, 0].item() == 1


class _KvCopies(TorchDispatchMode):
    """Records each op other than the attention kernel that reads K or V (or a view of them:
    same storage) and allocates a tensor of at least B * nh * S * d elements: a K/V copy to
    the query's heads (views, such as expand, allocate nothing). Also the K/V head count the
    kernel sees."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, nh: int) -> None:
        super().__init__()
        self.kv_storages = {k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()}
        self.copy_numel = k.numel() // k.shape[1] * nh  # B * nh * S * d
        self.copies: list[str] = []
        self.kernel_kv_heads: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = [a for a in args if isinstance(a, torch.Tensor)]
        if "scaled_dot_product" in str(func):  # the attention kernel: (B, nh, S, d) out is the result
            if "backward" not in str(func):
                self.kernel_kv_heads.append(flat[1].shape[1])
            return out
        reads_kv = any(a.untyped_storage().data_ptr() in self.kv_storages for a in flat)
        outs = out if isinstance(out, (tuple, list)) else [out]
        for o in outs:
            if isinstance(o, torch.Tensor) and reads_kv:
                if not func.is_view and o.numel() >= self.copy_numel:  # a new (B, nh, S, d)-sized buffer
                    self.copies.append(str(func))
        return out


def _copying(q, k, v, mask):
    """The old masked path: repeat each kv head nh/nkv times, then plain SDPA."""
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("masked", [False, True])
def test_gqa_makes_no_kv_copy_and_equals_the_copying_version(masked):
    b, nh, nkv, s, d = 2, 8, 2, 24, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=g, requires_grad=True) for h in (nh, nkv, nkv))
    _, doc_ids, _ = _packed([[5, 11, 8], [24]])
    mask = document_causal_mask(doc_ids) if masked else None
    gy = torch.randn(b, nh, s, d, generator=g)

    def run(fn):
        mode = _KvCopies(k, v, nh)
        with mode:
            out = fn(q, k, v, mask)
            grads = torch.autograd.grad(out, (q, k, v), gy)
        return out, grads, mode

    out, grads, mode = run(attend)
    ref, ref_grads, ref_mode = run(_copying)
    assert mode.copies == [] and mode.kernel_kv_heads == [nkv]
    assert ref_mode.copies, "the detector must see the copying version's K/V copy"
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, atol=1e-6, rtol=0)
