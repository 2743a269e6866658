"""Our engine against DeepSpeed: the same plain GPT, data and DeepSpeed JSON config through
``deepspeed.initialize`` and ``engine.initialize`` in the same processes, one ZeRO stage
per process group lifetime (fresh processes per stage: DeepSpeed's ZeRO-3 installs
module hooks and process-wide state that must not leak into the next stage)."""

from __future__ import annotations

import logging
import traceback
import warnings
from typing import Any, Optional

from benchmarks._compare_common import System, alternate, ds_style_step
from benchmarks._compare_model import ModelSpec, PlainGPT, ds_config, make_batches
from benchmarks.common import CommTimer, PhaseTimer

__all__ = ["rank_ds_vs_ours"]


def rank_ds_vs_ours(spec_d: dict, stage: int, steps: int, warmup: int, timeout: float,
                    bf16: bool = False, zero: Optional[dict] = None) -> dict[str, Any]:
    """One rank of the comparison at one ZeRO stage; DeepSpeed's failure (if any) is
    returned as its reason, not raised, so our row still prints. ``bf16``: both compute in
    bf16 with fp32 masters (for GPUs; the losses then agree only to bf16 rounding)."""
    import torch.distributed as dist

    import engine
    from engine.distributed.env import init_distributed

    comm = CommTimer().install()  # before DeepSpeed binds torch.distributed functions
    env = init_distributed(timeout_s=timeout)
    comm.device = env.device
    spec = ModelSpec(**spec_d)
    dp = dist.get_world_size()
    cfg = ds_config(spec, stage, dp=dp, bf16=bf16, zero=zero)
    base = PlainGPT(spec, seed=0).to(env.device)
    systems = []
    ours, *_ = engine.initialize(model=base.clone(), config=cfg, dist_env=env)
    systems.append(System("ours", lambda step, ph: ds_style_step(
        ours, make_batches(spec, step, dist.get_rank(), env.device), ph), PhaseTimer(comm, env.device)))
    ds_error = None
    try:
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        # DeepSpeed 0.19 calls torch.distributed's collectives that torch 2.13 deprecates, once
        # per call site and rank: its noise, not the comparison's (our side uses the new names)
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message=r"`torch\.distributed\.\w+` is deprecated")
        m = base.clone()
        ds_eng, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg,
                                          dist_init_required=False)
        systems.append(System("deepspeed", lambda step, ph: ds_style_step(
            ds_eng, make_batches(spec, step, dist.get_rank(), env.device), ph), PhaseTimer(comm, env.device)))
    except Exception as exc:  # noqa: BLE001 - reported as the reason in DeepSpeed's row
        ds_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        traceback.print_exc()
    # every rank must agree on whether DeepSpeed runs
    ok = [None] * dp
    dist.all_gather_object(ok, ds_error)
    errors = [e for e in ok if e is not None]
    if errors:
        systems = systems[:1]
    res = alternate(systems, steps, warmup, comm, env.device)
    res["deepspeed_error"] = errors[0] if errors else None
    res["optimizer_classes"] = {"ours": type(ours.optimizer.optimizer).__name__,
                                "deepspeed": None if errors else type(ds_eng.optimizer).__name__}
    return res
