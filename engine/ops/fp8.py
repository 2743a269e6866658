"""FP8 cast with a per-tensor scale: the fused kernel's frontend and its PyTorch reference.

Contract (the kernel is bit-identical to this reference; tests/unit/test_fp8_cast.py):

    out  = clamp(x.float() * scale, -MAX, MAX).to(dtype)      MAX = 448 (e4m3fn), 57344 (e5m2)
    amax = x.float().abs().max()                                of the INPUT, before scaling
    out_t = out.reshape(rows, cols).t().contiguous()   when transpose=True (cols = x.shape[-1])

* The product is computed in fp32 (bf16/fp16 inputs are widened first, exactly), then
  rounded to the FP8 format with round-to-nearest-even.
* NaN/inf policy: NaN stays NaN (torch's encoding 0x7F/0xFF); its SIGN is unspecified:
  GPUs canonicalise NaN in arithmetic (the product x * scale is a positive NaN on CUDA
  whatever x's sign), so the contract - and tests/gpu - compare NaN by position, every other
  byte exactly. +-inf saturates to +-MAX, as does every finite value beyond MAX; -0.0
  stays -0.0.
  amax is NaN if the input holds a NaN, inf if it holds an inf (torch.max semantics), so a
  scaling recipe can detect overflow and skip the update.
* An empty input gives amax = 0.

The fused kernel reads the input once and writes out (and out_t) in the same pass; the
unfused torch sequence reads/writes it four times (abs+max, mul, clamp, cast).
"""

from __future__ import annotations

import logging
import math
from typing import Union

import torch

from engine.ops.builder import load_op

__all__ = [
    "FP8_DTYPES",
    "fp8_max",
    "fp8_cast",
    "fp8_cast_reference",
    "fp8_cast_kernel",
    "fp8_kernel_available",
]

logger = logging.getLogger(__name__)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_FORMAT_CODE = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

Scale = Union[float, torch.Tensor]


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 format (448 for e4m3fn, 57344 for e5m2)."""
    if dtype not in _FP8_MAX:
        raise ValueError(f"{dtype} is not a supported FP8 format; use torch.float8_e4m3fn or torch.float8_e5m2")
    return _FP8_MAX[dtype]


def _check(x: torch.Tensor, scale: Scale, dtype: torch.dtype) -> torch.Tensor:
    fp8_max(dtype)
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"fp8_cast: x must be float32, bfloat16 or float16, got {x.dtype}; convert it with x.float()")
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"fp8_cast: scale must hold one value (per-tensor scaling), got shape {tuple(scale.shape)}")
        if scale.device != x.device:
            raise ValueError(f"fp8_cast: scale is on {scale.device} but x is on {x.device}; move the scale to x's device")
        return scale.reshape(()).to(torch.float32)
    return torch.tensor(float(scale), dtype=torch.float32, device=x.device)


def _rows_cols(x: torch.Tensor) -> tuple[int, int]:
    """x viewed as (rows, cols) with cols = the last dim (a 0-dim x is (1, 1))."""
    if x.dim() == 0:
        return 1, 1
    return math.prod(x.shape[:-1]), x.shape[-1]


def fp8_cast_reference(x: torch.Tensor, scale: Scale, dtype: torch.dtype, transpose: bool = False):
    """The unfused torch sequence that defines the result; returns (out, amax[, out_t])."""
    s = _check(x, scale, dtype)
    m = fp8_max(dtype)
    xf = x.float()
    out = torch.clamp(xf * s, -m, m).to(dtype)  # clamp keeps NaN; inf -> +-MAX
    amax = xf.abs().max() if x.numel() else torch.zeros((), dtype=torch.float32, device=x.device)
    if not transpose:
        return out, amax
    out_t = out.reshape(_rows_cols(x)).t().contiguous()  # (cols, rows)
    return out, amax, out_t


def fp8_kernel_available(device: Union[str, torch.device]) -> bool:
    """True when the fused kernel can run on `device` (builds/loads the op on first call)."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda") or not load_op("fp8"):
        return False
    key = "CPU" if device.type == "cpu" else "CUDA"
    return torch._C._dispatch_has_kernel_for_dispatch_key("engine_fp8::cast", key)


def fp8_cast_kernel(x: torch.Tensor, scale: Scale, dtype: torch.dtype, transpose: bool = False):
    """The fused kernel; raises RuntimeError if it is not available for x's device."""
    s = _check(x, scale, dtype)
    if not fp8_kernel_available(x.device):
        raise RuntimeError(f"the fused FP8 cast is not available on {x.device}; see `python -m engine.ops`")
    out, amax, out_t = torch.ops.engine_fp8.cast(x.contiguous(), s, _FORMAT_CODE[dtype], transpose)
    return (out, amax, out_t) if transpose else (out, amax)


def fp8_cast(x: torch.Tensor, scale: Scale, dtype: torch.dtype, transpose: bool = False):
    """Scale, saturate and round `x` to FP8 with its amax: (out, amax[, out_t]).

    Uses the fused kernel when available for x's device, the reference otherwise; both
    give identical bits (module docstring). `scale` is a float or a one-element float32
    tensor on x's device (a tensor avoids a device sync on GPUs).
    """
    if fp8_kernel_available(x.device):
        return fp8_cast_kernel(x, scale, dtype, transpose)
    return fp8_cast_reference(x, scale, dtype, transpose)
