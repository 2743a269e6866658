"""Mixed-precision policy: compute dtype, fp32 master weights, non-finite gradient checks.

The model runs in the compute dtype (bf16 / fp16 / fp32). The optimizer owns fp32 master
weights and fp32 state; gradients are accumulated and reduced in fp32 and the updated
master weights are cast back to the compute dtype after each step (engine/zero/).

Skipping on non-finite gradients: fp16 always checks (that is how dynamic loss scaling
finds overflows); bf16 checks by default (DeepSpeed's ``bf16.check_grad_overflow``) and
counts the skipped steps; fp32 does not check unless asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from engine.distributed import comm
from engine.distributed.groups import AxisGroup
from engine.errors import ConfigError

__all__ = ["PrecisionPolicy", "resolve_compute_dtype", "local_nonfinite_count", "any_rank_true"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_compute_dtype(fp16_enabled: bool = False, bf16_enabled: bool = False) -> torch.dtype:
    """The compute dtype from the ``fp16.enabled`` / ``bf16.enabled`` flags."""
    if fp16_enabled and bf16_enabled:
        raise ConfigError("fp16.enabled and bf16.enabled are both true: enable at most one")
    if fp16_enabled:
        return torch.float16
    if bf16_enabled:
        return torch.bfloat16
    return torch.float32


@dataclass(frozen=True)
class PrecisionPolicy:
    """``compute_dtype`` for parameters, activations and the gradients autograd produces;
    ``master_dtype`` for master weights, reduced gradients and optimizer state;
    ``check_nonfinite``: skip (and count) steps whose gradients hold inf/NaN anywhere;
    ``grad_accum_dtype``: DeepSpeed's ``data_types.grad_accum_dtype``, the dtype of a FULL
    gradient accumulated over micro-batches (ZeRO-1's; stage 0's is the fp32 master gradient and
    stages 2/3 add each micro-batch's reduced shard into the fp32 master gradient). None: the
    compute dtype, DeepSpeed's default; fp32 or the compute dtype only."""

    compute_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32
    check_nonfinite: Optional[bool] = None  # None: on for fp16/bf16, off for fp32
    grad_accum_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        if self.compute_dtype not in _DTYPES.values():
            raise ConfigError(f"compute dtype must be one of fp32/bf16/fp16, got {self.compute_dtype}")
        if self.master_dtype != torch.float32:
            raise ConfigError(f"master weights and optimizer state are kept in fp32, got {self.master_dtype}")
        if self.grad_accum_dtype not in (None, torch.float32, self.compute_dtype):
            raise ConfigError(f"data_types.grad_accum_dtype {self.grad_accum_dtype} with compute dtype "
                              f"{self.compute_dtype}: gradients accumulate in fp32 or in the compute dtype; "
                              "set it to \"fp32\" or remove it (the default follows the compute dtype)")

    @property
    def accum_dtype(self) -> torch.dtype:
        """The resolved ``grad_accum_dtype`` (the compute dtype when unset, as DeepSpeed)."""
        return self.compute_dtype if self.grad_accum_dtype is None else self.grad_accum_dtype

    @property
    def checks_nonfinite(self) -> bool:
        if self.compute_dtype == torch.float16:
            return True  # dynamic loss scaling depends on it
        if self.check_nonfinite is None:
            return self.compute_dtype == torch.bfloat16
        return bool(self.check_nonfinite)

    @classmethod
    def from_name(cls, name: str, check_nonfinite: Optional[bool] = None,
                  grad_accum: Optional[str] = None) -> "PrecisionPolicy":
        """From ``"fp32"`` / ``"bf16"`` / ``"fp16"`` (and ``grad_accum``, the same names)."""
        for n in (name, grad_accum):
            if n is not None and n not in _DTYPES:
                raise ConfigError(f"precision {n!r} is not one of {sorted(_DTYPES)}")
        return cls(compute_dtype=_DTYPES[name], check_nonfinite=check_nonfinite,
                   grad_accum_dtype=None if grad_accum is None else _DTYPES[grad_accum])


def local_nonfinite_count(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Number of inf/NaN elements over ``tensors`` (a 0-dim fp32 tensor, no host sync)."""
    total: Optional[torch.Tensor] = None
    for t in tensors:
        c = (~torch.isfinite(t)).sum(dtype=torch.float32)
        total = c if total is None else total + c
    return total if total is not None else torch.zeros((), dtype=torch.float32)


def any_rank_true(flag: torch.Tensor, groups: Sequence[Optional[AxisGroup]]) -> bool:
    """True when ``flag`` (0-dim, > 0 means true) is true on any rank of the mesh spanned by
    ``groups`` (e.g. the DP, TP and PP groups). One host sync."""
    t = flag.detach().to(torch.float32).reshape(1).clone()
    for g in groups:
        if g is not None:
            comm.all_reduce(t, g, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)
