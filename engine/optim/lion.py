"""Lion, the sign-momentum optimizer, as a ``torch.optim.Optimizer`` over fp32 tensors."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms")::

        c = beta1 * m + (1 - beta1) * g
        p = p * (1 - lr * wd) - lr * sign(c)
        m = beta2 * m + (1 - beta2) * g

    fp32 state (``exp_avg``), decoupled weight decay, as DeepSpeed's FusedLion.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        if not lr >= 0:
            raise ValueError(f"Lion: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lion: betas must be in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.to(p.dtype)
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                update = m.mul(beta1).add_(g, alpha=1 - beta1).sign_()
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(update, alpha=-group["lr"])
                m.mul_(beta2).add_(g, alpha=1 - beta2)
        return loss
