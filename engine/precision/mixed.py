"""Mixed-precision policy: compute dtype, fp32 master weights, non-finite gradient checks.

The model runs in the compute dtype (bf16 / fp16 / fp32). The optimizer owns fp32 master
weights and fp32 state; gradients are accumulated and reduced in fp32 and the updated
master weights are cast back to the compute dtype after each step (engine/zero/).

Skipping on non-finite gradients: fp16 always checks (that is how dynamic loss scaling
finds overflows); bf16 checks by default (DeepSpeed's ``bf16.check_grad_overflow``) and
counts the skipped steps; fp32 checks too (unlike DeepSpeed, which applies a NaN step in
fp32): a diverging fp32 run must not write NaN into its master weights and checkpoints
(issue 30). The check costs one host read of a flag per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.errors import ConfigError

__all__ = ["PrecisionPolicy"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """``compute_dtype`` for parameters, activations and the gradients autograd produces;
    ``master_dtype`` for master weights, reduced gradients and optimizer state (fp32; bf16 with
    DeepSpeed's ``bf16.bf16_master_weights_and_grads``: the flat master shard, its gradient
    shard and, as ``bf16_optimizer_states`` requires then, the Adam moments);
    ``check_nonfinite``: skip (and count) steps whose gradients hold inf/NaN anywhere;
    ``grad_accum_dtype``: DeepSpeed's ``data_types.grad_accum_dtype``, the dtype of a FULL
    gradient accumulated over micro-batches (ZeRO-1's; stage 0's is the fp32 master gradient and
    stages 2/3 add each micro-batch's reduced shard into the fp32 master gradient). None: the
    compute dtype, DeepSpeed's default; fp32 or the compute dtype only; ``comm_dtype``:
    DeepSpeed's ``communication_data_type``, the dtype ZeRO's gradient reductions run in
    (fp32 by default here; the reduced gradient lands in fp32 whatever it is)."""

    compute_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32
    check_nonfinite: Optional[bool] = None  # None: on (every precision); False: off (bf16 / fp32 only)
    grad_accum_dtype: Optional[torch.dtype] = None
    comm_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.compute_dtype not in _DTYPES.values():
            raise ConfigError(f"compute dtype must be one of fp32/bf16/fp16, got {self.compute_dtype}")
        if self.master_dtype not in (torch.float32, self.compute_dtype) or self.master_dtype == torch.float16:
            # bf16 masters (DeepSpeed's bf16.bf16_master_weights_and_grads) of a bf16 model only
            raise ConfigError(f"master weights of a {self.compute_dtype} model are kept in fp32 (or bf16 with "
                              f"bf16.bf16_master_weights_and_grads), got {self.master_dtype}")
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
        return True if self.check_nonfinite is None else bool(self.check_nonfinite)

    @classmethod
    def from_name(cls, name: str, check_nonfinite: Optional[bool] = None,
                  grad_accum: Optional[str] = None, comm: str = "fp32", master: str = "fp32") -> "PrecisionPolicy":
        """From ``"fp32"`` / ``"bf16"`` / ``"fp16"`` (and ``grad_accum``, ``comm``, ``master``, the same names)."""
        for n in (name, grad_accum, comm, master):
            if n is not None and n not in _DTYPES:
                raise ConfigError(f"precision {n!r} is not one of {sorted(_DTYPES)}")
        return cls(compute_dtype=_DTYPES[name], check_nonfinite=check_nonfinite,
                   grad_accum_dtype=None if grad_accum is None else _DTYPES[grad_accum], comm_dtype=_DTYPES[comm],
                   master_dtype=_DTYPES[master])
