"""bf16 master weights (DeepSpeed's ``bf16.bf16_master_weights_and_grads``) need sharded
optimizer state: the config refuses them at stage 0, and a ZeRO optimizer built directly
through the programmatic API refuses them the same way, in its constructor (stage 0 would
accumulate every micro-batch's gradient into the bf16 master gradient, rounding each add)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine.precision.mixed import PrecisionPolicy
from engine.zero import build_zero_optimizer
from engine.zero.stage0 import DataParallelOptimizer
from engine.zero.stage1 import Zero1Optimizer

BF16_MASTER = PrecisionPolicy(compute_dtype=torch.bfloat16, master_dtype=torch.bfloat16)
MATCH = (r"DataParallelOptimizer \(ZeRO stage 0\) with master_dtype torch.bfloat16: bf16 master weights and "
         r"gradients need ZeRO stage 1, 2 or 3 .* or PrecisionPolicy\(master_dtype=torch.float32\)")


def _model() -> torch.nn.Module:
    return torch.nn.Linear(4, 3).to(torch.bfloat16)


def _factory(groups):
    return torch.optim.AdamW(groups)


def test_stage0_refuses_bf16_masters_in_its_constructor():
    # the check runs before anything else (no process group needed to see it)
    with pytest.raises(ValueError, match=MATCH):
        DataParallelOptimizer(_model().parameters(), _factory, None, precision=BF16_MASTER)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=MATCH):
        build_zero_optimizer(0, _model(), _factory, None, precision=BF16_MASTER)  # type: ignore[arg-type]


@pytest.mark.skipif(dist.is_available() and dist.is_initialized(),
                    reason="a process group from another test: the controls would build for real")
def test_fp32_masters_at_stage0_and_bf16_masters_at_stage1_pass_the_check():
    """Controls: these get past the check to the next one, the process group's."""
    fp32_master = PrecisionPolicy(compute_dtype=torch.bfloat16)
    for cls, policy in ((DataParallelOptimizer, fp32_master), (Zero1Optimizer, BF16_MASTER)):
        with pytest.raises(RuntimeError, match="initialised process group"):
            cls(_model().parameters(), _factory, None, precision=policy)  # type: ignore[arg-type]
