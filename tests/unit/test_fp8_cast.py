"""The fused FP8 cast (csrc/fp8/) is bit-identical to its reference (engine/ops/fp8.py).

Reference: clamp(x.float() * scale, -MAX, MAX).to(fp8) with torch's own RNE conversion;
amax = x.float().abs().max(). NaN/inf policy under test: NaN -> NaN (0x7F | sign),
+-inf -> +-MAX, amax NaN if any NaN else inf if any inf. Outputs are compared as bytes.
"""

import zlib

import numpy as np
import pytest
import torch

from engine.ops.builder import get_builder
from engine.ops.fp8 import fp8_cast, fp8_cast_kernel, fp8_cast_reference, fp8_kernel_available, fp8_max

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
INPUTS = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def kernel():
    builder = get_builder("fp8")
    problem = builder.jit_problem()
    if problem is not None and builder.aot_library_path() is None:
        pytest.skip(f"fp8 op cannot be built here: {problem}")
    # A toolchain is present, so a failed build is a failure, not a skip.
    assert fp8_kernel_available("cpu"), "fp8 op failed to build/load; see the engine.ops warning"
    default_isa = torch.ops.engine_fp8.cpu_isa()
    yield default_isa
    torch.ops.engine_fp8.set_cpu_isa(default_isa)


def _bytes(t):
    return t.view(torch.uint8)


def assert_same(got, ref, transpose):
    assert got[0].dtype == ref[0].dtype and got[0].shape == ref[0].shape
    assert torch.equal(_bytes(got[0]), _bytes(ref[0])), "FP8 bytes differ from the reference"
    amax, ref_amax = got[1], ref[1].float()
    assert amax.dtype == torch.float32 and amax.shape == ()
    if torch.isnan(ref_amax):
        assert torch.isnan(amax)
    else:
        assert torch.equal(amax, ref_amax), f"amax {amax.item()} != {ref_amax.item()}"
    if transpose:
        assert got[2].shape == ref[2].shape
        assert torch.equal(_bytes(got[2]), _bytes(ref[2])), "transposed FP8 bytes differ"


def sweep_fp32():
    """Every bf16 bit pattern widened, and each with the low 16 bits set to the values
    that straddle rounding ties (tie-1ulp, tie, tie+1ulp for every FP8 spacing, since FP8
    keeps <= 3 mantissa bits the ties lie in the upper 16 bits). Includes +-0, subnormals,
    +-inf and NaNs with payloads: 393,216 values."""
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    return torch.from_numpy((hi[:, None] | lows[None, :]).reshape(-1).view(np.float32).copy())


@pytest.mark.parametrize("fmt", FORMATS)
def test_exhaustive_sweep_every_isa_variant(kernel, fmt):
    x = sweep_fp32().reshape(-1, 768)  # (512, 768)
    ref = fp8_cast_reference(x, 1.0, fmt, transpose=True)
    for isa in ("avx512", "avx2", "baseline"):
        torch.ops.engine_fp8.set_cpu_isa(isa)  # falls back to the best the CPU supports
        assert_same(fp8_cast_kernel(x, 1.0, fmt, transpose=True), ref, True)
    torch.ops.engine_fp8.set_cpu_isa(kernel)


def random_input(shape, dtype, gen):
    """Magnitudes from 1e-12 to 1e7 (FP8 subnormals, normals, beyond MAX) plus specials."""
    n = int(np.prod(shape)) if shape else 1
    mag = torch.exp(torch.empty(n).uniform_(-28.0, 16.0, generator=gen))
    x = torch.randn(n, generator=gen).sign() * mag
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"),
                             1e-40, -3e-42, 448.0, 464.0, 57344.0, 61440.0, 2.0 ** -9, 2.0 ** -10, 2.0 ** -17])
    if n >= 64:
        idx = torch.randperm(n, generator=gen)[: len(specials)]
        x[idx] = specials
    return x.reshape(shape).to(dtype)


SHAPES = [(0,), (), (1,), (37,), (3, 5), (129, 300), (2, 33, 65), (64, 1024)]


@pytest.mark.parametrize("dtype", INPUTS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("transpose", [False, True])
def test_random_data_bit_identical(kernel, dtype, fmt, transpose):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{fmt}{transpose}".encode()))
    for shape in SHAPES:
        x = random_input(shape, dtype, gen)
        for scale in (1.0, 0.37, 2.0 ** -5, 1e4):
            ref = fp8_cast_reference(x, scale, fmt, transpose)
            assert_same(fp8_cast_kernel(x, scale, fmt, transpose), ref, transpose)
            assert_same(fp8_cast(x, scale, fmt, transpose), ref, transpose)


def test_nan_inf_policy(kernel):
    x = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 0.0, -0.0])
    e4 = _bytes(fp8_cast_kernel(x, 1.0, torch.float8_e4m3fn)[0]).tolist()
    # NaN -> 0x7F with its sign; inf and overflow saturate to +-448 (0x7E / 0xFE); -0 kept
    assert e4 == [0x7F, 0xFF, 0x7E, 0xFE, 0x7E, 0xFE, 0x00, 0x80]
    e5 = _bytes(fp8_cast_kernel(x, 1.0, torch.float8_e5m2)[0]).tolist()
    assert e5 == [0x7F, 0xFF, 0x7B, 0xFB, 0x7B, 0xFB, 0x00, 0x80]  # +-57344 = 0x7B / 0xFB
    out = fp8_cast_kernel(x, 1.0, torch.float8_e5m2)[0].float()
    assert out[2].item() == fp8_max(torch.float8_e5m2) and not torch.isinf(out).any()
    # amax: NaN wins, then inf
    assert torch.isnan(fp8_cast_kernel(x, 1.0, torch.float8_e4m3fn)[1])
    assert fp8_cast_kernel(x[2:], 1.0, torch.float8_e4m3fn)[1].item() == float("inf")
    assert fp8_cast_kernel(x[4:], 1.0, torch.float8_e4m3fn)[1].item() == np.float32(1e30)


def test_amax_exact_and_of_unscaled_input(kernel):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1000, 129, generator=gen) * 7
    for scale in (1.0, 1e-3):
        _, amax = fp8_cast_kernel(x, scale, torch.float8_e4m3fn)
        assert torch.equal(amax, x.abs().max())
    assert fp8_cast_kernel(torch.zeros(0), 1.0, torch.float8_e4m3fn)[1].item() == 0.0


def test_scale_tensor_equals_float_and_transpose_layout(kernel):
    x = torch.randn(40, 24)
    a = fp8_cast_kernel(x, torch.tensor([0.5]), torch.float8_e4m3fn, transpose=True)
    b = fp8_cast_kernel(x, 0.5, torch.float8_e4m3fn, transpose=True)
    assert torch.equal(_bytes(a[0]), _bytes(b[0]))
    assert a[2].shape == (24, 40) and a[2].is_contiguous()
    assert torch.equal(_bytes(a[2]), _bytes(a[0]).t().contiguous())


def test_bad_inputs_have_clear_errors(kernel):
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        fp8_cast(torch.ones(3, dtype=torch.int32), 1.0, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="one value"):
        fp8_cast(torch.ones(3), torch.ones(2), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="not a supported FP8 format"):
        fp8_cast(torch.ones(3), 1.0, torch.float16)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        torch.ops.engine_fp8.cast(torch.ones(4, 4).t(), torch.ones(()), 0, False)


def test_non_contiguous_input_is_handled(kernel):
    x = torch.randn(30, 20).t()
    assert_same(fp8_cast_kernel(x, 2.0, torch.float8_e4m3fn, True),
                fp8_cast_reference(x, 2.0, torch.float8_e4m3fn, True), True)
