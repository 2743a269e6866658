"""FP8 paths that matter on a GPU, checked on CPU.

* the stacked scale update equals the per-meta loop it replaced, bit for bit (mixed
  recipes, formats, margins, algorithms, non-finite amaxes), with a fixed kernel count;
* the forward saves only what the backward reads (the _scaled_mm path runs on CPU too);
* falling back to the emulation on an FP8-capable GPU is logged, once per shape.
"""

import logging

import torch

from engine.ops.fp8 import fp8_max
from engine.precision import fp8 as F


def _loop_reference(states):
    """The original per-meta update (no group)."""
    for s in states:
        for m in s.metas():
            r = s.recipe
            if r.scaling == "delayed":
                amax = m.amax_history.max() if r.amax_compute_algo == "max" else m.amax_history[0]
                m.scale = F.compute_scale(amax, m.scale, fp8_max(m.dtype), r.margin)
            m.amax_history = torch.roll(m.amax_history, 1)
            m.amax_history[0] = 0.0


def _states(seed):
    g = torch.Generator().manual_seed(seed)
    recipes = [F.Fp8Recipe(), F.Fp8Recipe(fp8_format="e4m3", margin=2), F.Fp8Recipe(amax_compute_algo="most_recent"),
               F.Fp8Recipe(scaling="current"), F.Fp8Recipe(amax_history_len=4)]
    states = []
    for r in recipes * 2:
        s = F.Fp8LinearState(r)
        for m in s.metas():
            m.amax_history.copy_(torch.rand(m.history_len, generator=g) * 10)
            m.scale = torch.rand((), generator=g) + 0.5
        states.append(s)
    states[0].input.amax_history[0] = float("nan")
    states[1].weight.amax_history[:] = 0.0
    states[2].grad_output.amax_history[0] = float("inf")
    return states


def test_stacked_scale_update_equals_the_per_meta_loop():
    a, b = _states(0), _states(0)
    for _ in range(3):
        F.update_fp8_scales(a)
        _loop_reference(b)
        for sa, sb in zip(a, b):
            for ma, mb in zip(sa.metas(), sb.metas()):
                torch.testing.assert_close(ma.scale, mb.scale, rtol=0, atol=0, equal_nan=True)
                torch.testing.assert_close(ma.amax_history, mb.amax_history, rtol=0, atol=0, equal_nan=True)
        for s in a + b:  # next step's casts
            for m in s.metas():
                m.record_amax(torch.tensor(3.0))


def test_forward_saves_only_what_backward_reads():
    state = F.Fp8LinearState(F.Fp8Recipe())
    for backend, want in (("scaled_mm", "transposed"), ("emulate", "row-major")):
        x = torch.randn(32, 16, requires_grad=True)
        w = torch.randn(16, 16, requires_grad=True)
        y = F.fp8_linear(x, w, None, state, backend=backend)
        saved = y.grad_fn.saved_tensors
        fp8_saved = [t for t in saved if t.dtype == torch.float8_e4m3fn]
        assert len(fp8_saved) == 2, (backend, [t.shape for t in saved])  # x and w once each, not twice
        assert fp8_saved[0].shape == ((16, 32) if want == "transposed" else (32, 16))
        y.sum().backward()
        assert x.grad is not None and w.grad is not None


def test_emulation_fallback_on_an_fp8_gpu_is_logged_once_per_shape(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    dev = torch.device("cuda", 0)
    with caplog.at_level(logging.WARNING, logger="engine.precision.fp8"):
        assert F.fp8_backend(dev, 30, 64, 64) == "emulate"
        assert F.fp8_backend(dev, 30, 64, 64) == "emulate"
        assert F.fp8_backend(dev, 32, 64, 64) == "scaled_mm"
    warnings = [r for r in caplog.records if "falls back to the fp32 emulation" in r.getMessage()]
    assert len(warnings) == 1 and "(30, 64, 64)" in warnings[0].getMessage()


def test_current_scaling_reduces_both_forward_amaxes_in_one_collective(monkeypatch):
    """``current`` scaling used to issue one blocking TP all-reduce per quantize (input and
    weight: two per forward). Now one per forward and one per backward; values unchanged
    (MAX of each element is independent of the stacking)."""
    calls = []
    monkeypatch.setattr(F, "all_reduce", lambda t, group, op=None: calls.append(t.numel()))
    state = F.Fp8LinearState(F.Fp8Recipe(scaling="current"))
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(4, 16, requires_grad=True)
    y = F.fp8_linear(x, w, None, state, tp_group=object(), backend="emulate")
    assert calls == [2]
    y.sum().backward()
    assert calls == [2, 1]
    ref = F.fp8_linear(x.detach(), w.detach(), None, F.Fp8LinearState(F.Fp8Recipe(scaling="current")),
                       backend="emulate")
    assert torch.equal(y.detach(), ref)
