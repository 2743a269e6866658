"""Memory accounting for the ZeRO stages: what a rank holds, and what the ZeRO paper says
it should hold.

The paper (Rajbhandari et al., 2020, sec. 5) counts, for ``Psi`` parameters trained with
mixed-precision Adam on ``N_d`` data-parallel ranks: 2 Psi bytes of fp16 parameters, 2 Psi
of fp16 gradients and K Psi (K = 12: fp32 master weights, momentum, variance) of optimizer
state, and divides by ``N_d``:

    stage 0: (2 + 2 + K) Psi        stage 2: 2 Psi + (2 + K) Psi / N_d
    stage 1: 2 Psi + 2 Psi + K Psi / N_d        stage 3: (2 + 2 + K) Psi / N_d

Our optimizers accumulate and reduce gradients in fp32, so the gradient term uses 4 bytes
per element by default (``grad_bytes``); stage 1 additionally holds its fp32 master-gradient
shard (``4 Psi / N_d``) next to the full accumulator.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.metrics import peak_memory_bytes

__all__ = ["zero_memory_formula", "memory_report"]


def zero_memory_formula(num_params: int, stage: int, dp: int, *, param_bytes: int = 2,
                        grad_bytes: int = 4, optimizer_bytes: int = 12) -> dict[str, float]:
    """Bytes per rank in parameters, gradients and optimizer state by the ZeRO paper's
    formula (see the module docstring), for ``num_params`` elements on ``dp`` ranks."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {stage}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    n = float(num_params)
    return {
        "params": param_bytes * n / (dp if stage >= 3 else 1),
        "grads": grad_bytes * n / (dp if stage >= 2 else 1),
        "optimizer_state": optimizer_bytes * n / (dp if stage >= 1 else 1),
    }


def memory_report(optimizer: Any, device: torch.device) -> dict[str, int]:
    """``optimizer.memory_bytes()`` (params, grads, optimizer_state counted from the
    optimizer's own tensors) plus ``peak``: max RSS of this process on CPU, max allocated
    on CUDA."""
    out = dict(optimizer.memory_bytes())
    out["peak"] = peak_memory_bytes(device)
    return out
