"""CUDA kernels (csrc/adam/adam_cuda.cu, csrc/fp8/fp8_cuda.cu) and the _scaled_mm FP8 path.

Marked gpu: skipped without CUDA (tests/conftest.py). Expectations:
* FP8 cast on CUDA: bit-identical to the reference run on the GPU and to the CPU kernel
  (same conversion code), amax exact; a NaN's sign is not compared (the contract leaves
  it unspecified: GPUs canonicalise NaN).
* AdamW multi-tensor kernel: bit-identical to the CPU kernel (same element function,
  contraction off on both sides); vs torch.optim.AdamW on CUDA rtol/atol 1e-6.
* fp8_linear with torch._scaled_mm (sm_89+) vs the emulation path: 1e-2 relative (both
  consume the same FP8 operands; only accumulation order/blocking differs).
"""

import numpy as np
import pytest
import torch

from engine.ops.adam import AdamWHyper, adamw_step, fused_adamw_available
from engine.ops.fp8 import fp8_cast_kernel, fp8_cast_reference, fp8_kernel_available
from engine.optim import FusedAdamW
from engine.precision.fp8 import Fp8LinearState, Fp8Recipe, fp8_linear

pytestmark = pytest.mark.gpu

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture(scope="module")
def cuda_ops():
    assert fp8_kernel_available("cuda"), "the CUDA FP8 kernel did not build/load (see the engine.ops warning)"
    assert fused_adamw_available("cuda"), "the CUDA AdamW kernel did not build/load"
    return torch.device("cuda")


def _same(a, b):
    """Same FP8 bytes, except that a NaN's sign is unspecified (engine/ops/fp8.py: GPUs
    canonicalise NaN in arithmetic): NaNs must sit at the same positions."""
    a, b = a.cpu(), b.cpu()
    nan_a, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
    return torch.equal(nan_a, nan_b) and torch.equal(a.view(torch.uint8)[~nan_a], b.view(torch.uint8)[~nan_b])


def _check(x, scale, fmt, transpose):
    got = fp8_cast_kernel(x, scale, fmt, transpose)
    ref = fp8_cast_reference(x, scale, fmt, transpose)
    cpu = fp8_cast_kernel(x.cpu(), scale, fmt, transpose)
    assert _same(got[0], ref[0]) and _same(got[0], cpu[0])
    if torch.isnan(ref[1]):
        assert torch.isnan(got[1])
    else:
        assert got[1].item() == ref[1].item() == cpu[1].item()
    if transpose:
        assert _same(got[2], ref[2]) and _same(got[2], cpu[2])


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_cast_sweep_bit_identical(cuda_ops, fmt):
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    x = torch.from_numpy((hi[:, None] | lows[None, :]).reshape(-1).view(np.float32).copy())
    for transpose in (False, True):
        _check(x.reshape(-1, 768).to(cuda_ops), 1.0, fmt, transpose)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_cast_shapes_alignments_and_specials(cuda_ops, dtype, fmt):
    gen = torch.Generator().manual_seed(0)
    # aligned full tiles, ragged edges, odd sizes (scalar paths), 1-D, 3-D
    for shape in [(256, 512), (130, 70), (3, 5), (1,), (1001,), (4, 33, 64), (64, 4096)]:
        n = int(np.prod(shape))
        x = torch.randn(n + 1, generator=gen) * torch.exp(torch.empty(n + 1).uniform_(-20, 14, generator=gen))
        x[: min(6, n)] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40])[: min(6, n)]
        x = x.to(dtype).to(cuda_ops)
        for offset in (0, 1):  # offset 1: misaligned base pointer -> scalar path
            xs = x[offset:offset + n].reshape(shape)
            for scale in (1.0, 0.37, 1e3):
                for transpose in (False, True):
                    _check(xs, torch.tensor(scale, device=cuda_ops), fmt, transpose)


def test_fp8_cast_large_amax_reduction(cuda_ops):
    x = torch.randn(8192, 8192, device=cuda_ops)
    x[1234, 4321] = 1e4
    out, amax, out_t = fp8_cast_kernel(x, torch.tensor(0.01, device=cuda_ops), torch.float8_e4m3fn, True)
    assert amax.item() == 1e4 and amax.item() == x.abs().max().item()
    assert _same(out_t, out.t().contiguous())


def _adam_lists(device, n_tensors, sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(sizes[i % len(sizes)], generator=gen) for i in range(n_tensors)]
    return ([p.to(device) for p in params], [torch.zeros_like(p, device=device) for p in params],
            [torch.zeros_like(p, device=device) for p in params])


@pytest.mark.parametrize("grad_dtype,copy_dtype", [(torch.float32, None), (torch.bfloat16, torch.bfloat16),
                                                   (torch.float16, torch.float16)])
def test_adamw_multi_tensor_matches_cpu_kernel_bitwise(cuda_ops, grad_dtype, copy_dtype):
    # 50 tensors (> 36 per launch) and one of 22M elements (> 320 chunks per launch), odd sizes
    sizes = [(7,), (65537,), (1000, 33), (3,)]
    p_gpu, m_gpu, v_gpu = _adam_lists(cuda_ops, 50, sizes, 0)
    p_gpu.append(torch.randn(22_000_001, device=cuda_ops))
    m_gpu.append(torch.zeros_like(p_gpu[-1]))
    v_gpu.append(torch.zeros_like(p_gpu[-1]))
    p_cpu, m_cpu, v_cpu = [t.cpu() for t in p_gpu], [t.cpu() for t in m_gpu], [t.cpu() for t in v_gpu]
    c_gpu = [torch.empty_like(p, dtype=copy_dtype) for p in p_gpu] if copy_dtype else None
    c_cpu = [c.cpu() for c in c_gpu] if copy_dtype else None
    gen = torch.Generator(device=cuda_ops).manual_seed(1)
    for step in range(1, 4):
        grads = [torch.randn(p.shape, device=cuda_ops, generator=gen).to(grad_dtype) for p in p_gpu]
        hp = AdamWHyper(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step)
        adamw_step(p_gpu, grads, m_gpu, v_gpu, hp, param_copies=c_gpu, use_kernel=True)
        adamw_step(p_cpu, [g.cpu() for g in grads], m_cpu, v_cpu, hp, param_copies=c_cpu, use_kernel=True)
    for got, want in zip(p_gpu + m_gpu + v_gpu + (c_gpu or []), p_cpu + m_cpu + v_cpu + (c_cpu or [])):
        assert torch.equal(got.cpu(), want)


def test_fused_adamw_on_cuda_matches_torch(cuda_ops):
    gen = torch.Generator().manual_seed(2)
    base = [torch.randn(s, generator=gen) for s in [(7,), (33, 65), (1000, 33)]]
    a = [p.to(cuda_ops).requires_grad_() for p in base]
    b = [p.to(cuda_ops).requires_grad_() for p in base]
    oa, ob = torch.optim.AdamW(a, lr=1e-2, weight_decay=0.1), FusedAdamW(b, lr=1e-2, weight_decay=0.1)
    for _ in range(100):
        for pa, pb in zip(a, b):
            g = torch.randn(pa.shape, device=cuda_ops)
            pa.grad, pb.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pb, pa, rtol=1e-6, atol=1e-6)


def test_fp8_linear_scaled_mm_matches_emulation(cuda_ops):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("torch._scaled_mm needs FP8 tensor cores (sm_89+)")
    gen = torch.Generator(device=cuda_ops).manual_seed(3)
    x = torch.randn(64, 128, device=cuda_ops, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(256, 128, device=cuda_ops, generator=gen) / 8
    gy = torch.randn(64, 256, device=cuda_ops, generator=gen, dtype=torch.bfloat16)
    outs = {}
    for backend in ("scaled_mm", "emulate"):
        state = Fp8LinearState(Fp8Recipe(scaling="current"), cuda_ops)
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_linear(xx, ww, None, state, backend=backend)
        y.backward(gy)
        outs[backend] = (y.float(), xx.grad.float(), ww.grad.float())
    for got, want in zip(outs["scaled_mm"], outs["emulate"]):
        assert ((got - want).norm() / want.norm()).item() < 1e-2
