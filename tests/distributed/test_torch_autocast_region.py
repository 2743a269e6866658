"""``torch_autocast``: every path by which the engine runs the module's forward runs it in
the section's autocast region: ``engine(...)`` (DeepSpeed's loop), and the engine's own
``train_batch`` / ``eval_batch``, which call the module themselves (before the fix they ran it
in fp32, ignoring the enabled section). One gloo rank, an fp32 model (bf16 section off), so
the region alone decides the Linear's output dtype."""

from __future__ import annotations

import torch
from harness import run_ranks


def _run(rank, world):
    import torch.nn as nn

    import engine.compat.deepspeed as deepspeed

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.fc = nn.Linear(6, 3)
            self.seen = []

        def forward(self, x, y):
            out = self.fc(x)
            self.seen.append((torch.is_autocast_enabled("cpu"), out.dtype))
            return nn.functional.mse_loss(out.float(), y)

    model = Net()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": 1}}
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(2, 6, generator=g), torch.randn(2, 3, generator=g)) for _ in range(2)]
    eng(*batches[0])
    forward = list(model.seen)
    model.seen.clear()
    eng.train_batch(iter(batches))
    eng.eval_batch(iter(batches))
    return {"forward": forward, "batches": list(model.seen)}


def test_train_and_eval_batch_run_the_module_under_torch_autocast():
    (r,) = run_ranks(_run, 1, timeout=120)
    assert r["forward"] == [(True, torch.bfloat16)]
    assert len(r["batches"]) == 4  # 2 train + 2 eval micro-batches
    assert all(seen == (True, torch.bfloat16) for seen in r["batches"]), r["batches"]
