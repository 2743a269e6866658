"""The rest of DeepSpeed's surface on 2 gloo ranks, in one spawned group:

- monitors: ``tensorboard`` and ``csv_monitor`` sections write DeepSpeed's tags
  (Train/Samples/train_loss, Train/Samples/lr, Train/Samples/eval_loss) at
  ``global_samples``, from rank 0 only; the values read back equal what the engine returned;
- ``mpu=``: an mpu that agrees with the config's layout is accepted, one that does not is
  refused on every rank naming the mismatch;
- a client optimizer or scheduler next to the config's section is an error, as is no
  optimizer at all; ``init_distributed`` is a no-op once initialised.
"""

from __future__ import annotations

import csv
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from harness import run_ranks

import engine
import engine.compat.deepspeed as deepspeed

MICRO, GA = 2, 2


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 3)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.fc(x), y)


def _cfg(out: str, **extra):
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
           "tensorboard": {"enabled": True, "output_path": out, "job_name": "tb"},
           "csv_monitor": {"enabled": True, "output_path": out, "job_name": "csv"}}
    cfg.update(extra)
    return cfg


def _plain(**extra):
    return {k: v for k, v in _cfg("", **extra).items() if k not in ("tensorboard", "csv_monitor")}


def _mb(i, rank):
    g = torch.Generator().manual_seed(10 * i + rank)
    return torch.randn(MICRO, 6, generator=g), torch.randn(MICRO, 3, generator=g)


class _Mpu:
    def __init__(self, dp_size, dp_rank, group):
        self.dp_size, self.dp_rank, self.group = dp_size, dp_rank, group

    def get_data_parallel_world_size(self):
        return self.dp_size

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_data_parallel_group(self):
        return self.group

    def get_model_parallel_world_size(self):
        return 1

    def get_model_parallel_rank(self):
        return 0


def _checks(rank, world, out):
    res = {}
    deepspeed.init_distributed()  # already initialised by the harness: returns
    model = _Net()
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_cfg(out),
                                   mpu=_Mpu(world, rank, dist.group.WORLD))
    losses = []
    for step in range(2):  # the DeepSpeed loop
        step_losses = []
        for m in range(GA):
            loss = eng(*_mb(2 * step + m, rank))
            eng.backward(loss)
            eng.step()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / GA)
    losses.append(eng.train_batch(iter([_mb(10 + m, rank) for m in range(GA)])).item())  # DP mean
    res["eval"] = eng.eval_batch(iter([_mb(20 + m, rank) for m in range(GA)])).item()
    res["losses"], res["samples"], res["lr"] = losses, eng.global_samples, eng.get_lr()[0]
    errors = {}
    for name, kwargs in {
        "mpu_size": dict(config=_plain(), mpu=_Mpu(world + 1, rank, dist.group.WORLD)),
        "mpu_group": dict(config=_plain(), mpu=_Mpu(world, rank, dist.new_group([0]))),
        "both_optimizers": dict(config=_plain(), optimizer=torch.optim.SGD(_Net().parameters(), lr=0.1)),
        "no_optimizer": dict(config={k: v for k, v in _plain().items() if k != "optimizer"}),
        "both_schedulers": dict(config=_plain(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 2}}),
                                lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)),
    }.items():
        m = _Net()
        try:
            deepspeed.initialize(model=m, model_parameters=m.parameters(), **kwargs)
        except (ValueError, TypeError) as exc:
            errors[name] = str(exc)
    res["errors"] = errors
    return res


@pytest.fixture(scope="module")
def compat_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("monitor"))
    return out, run_ranks(_checks, 2, out, timeout=200)


def test_monitors_write_deepspeed_tags_read_back(compat_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, results = compat_run
    r0 = results[0]
    samples = [MICRO * GA * 2 * (i + 1) for i in range(3)]  # train_batch_size per step
    acc = EventAccumulator(os.path.join(out, "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/eval_loss"} <= tags
    train = acc.Scalars("Train/Samples/train_loss")
    assert [e.step for e in train] == samples
    # step 1-2: rank 0's own mean (the DeepSpeed loop); step 3: train_batch's DP mean
    assert [e.value for e in train] == pytest.approx(r0["losses"], rel=1e-6)
    assert acc.Scalars("Train/Samples/lr")[-1].value == pytest.approx(r0["lr"])
    assert acc.Scalars("Train/Samples/eval_loss")[-1].value == pytest.approx(r0["eval"], rel=1e-6)
    with open(os.path.join(out, "csv", "Train_Samples_train_loss.csv")) as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "train_loss"]
    assert [int(r[0]) for r in rows[1:]] == samples
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(r0["losses"], rel=1e-6)
    assert sorted(os.listdir(os.path.join(out, "csv"))) == [
        "Train_Samples_eval_loss.csv", "Train_Samples_lr.csv", "Train_Samples_train_loss.csv"]


def test_mpu_and_client_object_errors_name_the_problem(compat_run):
    for r in compat_run[1]:  # every rank raises, with the same kind of message
        e = r["errors"]
        assert "get_data_parallel_world_size() = 3" in e["mpu_size"] or "another rank" in e["mpu_size"]
        assert "get_data_parallel_group()" in e["mpu_group"] or "another rank" in e["mpu_group"]
        assert "optimizer section" in e["both_optimizers"] and "optimizer=" in e["both_optimizers"]
        assert "no optimizer" in e["no_optimizer"]
        assert "scheduler section" in e["both_schedulers"]
    assert "get_data_parallel_world_size() = 3" in compat_run[1][0]["errors"]["mpu_size"]


def test_wandb_section_without_the_package_names_it():
    import importlib.util

    from engine.config import load_config
    from engine.monitor import build_monitor

    cfg = load_config({"train_batch_size": 2, "optimizer": {"type": "AdamW"}, "wandb": {"enabled": True}},
                      world_size=1)
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    with pytest.raises(engine.config.ConfigError, match="'wandb' package is not installed"):
        build_monitor(cfg.monitor, is_writer=True)
