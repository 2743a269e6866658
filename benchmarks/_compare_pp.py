"""Our 1F1B pipeline against ``torch.distributed.pipelining.Schedule1F1B`` at PP = 2, on the
same stages of the plain GPT (cut by the engine's ``uniform`` partition), the same
micro-batches, global gradient clipping and ``torch.optim.AdamW`` on both sides."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from benchmarks._compare_common import System, alternate
from benchmarks._compare_model import ModelSpec, PlainGPT, cross_entropy, ds_config, make_batches
from benchmarks.common import CommTimer, PhaseTimer

__all__ = ["rank_pp"]


def _clip_and_step(params: list, opt: torch.optim.Optimizer, clip: float) -> None:
    """Global gradient-norm clipping over every stage (sum of squares over the world, which
    is the pipeline here), then the optimizer step."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.stack([g.float().pow(2).sum() for g in grads]).sum()
    dist.all_reduce(sq)
    coef = clip / (sq.sqrt().item() + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    opt.step()
    opt.zero_grad(set_to_none=True)


def rank_pp(spec_d: dict, steps: int, warmup: int, timeout: float, schedule: str = "1f1b") -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import engine
    from engine.distributed.env import init_distributed
    from engine.pipeline.partition import partition_layers

    comm = CommTimer().install()
    env = init_distributed(timeout_s=timeout)
    comm.device = env.device
    spec = ModelSpec(**spec_d)
    rank, world = dist.get_rank(), dist.get_world_size()
    m = spec.grad_accum  # micro-batches per step
    base = PlainGPT(spec, seed=0).to(env.device)
    layers = base.stage_layers()
    bounds = partition_layers([sum(p.numel() for p in l.parameters()) for l in layers], world, "uniform")
    cfg = ds_config(spec, 0, dp=1)
    cfg["pipeline"] = {"stages": world, "partition": "uniform", "schedule": schedule}
    # a pipeline of the caller's layers needs the activation shape (model.seq_len, hidden_size)
    cfg["model"] = {"vocab_size": spec.vocab, "hidden_size": spec.hidden, "num_layers": spec.layers,
                    "num_heads": spec.heads, "seq_len": spec.seq}
    clip = cfg["gradient_clipping"]
    opt_kw = {k: v for k, v in cfg["optimizer"]["params"].items() if k != "torch_adam"}

    # ours: the layer list through engine.initialize (the engine cuts the same stages)
    ours, *_ = engine.initialize(model=copy.deepcopy(layers), config=cfg, dist_env=env, loss_fn=cross_entropy)
    ours.pipeline.executor.record = True
    ours_ph = PhaseTimer(comm, env.device)
    ours_ph.wrap(ours.pipeline, "train", "pipeline")
    ours_ph.wrap(ours.optimizer, "grad_norm_tensor", "optimizer")
    ours_ph.wrap(ours.optimizer, "step", "optimizer")
    bubbles: list[float] = []

    def ours_step(step: int, ph: PhaseTimer) -> float:
        loss = ours.train_batch(iter(make_batches(spec, step, 0, env.device, count=m)))
        recs = ours.pipeline.executor.records
        busy = sum(r.end - r.start for r in recs if r.kind in ("F", "B", "I", "W"))
        bubbles.append(busy)
        return float(loss)

    # PyTorch: the same stage modules (deep copies) under Schedule1F1B
    mine = nn.Sequential(*copy.deepcopy(layers[bounds[rank]:bounds[rank + 1]]))
    stage = PipelineStage(mine, rank, world, env.device)
    sched = Schedule1F1B(stage, n_microbatches=m, loss_fn=cross_entropy)
    opt = torch.optim.AdamW(mine.parameters(), **opt_kw)
    params = list(mine.parameters())

    def torch_step(step: int, ph: PhaseTimer):
        batches = make_batches(spec, step, 0, env.device, count=m)
        ids = torch.cat([b[0] for b in batches])
        tgt = torch.cat([b[1] for b in batches])
        losses: list = []
        with ph.phase("pipeline"):
            if rank == 0:
                sched.step(ids)
            elif rank == world - 1:
                sched.step(target=tgt, losses=losses)
            else:
                sched.step()
        with ph.phase("optimizer"):
            _clip_and_step(params, opt, clip)
        return float(torch.stack([l.detach() for l in losses]).mean()) if losses else None

    systems = [System("ours", ours_step, ours_ph), System("torch", torch_step, PhaseTimer(comm, env.device))]
    res = alternate(systems, steps, warmup, comm, env.device)
    res["ours_compute_s"] = bubbles[warmup * 1:] if bubbles else []
    res["bounds"] = bounds
    return res
