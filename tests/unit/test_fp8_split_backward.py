"""Zero-bubble split backward (engine.pipeline.split_backward) over FP8 linears: the input half
and the weight half each compute only their part, so a micro-batch costs the same FP8 GEMMs
and the same output-gradient quantizations as one ordinary backward, with identical results.

Before, the FP8 autograd function computed dX and dW in both halves (and quantized the output
gradient twice: a second amax record, and under ``current`` scaling a second TP all-reduce).

Exact equality is expected: both schedules run the same kernels on the same operands (the
weight half reuses the FP8 output gradient the input half made).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import engine.precision.fp8 as fp8
from engine.models import GPT, ModelConfig
from engine.pipeline.split_backward import backward_input, backward_phase, backward_weight, full_backward

CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=16,
                  ffn_hidden_size=64)
GEMMS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten._scaled_mm.")


class _CountGemms(TorchDispatchMode):
    """Matrix products dispatched (on CPU every one in these blocks' backward is an FP8 GEMM:
    the q/k/v, proj, gate/up, down layers; attention's backward is one fused kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += str(func).startswith(GEMMS)
        return func(*args, **(kwargs or {}))


def _stage(recipe):
    """Two FP8 blocks (a middle pipeline stage), their input x (B, S, H) and d(loss)/d(out)."""
    model = GPT(CFG, seed=3, fp8_recipe=recipe)
    blocks = list(model.layers)[1:-1]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, CFG.seq_len, CFG.hidden_size, generator=g, requires_grad=True)
    gy = torch.randn(2, CFG.seq_len, CFG.hidden_size, generator=g)
    y = x
    for b in blocks:
        y = b(y)
    params = [p for b in blocks for p in b.parameters()]
    return blocks, params, x, y, gy


def _count_casts(monkeypatch):
    calls = []
    real = fp8.fp8_cast

    def counted(*a, **k):
        calls.append(a[2])  # the FP8 dtype
        return real(*a, **k)
    monkeypatch.setattr(fp8, "fp8_cast", counted)
    return calls


@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_split_backward_runs_each_fp8_gemm_once(scaling, monkeypatch):
    recipe = fp8.Fp8Recipe(scaling=scaling)
    casts = _count_casts(monkeypatch)
    n_fp8_layers = 4 * CFG.num_layers                       # qkv, proj, gate_up, down per block

    blocks, params, x, y, gy = _stage(recipe)
    casts.clear()
    with _CountGemms() as full:
        full_backward(y, gy)
    full_casts = len(casts)
    ref_dx, ref_grads = x.grad.clone(), [p.grad.clone() for p in params]
    ref_hist = [fp8.fp8_states(b)[i].grad_output.amax_history.clone() for b in blocks for i in range(4)]

    blocks, params, x, y, gy = _stage(recipe)
    casts.clear()
    with _CountGemms() as first:
        dx, state = backward_input(y, gy, x, params)
    assert all(p.grad is None for p in params)              # the input half leaves dW alone
    with _CountGemms() as second:
        backward_weight(state)
    assert backward_phase() is None

    assert full.n == 2 * n_fp8_layers                       # dX and dW of each FP8 layer
    assert first.n == n_fp8_layers and second.n == n_fp8_layers
    assert len(casts) == full_casts == n_fp8_layers         # the output gradient quantized once per layer
    assert torch.equal(dx, ref_dx)
    for p, r in zip(params, ref_grads):
        assert torch.equal(p.grad, r)
    hist = [fp8.fp8_states(b)[i].grad_output.amax_history for b in blocks for i in range(4)]
    assert all(torch.equal(h, r) for h, r in zip(hist, ref_hist))
