"""ZeRO-3 ``stage3_max_reuse_distance`` (gloo, DP = 2, gradient accumulation 2, tied GPT).

A unit whose next use (in the order recorded in the first step) is near stays gathered
instead of being released and gathered again. Checked after the first (recording) step:

- 0 (our default): two gathers per unit use pair, as before; 1e9 (DeepSpeed's default):
  each unit is gathered once per step (its first use), nothing in backward or in the second
  micro-batch; a distance between the two keeps some units only;
- ``stage3_max_live_parameters`` still bounds what is gathered at once (at most one unit
  over it: a unit being used is gathered whatever the bound);
- the losses are bit-identical for every setting: keeping a gathered unit reuses the same
  values a new gather would bring (parameters change only in the optimizer step, after
  which everything is released).
"""

import pytest
import torch
from harness import run_ranks, watch_gathered_numel

TINY = {"vocab_size": 256, "hidden_size": 64, "num_layers": 3, "num_heads": 4, "seq_len": 16}
GA, STEPS = 2, 3


def _cfg(reuse, live=None):
    z = {"stage": 3, "reduce_bucket_size": 20_000, "stage3_param_persistence_threshold": 1000,
         "stage3_prefetch_bucket_size": 20_000, "stage3_max_reuse_distance": reuse}
    if live is not None:
        z["stage3_max_live_parameters"] = live
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": GA, "train_batch_size": 2 * GA,
            "seed": 3, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": z, "model": TINY}


def _batches(step, rank):
    g = torch.Generator().manual_seed(11 + step)
    ids = torch.randint(0, TINY["vocab_size"], (2 * GA, TINY["seq_len"] + 1), generator=g)[rank * GA:(rank + 1) * GA]
    return [(ids[i:i + 1, :-1], ids[i:i + 1, 1:]) for i in range(GA)]


def _run(rank, reuse, live=None):
    import engine

    eng, *_ = engine.initialize(config=_cfg(reuse, live))
    opt = eng.optimizer
    peak = watch_gathered_numel(opt)
    losses, gathers = [], []
    for s in range(STEPS):
        before = opt.gather_count
        losses.append(eng.train_batch(iter(_batches(s, rank))).item())
        gathers.append(opt.gather_count - before)
    units = {b.index: b.layout.padded_numel for bs in opt._units.values() for b in bs}
    largest_unit = max(sum(b.layout.padded_numel for b in bs) for bs in opt._units.values())
    return {"losses": losses, "gathers": gathers, "buckets": len(units), "peak_live": peak[0],
            "largest_unit": largest_unit, "model": sum(units.values()), "live_after": opt._live_numel}


def _all(rank, world):
    out = {"0": _run(rank, 0), "1e9": _run(rank, 10 ** 9)}
    mid = out["1e9"]["largest_unit"] * 2  # keeps a unit only across at most two units' gathers
    out["mid"] = _run(rank, mid)
    out["bounded"] = _run(rank, 10 ** 9, live=out["1e9"]["largest_unit"] * 2)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, 2, timeout=300)


def test_losses_are_identical_whatever_the_reuse_distance(results):
    for r in results:
        for name in ("1e9", "mid", "bounded"):
            assert r[name]["losses"] == r["0"]["losses"], name


def test_reuse_distance_removes_the_second_gathers(results):
    for r in results:
        zero, full, mid = r["0"]["gathers"], r["1e9"]["gathers"], r["mid"]["gathers"]
        assert zero[0] == full[0] == mid[0]  # the first step records the order: nothing kept
        for s in range(1, STEPS):
            assert full[s] == r["1e9"]["buckets"]  # every bucket gathered once in the step
            assert zero[s] >= 2 * GA * r["0"]["buckets"] - GA  # twice per micro-batch (forward, backward)
            assert full[s] < mid[s] < zero[s]
        assert all(x["live_after"] == 0 for x in r.values())  # all released after each step


def test_max_live_parameters_still_bounds_what_is_kept(results):
    for r in results:
        full, bounded = r["1e9"], r["bounded"]
        assert full["peak_live"] == full["model"]  # DeepSpeed's default keeps the whole model
        limit = 2 * full["largest_unit"]
        assert bounded["peak_live"] <= limit + full["largest_unit"]
        assert full["gathers"][-1] < bounded["gathers"][-1] < r["0"]["gathers"][-1]
