"""AdamW step over lists of tensors: the fused kernel's frontend and its PyTorch reference.

The reference is torch.optim.AdamW's single-tensor update, op for op:

    p  <- p * (1 - lr * wd)                       decoupled weight decay
    m  <- lerp(m, g, 1 - beta1)
    v  <- v * beta2 + (1 - beta2) * g * g
    p  <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

(bias_correction=False drops both (1 - beta^t) terms; maximize=True uses -g.) The fused
kernel (csrc/adam/) does the same per element in one pass and can also write a
bf16/fp16 copy of the updated parameter in that pass (the model weights of a
mixed-precision run, or of a ZeRO shard). amsgrad is not implemented.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from engine.ops.builder import get_builder, load_op

__all__ = ["AdamWHyper", "adamw_reference", "adamw_step", "fused_adamw_available", "fused_adamw_problem"]

logger = logging.getLogger(__name__)

Tensors = Sequence[torch.Tensor]


@dataclass(frozen=True)
class AdamWHyper:
    """The scalars of one AdamW step (``step`` is the 1-based count the bias correction uses)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: float
    bias_correction: bool = True
    maximize: bool = False


def adamw_reference(params: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors, hp: AdamWHyper,
                    *, param_copies: Optional[Tensors] = None) -> None:
    """In-place AdamW step with torch ops (the definition the kernel is tested against)."""
    lr, beta1, beta2, weight_decay = float(hp.lr), float(hp.beta1), float(hp.beta2), float(hp.weight_decay)
    bc1 = 1 - beta1 ** float(hp.step) if hp.bias_correction else 1.0
    bc2 = 1 - beta2 ** float(hp.step) if hp.bias_correction else 1.0
    step_size = lr / bc1
    bc2_sqrt = bc2 ** 0.5
    for i, p in enumerate(params):
        g = grads[i].to(p.dtype)
        if hp.maximize:
            g = -g
        m, v = exp_avgs[i], exp_avg_sqs[i]
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bc2_sqrt).add_(float(hp.eps))
        p.addcdiv_(m, denom, value=-step_size)
        if param_copies is not None:
            param_copies[i].copy_(p)


def fused_adamw_available(device: Union[str, torch.device]) -> bool:
    """True when the fused kernel can run on `device` (builds/loads the op on first call)."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda") or not load_op("adam"):
        return False
    key = "CPU" if device.type == "cpu" else "CUDA"
    return torch._C._dispatch_has_kernel_for_dispatch_key("engine_adam::adamw_step", key)


def fused_adamw_problem(device: Union[str, torch.device]) -> Optional[str]:
    """None when the fused kernel runs on ``device``, else why not, with the fix (a CUDA
    device whose op was built without nvcc is the case that used to pass unnoticed: the CPU
    kernel loads, the reference runs on the GPU)."""
    device = torch.device(device)
    if fused_adamw_available(device):
        return None
    if device.type not in ("cpu", "cuda"):
        return f"the fused kernel has no {device.type} implementation"
    builder = get_builder("adam")
    if not builder.is_loaded():
        why = builder.jit_problem() or "its build or load failed (the engine.ops warning above gives the error)"
        return f"the op is not loaded: {why}"
    if device.type == "cuda":
        why = builder.cuda_problem() or "the loaded library was built without CUDA (an earlier build without nvcc)"
        return (f"the op was built without its CUDA kernel: {why}; install the CUDA toolkit (nvcc) and rebuild "
                "(`python -m engine.ops --load`), or build ahead of time with ENGINE_BUILD_OPS=1")
    return "the loaded library has no CPU kernel"


def _kernel_eligible(tensors: Sequence[Tensors]) -> bool:
    return all(t.is_contiguous() for ts in tensors for t in ts)


def adamw_step(params: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors, hp: AdamWHyper, *,
               param_copies: Optional[Tensors] = None, use_kernel: Optional[bool] = None) -> None:
    """One AdamW step over tensors on one device (fp32 params/states; grads fp32, bf16 or fp16).

    use_kernel: None = the fused kernel when available (else the reference), True = require
    the kernel (RuntimeError if unavailable), False = the reference.
    """
    if not params:
        return
    lists = [params, grads, exp_avgs, exp_avg_sqs] + ([param_copies] if param_copies is not None else [])
    device = params[0].device
    if use_kernel is None:
        use_kernel = fused_adamw_available(device) and _kernel_eligible(lists)
    elif use_kernel and not fused_adamw_available(device):
        raise RuntimeError(f"the fused AdamW kernel is not available on {device}; see `python -m engine.ops`")
    if not use_kernel:
        adamw_reference(params, grads, exp_avgs, exp_avg_sqs, hp, param_copies=param_copies)
        return
    torch.ops.engine_adam.adamw_step(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
        list(param_copies) if param_copies is not None else [],
        float(hp.lr), float(hp.beta1), float(hp.beta2), float(hp.eps), float(hp.weight_decay),
        float(hp.step), hp.bias_correction, hp.maximize)
