"""One DeepSpeed-API scenario run by real DeepSpeed 0.19.8 or by this engine
(``import engine.compat.deepspeed as deepspeed``), on the ranks of a gloo group, recording what
a script sees: the rows ``initialize(training_data=)``'s loader gives, the lr each optimizer
step uses (``engine.get_lr()`` just before ``engine.step()``), the losses.

``tests/distributed/test_ds_parity.py`` compares our record with the golden file
tests/assets/ds_parity_deepspeed.json, which this module writes by running DeepSpeed:

    OMP_NUM_THREADS=1 PYTHONPATH=tests python tests/distributed/_ds_parity_worker.py --write-golden
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

GOLDEN = Path(__file__).resolve().parents[1] / "assets" / "ds_parity_deepspeed.json"
WORLD = 2
ROWS = 13     # 13 rows over 2 ranks: DeepSpeed's sampler pads to 14, 7 a rank: micro-batches 2, 2, 2, 1
MICRO = 2
STEPS = 4
LR = 0.05

# scheduler.type -> params: each DeepSpeed schedule, warmup short enough to see its shape in STEPS
SCHEDULES: dict[str, dict[str, Any]] = {
    "WarmupLR": {"warmup_min_lr": 0.01, "warmup_max_lr": LR, "warmup_num_steps": 3, "warmup_type": "log"},
    "WarmupDecayLR": {"total_num_steps": 5, "warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 2,
                      "warmup_type": "linear"},
    "WarmupCosineLR": {"total_num_steps": 5, "warmup_min_ratio": 0.1, "warmup_num_steps": 2,
                       "cos_min_ratio": 0.01, "warmup_type": "linear"},
}


class Rows(torch.utils.data.Dataset):
    """Row ``i``: features (4,) from a fixed generator, target (1,), and its index (to read
    the order back)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i], torch.tensor(i)


def _deepspeed(which: str) -> Any:
    if which == "ds":
        import deepspeed
        return deepspeed
    import engine.compat.deepspeed as deepspeed
    return deepspeed


def _config(sched: str, drop_last: bool) -> dict:
    return {"train_batch_size": MICRO * WORLD, "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "scheduler": {"type": sched, "params": SCHEDULES[sched]}, "gradient_clipping": 0.0,
            "dataloader_drop_last": drop_last, "zero_optimization": {"stage": 0}}


def _schedule_run(ds: Any, sched: str, drop_last: bool, steps: int = STEPS) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    eng, _, loader, _ = ds.initialize(model=model, model_parameters=model.parameters(), training_data=Rows(ROWS),
                                      config=_config(sched, drop_last))
    if hasattr(loader, "num_local_io_workers"):
        # DeepSpeed's loader reads with 2 worker processes, which a (daemonic) test rank may not
        # start; in-process reading gives the same batches in the same order
        loader.num_local_io_workers = 0
    rows = [idx.tolist() for _, _, idx in loader]  # one whole pass
    lrs, losses = [], []
    batches = iter(loader)
    for _ in range(steps):
        x, y, _ = next(batches)
        loss = nn.functional.mse_loss(eng(x), y)
        eng.backward(loss)
        lrs.append(float(eng.get_lr()[0]))
        eng.step()
        losses.append(float(loss))
    if hasattr(eng, "destroy"):
        eng.destroy()
    return {"rows": rows, "lrs": lrs, "losses": losses}


class ScaledSGD(torch.optim.SGD):
    """A client optimizer whose constructor sets attributes the update reads (``scale``,
    a per-instance ``history`` list): they must survive the engine taking the object over."""

    def __init__(self, params: Any, lr: float, scale: float) -> None:
        super().__init__(params, lr=lr, momentum=0.9)
        self.scale = scale
        self.history: list[int] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self.history.append(len(self.history))
        for g in self.param_groups:
            g["lr"] = g["initial_lr"] * self.scale ** len(self.history)
        return super().step(closure)


def _client_optimizer(which: str, kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "scaled_sgd":
        opt = ScaledSGD(params, lr=LR, scale=0.5)
        for g in opt.param_groups:
            g["initial_lr"] = LR
        return opt
    if which == "ds":  # DeepSpeed's FusedAdam needs CUDA: its CPU Adam (the same update) stands for both
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(params, lr=LR, weight_decay=0.01)
    from engine.optim.ds_adam import DeepSpeedCPUAdam, FusedAdam
    cls = FusedAdam if kind == "fused_adam" else DeepSpeedCPUAdam
    return cls(params, lr=LR, weight_decay=0.01)


CLIENT_KINDS = ("cpu_adam", "fused_adam", "scaled_sgd")


def _client_run(ds: Any, which: str, kind: str, stage: int) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = _client_optimizer(which, kind, model.parameters())
    cfg = {"train_batch_size": MICRO * WORLD, "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "zero_allow_untested_optimizer": True}
    if which != "ds":
        cfg.pop("zero_allow_untested_optimizer")  # DeepSpeed's guard; every optimizer is allowed here
    eng, *_ = ds.initialize(model=model, optimizer=opt, config=cfg)
    data, losses = Rows(ROWS), []
    for s in range(STEPS):
        rows = [data[(s * WORLD * MICRO + eng.global_rank * MICRO + i) % ROWS] for i in range(MICRO)]
        x, y = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
        loss = nn.functional.mse_loss(eng(x), y)
        eng.backward(loss)
        eng.step()
        losses.append(float(loss))
    if hasattr(eng, "destroy"):
        eng.destroy()
    return losses


def scenario(rank: int, world: int, which: str, stages: tuple[int, ...] = (0, 1, 2, 3)) -> dict:
    """Every schedule, and the loader with and without dataloader_drop_last."""
    os.environ.setdefault("LOCAL_RANK", str(rank))  # DeepSpeed asserts the launcher's variables
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    ds = _deepspeed(which)
    out = {f"sched_{s}": _schedule_run(ds, s, drop_last=False) for s in SCHEDULES}
    out["drop_last"] = _schedule_run(ds, "WarmupLR", drop_last=True, steps=0)["rows"]
    out["client"] = {f"{kind}_z{stage}": _client_run(ds, which, kind, stage)
                     for kind in CLIENT_KINDS if not (which == "ds" and kind == "fused_adam") for stage in stages}
    return out


def run(which: str, timeout: float = 300.0, stages: tuple[int, ...] = (0, 1, 2, 3)) -> list[dict]:
    from harness import run_ranks
    return run_ranks(scenario, WORLD, which, stages, timeout=timeout)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--write-golden", action="store_true", required=True,
                        help=f"run the scenarios on real DeepSpeed and write {GOLDEN.name}")
    parser.parse_args()
    import deepspeed
    GOLDEN.write_text(json.dumps({"deepspeed": deepspeed.__version__, "ranks": run("ds", timeout=900)}) + "\n")
    print("wrote", GOLDEN)
