"""engine.initialize tells the user, once and on rank 0 only, which config keys have no effect."""

import logging

import torch
import torch.nn as nn
from harness import run_ranks


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x, y):
        return ((self.lin(x) - y) ** 2).mean()


def _initialize_and_collect(rank, world):
    import engine

    seen: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    root = logging.getLogger()
    root.addHandler(_Keep(level=logging.WARNING))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 1, "contiguous_gradients": True, "sub_group_size": 1000},
           "zero_allow_untested_optimizer": True}
    torch.manual_seed(0)
    engine.initialize(model=_Tiny(), config=cfg)
    return [m for m in seen if "no effect" in m]


def test_ignored_keys_are_named_once_on_rank_0():
    rank0, rank1 = run_ranks(_initialize_and_collect, 2, timeout=120)
    assert rank1 == []
    assert len(rank0) == 1, rank0
    msg = rank0[0]
    for key in ("zero_allow_untested_optimizer", "zero_optimization.contiguous_gradients",
                "zero_optimization.sub_group_size"):
        assert f"\n  {key}: " in msg, msg
    assert msg.startswith("3 config key(s)")
