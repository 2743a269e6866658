"""The reference GPT with ``model.moe`` trained through the engine's loop (what launch/train.py
runs: engine.initialize + engine.training.trainer.train), fp32, 4 steps.

1. Gradient accumulation: the same global batch of 8 sequences as 1 micro-batch of 8 and as
   4 of 2 gives the same per-step losses, gradient norms and ``moe_aux_loss``: the balancing
   loss is a mean over sequences, injected with the loss's 1/ga (engine.moe.balancing), so
   its gradient does not depend on how the batch is cut.
2. Layouts (2 ranks, EP 1): DP 2 (ZeRO 1 and 3), TP 2 (with sequence parallelism), PP 2
   (with activation checkpointing), CP 2 and aux-free balancing at DP 2 give the one-process
   per-step losses, gradient norms, ``moe_aux_loss`` and ``moe_load_imbalance``.
3. launch/train.py in one process: every metrics.jsonl row carries ``moe_aux_loss``,
   ``moe_load_imbalance`` and (capacity set) ``moe_dropped_tokens``.
4. A router collapsed onto one expert (top-1, every token forced to expert 0 by the aux-free
   bias) shows ``moe_load_imbalance == num_experts``.

Tolerances: losses rtol 1e-5 (measured: identical or ~1e-7); gradient norms rtol 5e-6
(measured up to 1.5e-6 at PP 2 while the norm used torch's fp32 vector_norm, whose error
grew with the flat buffers' length; engine.zero.norm now sums squares accurately, and the
trajectory checks of test_ep_entry.py measure at most 2.1e-6 along 20 steps);
``moe_aux_loss`` rtol 1e-6 (measured ~1e-7); the imbalance is a ratio of integer counts:
exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from harness import run_ranks, scaled
from test_train_entry import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 4


def moe_config(cache_dir: str, moe: dict | None = None, micro: int = 2, cp: int = 1, **kw) -> dict:
    c = tiny_config(cache_dir, **kw)
    c["model"]["moe"] = {"num_experts": 4, "top_k": 2, "expert_hidden_size": 16, "aux_loss_coef": 0.1,
                         "z_loss_coef": 1e-3, **(moe or {})}
    c["train_micro_batch_size_per_gpu"] = micro
    if cp > 1:
        c["context_parallel"] = {"size": cp}
    return c


def _records(rank, world, configs, steps=STEPS):
    """Per config, the step records' loss, grad norm and moe_* fields. A config with
    ``"_collapse": true`` gets its routing forced onto expert 0 (aux-free bias) after initialize."""
    import torch

    import engine
    from engine.config import load_config
    from engine.moe.stats import moe_layers
    from engine.training.trainer import build_data, train

    out = []
    for c in configs:
        c = dict(c)
        collapse = c.pop("_collapse", False)
        cfg = load_config(c, world_size=world)
        _, sampler = build_data(cfg)
        eng, *_ = engine.initialize(config=cfg)
        if collapse:  # every token's first choice is expert 0
            for layer in moe_layers(eng.module):
                with torch.no_grad():
                    layer.expert_bias[0] = 100.0
        out.append([{k: v for k, v in r.items() if k == "loss" or k == "grad_norm" or k.startswith("moe_")}
                    for r in train(eng, sampler, steps, output_dir=None)])
        eng.destroy()
    return out


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    from engine.config import load_config
    from engine.training.trainer import build_data

    d = str(tmp_path_factory.mktemp("moe_cache"))
    build_data(load_config(tiny_config(d), world_size=1))
    return d


@pytest.fixture(scope="module")
def reference(cache_dir):
    """One process: GA 4 (micro 2) and GA 1 (micro 8), aux-free balancing at GA 4, and a
    collapsed top-1 router."""
    collapsed = {**moe_config(cache_dir, moe={"top_k": 1, "load_balancing": "aux_free"}), "_collapse": True}
    runs = run_ranks(_records, 1, [moe_config(cache_dir), moe_config(cache_dir, micro=8),
                                   moe_config(cache_dir, moe={"load_balancing": "aux_free"}), collapsed],
                     timeout=240)[0]
    return {"ga4": runs[0], "ga1": runs[1], "aux_free": runs[2], "collapsed": runs[3]}


def _same(got, want, what):
    assert len(got) == len(want) == STEPS
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), f"{what}: loss {g} vs {w}"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=5e-6), f"{what}: grad norm {g} vs {w}"
        assert g["moe_aux_loss"] == pytest.approx(w["moe_aux_loss"], rel=1e-6), f"{what}: aux {g} vs {w}"
        assert g["moe_load_imbalance"] == w["moe_load_imbalance"], f"{what}: imbalance {g} vs {w}"


def test_gradient_accumulation_does_not_change_the_balancing_loss(reference):
    _same(reference["ga1"], reference["ga4"], "GA 1 vs GA 4")
    first = reference["ga4"][0]
    # 2 MoE layers, sequence-wise aux ~1 per layer at init times 0.1, plus the z-loss
    assert 0.15 < first["moe_aux_loss"] < 0.3 and first["moe_load_imbalance"] >= 1.0


@pytest.mark.extended
@pytest.mark.timeout(600)
def test_layouts_train_the_one_process_losses(cache_dir, reference):
    layouts = [dict(dp=2, zero=1), dict(dp=2, zero=3), dict(tp=2, sp=True), dict(pp=2, ckpt=1), dict(cp=2),
               dict(dp=2, zero=1, moe={"load_balancing": "aux_free"})]
    runs = run_ranks(_records, 2, [moe_config(cache_dir, micro=2 if "dp" not in k else 1, **k) for k in layouts],
                     timeout=560)
    for k, got in zip(layouts, runs[0]):
        want = reference["aux_free" if "moe" in k else "ga4"]
        _same(got, want, str(k))
    assert runs[0] == runs[1], "every rank reports the same step records"


def test_cp2_trains_the_one_process_losses(cache_dir, reference):
    """The representative layout of the default suite: CP splits each sequence (counts combined)."""
    got = run_ranks(_records, 2, [moe_config(cache_dir, cp=2)], timeout=240)[0][0]
    _same(got, reference["ga4"], "cp 2")


def test_a_collapsed_router_shows_in_the_metrics(reference):
    # every assignment on one of 4 experts: max/mean = 4 (the aux-free bias moves 1e-3 a step:
    # still collapsed after 4 steps); a healthy router stays far below
    assert [r["moe_load_imbalance"] for r in reference["collapsed"]] == [4.0] * STEPS
    assert max(r["moe_load_imbalance"] for r in reference["ga4"]) < 2.0


def test_launch_train_writes_moe_metrics(cache_dir, tmp_path):
    cfg = moe_config(cache_dir, moe={"capacity_factor": 1.0})
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)  # the script finds the engine of its checkout by itself
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), "--config", str(path),
                           "--steps", "3", "--output", str(tmp_path / "out"), "--sample-tokens", "2"],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=scaled(240))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert len(rows) == 3
    for r in rows:
        assert r["loss"] == r["loss"] and 0 < r["moe_aux_loss"] < 1 and r["moe_load_imbalance"] >= 1
        assert r["moe_dropped_tokens"] >= 0
    assert any(r["moe_dropped_tokens"] > 0 for r in rows), "capacity_factor 1.0 drops assignments"
