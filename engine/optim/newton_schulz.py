"""Newton–Schulz orthogonalisation and Muon's learning-rate adjustment, as in torch 2.13.

:func:`newton_schulz` is ``torch.optim._muon._zeropower_via_newtonschulz`` with the compute
dtype made a parameter: ``torch.bfloat16`` (torch's only choice, our default) gives the
same bits as torch; ``torch.float32`` is the option for exactness tests, where the bf16
rounding (relative ~4e-3 per element) would hide layout differences of order 1e-7.

The quintic iteration (coefficients ``(a, b, c)``), on ``X = G / max(||G||_F, eps)``,
transposed first when ``G`` is tall so that the Gram matrix is the small one::

    A = X X^T ;  B = b A + c A A ;  X = a X + B X        (``steps`` times)
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

__all__ = ["DEFAULT_NS_COEFFICIENTS", "DEFAULT_NS_STEPS", "DEFAULT_NS_EPS", "ADJUST_LR_FNS", "newton_schulz",
           "adjusted_lr", "newton_schulz_flops"]

# Keller Jordan's coefficients, torch's defaults.
DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
DEFAULT_NS_EPS = 1e-7
ADJUST_LR_FNS = ("original", "match_rms_adamw")


def newton_schulz(g: torch.Tensor, coefficients: Sequence[float] = DEFAULT_NS_COEFFICIENTS,
                  steps: int = DEFAULT_NS_STEPS, eps: float = DEFAULT_NS_EPS,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The approximate orthogonal factor of the 2-D matrix ``g`` (m, n), computed in
    ``dtype`` and returned in ``dtype`` (as torch returns bf16)."""
    if g.dim() != 2:
        raise ValueError(f"Newton-Schulz needs a 2-D matrix, got shape {tuple(g.shape)}")
    if steps >= 100:
        raise ValueError(f"ns_steps must be below 100 (torch's limit), got {steps}")
    a, b, c = coefficients
    x = g.to(dtype)
    if x is g:
        x = x.clone()  # fp32 input: the normalisation below is in place
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T                                                  # (n, m): the Gram matrix is n x n
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: Optional[str], shape: Sequence[int]) -> float:
    """torch's ``_adjust_lr``: ``"original"`` (or None) scales by sqrt(max(1, A/B)),
    ``"match_rms_adamw"`` by 0.2 sqrt(max(A, B)), for the matrix shape (A, B)."""
    rows, cols = int(shape[0]), int(shape[1])
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
    return lr * ratio


def newton_schulz_flops(rows: int, cols: int, steps: int = DEFAULT_NS_STEPS) -> int:
    """Multiply-add FLOPs of :func:`newton_schulz` on a (rows, cols) matrix: per step, with
    m = min and n = max, the Gram matrix (2 m^2 n), its square (2 m^3) and the update (2 m^2 n)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)
