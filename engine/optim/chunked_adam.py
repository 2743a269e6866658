"""torch's Adam/AdamW stepped in chunks: temporaries the size of a chunk, not of the tensor.

The ZeRO optimizers give the inner optimizer ONE flat fp32 master tensor per group (the
whole model at stage 0). ``torch.optim.AdamW`` then allocates temporaries the size of that
tensor during the step (the ``sqrt`` of the second moment and the update: the multi-tensor
path allocates them per tensor, the per-tensor path too), which sets the peak of stage 0.

:class:`ChunkedAdamW` (and :class:`ChunkedAdam`) run torch's own update,
``torch.optim.adam.adam``, on consecutive ``chunk_numel``-element views of each
parameter, its gradient and its two moments, one chunk after another: the arithmetic per
element is torch's (bit-identical results: the update is elementwise), the temporaries are
chunk-sized. The state (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter) and the state
dict are exactly torch's, so checkpoints written with ``torch.optim.AdamW`` load unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.optim.adam import adam

__all__ = ["ChunkedAdam", "ChunkedAdamW", "DEFAULT_CHUNK_NUMEL", "DEFAULT_DEVICE_CHUNK_NUMEL"]

DEFAULT_CHUNK_NUMEL = 1 << 20  # 1M elements: 4 MiB fp32 per temporary (host memory)
# On an accelerator each chunk costs the host ~0.2-1.5 ms of Python and a dozen kernel
# launches while the device does 1M elements in microseconds: with 1M-element chunks a
# 1B-element master takes ~1000 chunks, seconds of host time per step (measured per chunk
# on CPU: benchmarks/results/gpu_ready_slow_paths.md). 64M elements (256 MiB fp32 per
# temporary) keeps the temporaries small beside the device's memory and the chunks few.
DEFAULT_DEVICE_CHUNK_NUMEL = 1 << 26


class ChunkedAdam(torch.optim.Adam):
    """``torch.optim.Adam`` (with ``decoupled_weight_decay``: AdamW) whose step runs chunk by
    chunk (see the module docstring). Takes torch's arguments plus ``chunk_numel`` (None:
    :data:`DEFAULT_CHUNK_NUMEL` for a parameter in host memory, :data:`DEFAULT_DEVICE_CHUNK_NUMEL`
    on an accelerator)."""

    def __init__(self, params: Any, *args: Any, chunk_numel: Optional[int] = None, **kwargs: Any):
        if chunk_numel is not None and chunk_numel < 1:
            raise ValueError(f"chunk_numel must be >= 1, got {chunk_numel}")
        if kwargs.get("fused") or kwargs.get("capturable") or kwargs.get("differentiable"):
            raise ValueError("ChunkedAdam runs torch's foreach/per-tensor update: fused, capturable and "
                             "differentiable are not supported (use torch.optim.Adam for those)")
        super().__init__(params, *args, **kwargs)
        self.chunk_numel = None if chunk_numel is None else int(chunk_numel)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            exp_avgs: list[torch.Tensor] = []
            exp_avg_sqs: list[torch.Tensor] = []
            max_sqs: list[torch.Tensor] = []
            steps: list[torch.Tensor] = []
            has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps)
            if has_complex:
                raise ValueError("ChunkedAdam does not take complex parameters")
            for k, p in enumerate(params):
                tensors = [p, grads[k], exp_avgs[k], exp_avg_sqs[k]] + ([max_sqs[k]] if group["amsgrad"] else [])
                self._step_chunks(group, tensors, steps[k])
        return loss

    def _step_chunks(self, group: dict[str, Any], tensors: list[torch.Tensor], step: torch.Tensor) -> None:
        """One parameter: torch's update on each chunk of (param, grad, exp_avg, exp_avg_sq
        [, max_exp_avg_sq]). Every chunk sees the same step count (the update increments
        the step tensor it is given: it is reset before each chunk)."""
        flat = [t.view(-1) if t.is_contiguous() else None for t in tensors]
        before = step.clone()
        n = tensors[0].numel()
        chunk = self.chunk_numel or (DEFAULT_CHUNK_NUMEL if tensors[0].device.type == "cpu"
                                     else DEFAULT_DEVICE_CHUNK_NUMEL)
        ranges = [(0, n)] if any(f is None for f in flat) else \
            [(lo, min(lo + chunk, n)) for lo in range(0, n, chunk)]
        for lo, hi in ranges:
            step.copy_(before)
            part = tensors if (lo, hi) == (0, n) else [f[lo:hi] for f in flat]  # type: ignore[index]
            beta1, beta2 = group["betas"]
            adam([part[0]], [part[1]], [part[2]], [part[3]], part[4:5], [step], amsgrad=group["amsgrad"],
                 beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                 maximize=group["maximize"], foreach=group["foreach"], capturable=False, differentiable=False,
                 fused=None, grad_scale=None, found_inf=None,
                 decoupled_weight_decay=group["decoupled_weight_decay"])


class ChunkedAdamW(ChunkedAdam):
    """``torch.optim.AdamW`` stepped in chunks (decoupled weight decay, torch's default 1e-2)."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, chunk_numel: Optional[int] = None,
                 **kwargs: Any):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         decoupled_weight_decay=True, chunk_numel=chunk_numel, **kwargs)
