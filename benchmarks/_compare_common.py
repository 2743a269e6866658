"""The alternating two-system runner of benchmarks/compare.py.

Both systems live in the same processes, train the same model copy on the same data, and
take turns step by step (ABBA order: the system that goes first alternates, so neither
always runs on a warmer cache). Every step starts with a barrier; its time is the slowest
rank's. Per step we keep the wall time, the loss (mean over micro-batches; the parent
averages the ranks) and the time split from a :class:`~benchmarks.common.PhaseTimer`.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from benchmarks.common import CommTimer, PhaseTimer, sync

__all__ = ["System", "alternate", "summarize_pair", "ds_style_step"]

StepFn = Callable[[int, PhaseTimer], float]  # (step, phases) -> this rank's loss


class System:
    """A named training step ``step_fn(step, phases) -> local loss (or None)``; ``phases``
    is this system's own :class:`PhaseTimer`, reset before every step (so wrappers
    installed once with ``phases.wrap`` keep timing into it)."""

    def __init__(self, name: str, step_fn: StepFn, phases: PhaseTimer) -> None:
        self.name, self.step_fn, self.phases = name, step_fn, phases


def ds_style_step(eng: Any, batches: list, phases: PhaseTimer) -> float:
    """DeepSpeed's loop (``loss = eng(x, y); eng.backward(loss); eng.step()`` per
    micro-batch), the same calls for deepspeed.initialize's engine and ours."""
    losses = []
    for ids, tgt in batches:
        with phases.phase("forward"):
            loss = eng(ids, tgt)
        with phases.phase("backward"):
            eng.backward(loss)
        with phases.phase("optimizer"):
            eng.step()
        losses.append(float(loss.detach().float()))
    return sum(losses) / len(losses)


def alternate(systems: list[System], steps: int, warmup: int, comm: CommTimer,
              device: Optional[torch.device] = None) -> dict[str, dict[str, Any]]:
    """Run ``warmup + steps`` steps of each system, alternating; returns per system the
    lists ``time`` (s, slowest rank), ``loss`` (this rank; None where a rank has none),
    ``comm`` / ``p2p`` (exposed collective / point-to-point time, s) and ``phases``
    (phase name -> compute seconds per step, collectives inside subtracted)."""
    out: dict[str, dict[str, Any]] = {s.name: {"time": [], "loss": [], "comm": [], "p2p": [], "phases": {}}
                                      for s in systems}
    for step in range(warmup + steps):
        order = systems if step % 2 == 0 else systems[::-1]
        for s in order:
            s.phases.reset()
            c0, p0 = comm.by_kind["collective"], comm.by_kind["p2p"]
            dist.barrier()
            sync(device)
            t0 = time.perf_counter()
            loss = s.step_fn(step, s.phases)
            sync(device)
            dt = time.perf_counter() - t0
            if step < warmup:
                continue
            rec = out[s.name]
            rec["time"].append(dt)
            rec["loss"].append(loss)
            for k in s.phases.seconds:
                rec["phases"].setdefault(k, []).append(s.phases.compute(k))
            rec["comm"].append(comm.by_kind["collective"] - c0)
            rec["p2p"].append(comm.by_kind["p2p"] - p0)
    # the step time is the slowest rank's
    for s in systems:
        t = torch.tensor(out[s.name]["time"], dtype=torch.float64, device=device)  # NCCL: on the GPU
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[s.name]["time"] = t.tolist()
    return out


def summarize_pair(per_rank: list[dict], ours: str, theirs: str, tokens_per_step: int) -> dict[str, Any]:
    """Medians, the ratio of throughputs (ours / theirs; > 1: we are faster), the median of
    the per-step paired ratios, and the largest per-step loss difference (losses averaged
    over the ranks that report one)."""
    def losses(name: str) -> list[float]:
        cols = [r[name]["loss"] for r in per_rank if r[name]["loss"] and r[name]["loss"][0] is not None]
        if not cols:
            return []
        return [sum(c[i] for c in cols) / len(cols) for i in range(len(cols[0]))]

    a, b = per_rank[0][ours], per_rank[0][theirs]
    ta, tb = statistics.median(a["time"]), statistics.median(b["time"])
    la, lb = losses(ours), losses(theirs)
    diffs = [abs(x - y) for x, y in zip(la, lb)]

    def split(name: str) -> dict[str, float]:
        """Median over ranks of each rank's median per step, in ms."""
        series = {k: [r[name]["phases"][k] for r in per_rank] for k in per_rank[0][name]["phases"]}
        series["comm"] = [r[name]["comm"] for r in per_rank]
        series["p2p"] = [r[name]["p2p"] for r in per_rank]
        return {k: 1e3 * statistics.median([statistics.median(x) for x in v]) for k, v in series.items()}

    return {
        ours: {"step_ms": 1e3 * ta, "tokens_per_s": tokens_per_step / ta, "split_ms": split(ours),
               "step_ms_all": [1e3 * x for x in a["time"]], "loss": la},
        theirs: {"step_ms": 1e3 * tb, "tokens_per_s": tokens_per_step / tb, "split_ms": split(theirs),
                 "step_ms_all": [1e3 * x for x in b["time"]], "loss": lb},
        "ratio": tb / ta,
        "paired_ratio_median": statistics.median([y / x for x, y in zip(a["time"], b["time"])]),
        "max_loss_diff": max(diffs) if diffs else None,
        "max_rel_loss_diff": max(d / abs(y) for d, y in zip(diffs, lb)) if diffs else None,
        "steps": len(a["time"]),
    }
