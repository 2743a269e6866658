"""DeepSpeed's engine queries on 2 gloo ranks, through ``engine.compat.deepspeed``:

- ``engine.local_rank`` is the launcher's ``LOCAL_RANK`` on every rank when the script called
  ``deepspeed.init_distributed()`` before ``initialize`` (DeepSpeed's tutorial order; it was 0
  on every rank before, so ``.to(engine.local_rank)`` put every rank's batch on device 0);
  ``args.local_rank`` is set to it as DeepSpeed does;
- ``world_size``, ``zero_optimization_stage()``, ``fp16_enabled()``, ``bfloat16_enabled()``
  answer from the config; ``data_parallel_size`` and a disabled ``torch_autocast`` load;
- ``empty_partition_cache()`` releases what ZeRO-3 keeps gathered after an evaluation
  forward, and training goes on after it with the losses of an engine that did not call it.
"""

from __future__ import annotations

import os
import types

import pytest
import torch
import torch.nn as nn
from harness import scaled

import engine.compat.deepspeed as deepspeed
from engine.distributed.spawn import spawn


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.fc2(torch.tanh(self.fc1(x))), y)


def _batch(i, rank):
    g = torch.Generator().manual_seed(10 * i + rank)
    return torch.randn(2, 6, generator=g), torch.randn(2, 3, generator=g)


def _engine(stage, world, args=None):
    model = _Net()
    cfg = {"train_micro_batch_size_per_gpu": 2, "data_parallel_size": world, "torch_autocast": {"enabled": False},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                 "stage3_max_reuse_distance": 10**9}}
    eng, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(), config=cfg)
    return eng


def _queries(stage):
    """In a rank started with torchrun's environment (spawn's "env" mode), as a script: the
    script initialises the group itself, then builds the engine."""
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        return _queries_on_group(stage, deepspeed.comm.get_rank(), deepspeed.comm.get_world_size())
    finally:
        deepspeed.comm.destroy_process_group()


def _queries_on_group(stage, rank, world):
    args = types.SimpleNamespace(local_rank=-1)  # argparse's default when torchrun starts the script
    eng = _engine(stage, world, args)
    out = {"local_rank": eng.local_rank, "args_local_rank": args.local_rank, "env": int(os.environ["LOCAL_RANK"]),
           "world_size": eng.world_size, "stage": eng.zero_optimization_stage(), "fp16": eng.fp16_enabled(),
           "bf16": eng.bfloat16_enabled()}
    twin = _engine(stage, world)  # never empties its cache
    losses = []
    for i in range(3):
        for e in (eng, twin):
            with torch.no_grad():
                e(*_batch(100 + i, rank))  # an evaluation forward
        live = [eng.optimizer._live_numel] if stage == 3 else [0]  # elements held gathered (ZeRO-3)
        eng.empty_partition_cache()
        live.append(eng.optimizer._live_numel if stage == 3 else 0)
        out.setdefault("live", []).append(live)
        pair = []
        for e in (eng, twin):
            loss = e(*_batch(i, rank))
            e.backward(loss)
            e.step()
            pair.append(loss.item())
        losses.append(pair)
    out["losses"] = losses
    eng.destroy()
    twin.destroy()
    return out


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.extended),
                                   pytest.param(3, marks=pytest.mark.slow)])
def test_engine_queries_and_local_rank_after_init_distributed(stage):
    res = spawn(_queries, 2, (stage,), rendezvous="env", timeout=scaled(180))
    for rank, r in enumerate(res):
        assert r["local_rank"] == r["env"] == rank and r["args_local_rank"] == rank
        assert r["world_size"] == 2 and r["stage"] == stage and not r["fp16"] and not r["bf16"]
        for ours, twin in r["losses"]:
            assert ours == twin  # same arithmetic: releasing and gathering again changes no value
        if stage == 3:  # after the first step the recorded order keeps units for reuse (max_reuse_distance)
            assert max(before for before, _ in r["live"]) > 0, "nothing was left gathered: the test proves nothing"
            assert all(after == 0 for _, after in r["live"]), r["live"]
