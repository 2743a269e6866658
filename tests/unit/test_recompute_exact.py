"""Recomputation is bit-identical on one process without the training loop: every selective
part and full units of the reference GPT give the same loss, gradients and (with FP8 delayed
scaling in bf16) the same amax histories and scales after the update as no recomputation
(engine/models/recompute.py explains why: same kernels on the same inputs; a repeated cast
records max(history[0], amax), unchanged)."""

from __future__ import annotations

import pytest
import torch

from engine.models import GPT, ModelConfig
from engine.models.recompute import RecomputeOptions, apply_selective, recompute
from engine.precision.fp8 import Fp8Recipe, fp8_states, update_fp8_scales

CFG = ModelConfig(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=16)


def _run(parts=(), full=False, fp8=False):
    dtype = torch.bfloat16 if fp8 else torch.float32
    m = GPT(CFG, seed=3, dtype=dtype, fp8_recipe=Fp8Recipe() if fp8 else None)
    blocks = [layer for layer in m.layers if getattr(layer, "takes_attention_inputs", False)]
    for b in blocks:
        apply_selective(b, parts)
    if full:
        for b in blocks:
            inner = b.forward
            b.forward = lambda x, attn_mask=None, position_ids=None, inner=inner: recompute(
                lambda y: inner(y, attn_mask, position_ids), x, options=RecomputeOptions())
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    out = []
    for _ in range(2):  # two steps: the second uses the scales the first's amaxes gave
        loss = m(ids, ids)
        loss.backward()
        if fp8:
            update_fp8_scales(fp8_states(m))
        out.append(loss.detach())
    grads = [p.grad.clone() for p in m.parameters()]
    scales = [getattr(s, r).scale.clone() for s in fp8_states(m) for r in ("input", "weight", "grad_output")]
    return out, grads, scales


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8-bf16"])
def test_every_part_and_full_units_are_exact(fp8):
    ref = _run(fp8=fp8)
    for kw in [dict(parts=("norm",)), dict(parts=("core_attn",)), dict(parts=("mlp_act",)), dict(parts=("attn",)),
               dict(parts=("mlp",)), dict(parts=("norm", "core_attn", "mlp_act")), dict(full=True)]:
        got = _run(fp8=fp8, **kw)
        for a, b in zip(got, ref):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), kw
