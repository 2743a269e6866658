"""Our ZeRO-3 (DeepSpeed loop through engine.initialize) against PyTorch's FSDP2
(``fully_shard`` on every block and the root) at DP = world, on the same plain GPT, data,
clipping and ``torch.optim.AdamW``. FSDP2 accumulates over micro-batches without
reduce-scattering until the last one (``set_requires_gradient_sync``), as our engine does."""

from __future__ import annotations

from typing import Any

import torch

from benchmarks._compare_common import System, alternate, ds_style_step
from benchmarks._compare_model import ModelSpec, PlainGPT, ds_config, make_batches
from benchmarks.common import CommTimer, PhaseTimer

__all__ = ["rank_fsdp"]


def rank_fsdp(spec_d: dict, steps: int, warmup: int, timeout: float, stage: int = 3) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import engine
    from engine.distributed.env import init_distributed

    comm = CommTimer().install()
    env = init_distributed(timeout_s=timeout)
    comm.device = env.device
    spec = ModelSpec(**spec_d)
    rank, world = dist.get_rank(), dist.get_world_size()
    # FSDP2 reshards after forward by default (gathers again in backward): reuse distance 0
    cfg = ds_config(spec, stage, dp=world, zero={"stage3_max_reuse_distance": 0})
    clip = cfg["gradient_clipping"]
    opt_kw = {k: v for k, v in cfg["optimizer"]["params"].items() if k != "torch_adam"}
    base = PlainGPT(spec, seed=0).to(env.device)

    ours, *_ = engine.initialize(model=base.clone(), config=cfg, dist_env=env)

    def ours_step(step: int, ph: PhaseTimer) -> float:
        return ds_style_step(ours, make_batches(spec, step, rank, env.device), ph)

    model = base.clone()
    mesh = init_device_mesh(env.device.type, (world,))
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), **opt_kw)

    def fsdp_step(step: int, ph: PhaseTimer) -> float:
        batches = make_batches(spec, step, rank, env.device)
        losses = []
        for i, (ids, tgt) in enumerate(batches):
            last = i == len(batches) - 1
            model.set_requires_gradient_sync(last)
            with ph.phase("forward"):
                loss = model(ids, tgt)
            with ph.phase("backward"):
                (loss / len(batches)).backward()
            losses.append(float(loss.detach()))
        with ph.phase("optimizer"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return sum(losses) / len(losses)

    systems = [System("ours", ours_step, PhaseTimer(comm, env.device)),
               System("fsdp2", fsdp_step, PhaseTimer(comm, env.device))]
    return alternate(systems, steps, warmup, comm, env.device)
