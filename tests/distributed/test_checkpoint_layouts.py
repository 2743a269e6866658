"""Checkpoints across layouts, on the tiny reference GPT (4 layers, tied embedding, vocab
128, hidden 32, seq 16) in fp32 on CPU, with a synthetic global batch that depends only on
the step (tests/distributed/_ckpt_common.py).

1. Exact resume: train 2 steps, save, build a fresh engine, load, train 3 more: the 5
   per-step losses equal the uninterrupted run's BIT FOR BIT, at (dp, tp, pp) = (2,2,2)
   with ZeRO-1 and at DP = 4 with ZeRO-3.
2. Reshaping: the (2,2,2)/ZeRO-1 checkpoint of step 2 loads into (4,1,2)/ZeRO-2,
   (8,1,1)/ZeRO-3, (1,4,2)/ZeRO-1, (1,2,4)/ZeRO-0, (2,2,2)/ZeRO-2 with two virtual stages
   per rank (interleaved 1F1B), (1,2,2)/ZeRO-3, (2,2,1)/ZeRO-2 and (1,1,1)/ZeRO-0; and the
   (8,1,1)/ZeRO-3 one saved from it loads into (1,1,1)/ZeRO-1.
   - State round trip, exact: saving again right after the load gives, parameter by
     parameter, the same fp32 master weights, exp_avg and exp_avg_sq bits, the same
     optimizer step, LR-schedule position and counters (a reshaped load only moves bits).
   - Trajectory: the next 3 losses equal the uninterrupted (2,2,2) run's within rtol
     2e-6 (~20 fp32 ulp of a loss of ~4.8). The state is identical; what differs is the
     order of floating-point sums in the new layout (TP splits matmuls and the softmax
     normaliser, DP/ZeRO sum gradients over other ranks, PP accumulates micro-batches
     elsewhere), measured at <= 1e-7 relative here, as in the project's layout-equivalence
     tests. A misplaced shard, a swapped q/k/v part, a lost moment or a wrong step count
     changes the loss by > 1e-4 at the first step.
3. Consolidation: ``python -m engine.checkpoint.consolidate`` of the (2,2,2) checkpoint gives
   a state dict and a safetensors file that load into the single-process GPT and give
   bit-identical logits to the engine's own gathered weights at that step.
4. Tags that differ across ranks are an error on every rank (tag_validation = Fail).
"""

from __future__ import annotations

import os
import subprocess
import sys

import _ckpt_common as C
import pytest
import torch
from harness import run_ranks, scaled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RTOL = 2e-6
BEFORE, AFTER = 2, 3
STATES = ("master", "exp_avg", "exp_avg_sq")
BASE = dict(dp=2, tp=2, pp=2, zero=1)
EIGHT = {"412_z2": dict(dp=4, pp=2, zero=2), "811_z3": dict(dp=8, zero=3, micro=1),
         "142_z1": dict(tp=4, pp=2, zero=1), "124_z0": dict(tp=2, pp=4, zero=0),
         "222_v2_z2": dict(dp=2, tp=2, zero=2, pipeline={"stages": 2, "partition": "uniform", "virtual_stages": 2,
                                                           "schedule": "interleaved-1f1b"})}
FOUR = {"122_z3": dict(tp=2, pp=2, zero=3), "221_z2": dict(dp=2, tp=2, zero=2)}


def _reload(root: str, src: str, layouts: dict) -> dict:
    """Load ``src`` into each layout, save it again at once (tag ``reloaded``), train on."""
    from engine.checkpoint import load_checkpoint, save_checkpoint

    out = {}
    for name, layout in layouts.items():
        eng = C.build(C.config(**layout))
        path, _ = load_checkpoint(eng, src)
        assert eng.global_steps == BEFORE, eng.global_steps
        save_checkpoint(eng, os.path.join(root, name), tag="reloaded")
        out[name] = C.train(eng, AFTER)
    return out


def _eight(rank, world, root):
    from engine.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    cfg = C.config(**BASE, checkpoint={"tag_validation": "Fail"})
    full = C.train(C.build(cfg), BEFORE + AFTER)
    eng = C.build(cfg)
    first = C.train(eng, BEFORE)
    dense = C.dense_state(eng)
    src = os.path.join(root, "base")
    save_checkpoint(eng, src, client_state={"note": "base", "ids": torch.arange(3)})
    try:
        save_checkpoint(eng, os.path.join(root, "bad"), tag=f"rank{rank}")
        tag_error = None
    except CheckpointError as exc:
        tag_error = str(exc)
    resumed_eng = C.build(cfg)
    path, client = load_checkpoint(resumed_eng, src)
    resumed = C.train(resumed_eng, AFTER)
    return dict(full=full, first=first, resumed=resumed, path=path, client=client, dense=dense,
                tag_error=tag_error, reshaped=_reload(root, src, EIGHT))


def _four(rank, world, root):
    from engine.checkpoint import load_checkpoint, save_checkpoint

    cfg = C.config(dp=4, zero=3, micro=1)
    full = C.train(C.build(cfg), BEFORE + AFTER)
    eng = C.build(cfg)
    first = C.train(eng, BEFORE)
    save_checkpoint(eng, os.path.join(root, "dp4_z3"))
    again = C.build(cfg)
    load_checkpoint(again, os.path.join(root, "dp4_z3"))
    return dict(full=full, first=first, resumed=C.train(again, AFTER),
                reshaped=_reload(root, os.path.join(root, "base"), FOUR))


def _one(rank, world, root):
    out = _reload(root, os.path.join(root, "base"), {"111_z0": dict(zero=0)})
    # and from the (8,1,1)/ZeRO-3 checkpoint that was itself loaded from the (2,2,2) one
    out.update(_reload(root, os.path.join(root, "811_z3"), {"111_z1_from_811": dict(zero=1)}))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt_layouts"))
    eight = run_ranks(_eight, 8, root, timeout=400)
    four = run_ranks(_four, 4, root, timeout=300)
    one = run_ranks(_one, 1, root, timeout=200)[0]
    return root, eight, four, one


def _full_states(path):
    from engine.checkpoint import iter_full_params

    return {name: states for name, _, states in iter_full_params(path, STATES)}


def _assert_same_state(ref_dir, got_dir):
    from engine.checkpoint import read_metadata

    ref, got = _full_states(ref_dir), _full_states(got_dir)
    assert list(got) == list(ref)
    for name in ref:
        for s in STATES:
            assert torch.equal(got[name][s], ref[name][s]), f"{got_dir}: {name} {s}"
    m_ref, m_got = read_metadata(ref_dir), read_metadata(got_dir)
    assert m_got["counters"] == m_ref["counters"]
    assert m_got["optimizer"]["scalar_state"] == m_ref["optimizer"]["scalar_state"]  # AdamW's step
    for k in ("last_epoch", "_step_count"):
        assert m_got["lr_scheduler"][k] == m_ref["lr_scheduler"][k], k
    # per inner-optimizer-group lists: one entry per flat group, whose number depends on the layout
    for k in ("_last_lr", "base_lrs"):
        per_pg = [dict(zip(m["lr_scheduler_groups"], m["lr_scheduler"][k])) for m in (m_got, m_ref)]
        assert per_pg[0] == per_pg[1], k
    assert m_got["loss_scaler"] == m_ref["loss_scaler"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_exact_resume_is_bitwise(runs):
    root, eight, four, _ = runs
    for per_rank in (eight, four):
        for r in per_rank:  # every rank reports the global-batch loss
            assert r["first"] == r["full"][:BEFORE]
            assert r["resumed"] == r["full"][BEFORE:], (r["resumed"], r["full"])
    base = eight[0]
    assert base["full"][-1] < base["full"][0] - 0.02, f"the model did not learn: {base['full']}"
    assert base["path"] == os.path.join(root, "base", f"global_step{BEFORE}")
    assert base["client"]["note"] == "base" and torch.equal(base["client"]["ids"], torch.arange(3))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_reshaped_loads_keep_the_state_and_the_trajectory(runs):
    root, eight, four, one = runs
    src = os.path.join(root, "base", f"global_step{BEFORE}")
    ref = eight[0]["full"][BEFORE:]
    reshaped = {**eight[0]["reshaped"], **four[0]["reshaped"], **one}
    assert len(reshaped) == len(EIGHT) + len(FOUR) + 2
    for name, losses in reshaped.items():
        _assert_same_state(src, os.path.join(root, name, "reloaded"))
        assert losses == pytest.approx(ref, rel=RTOL), f"{name}: {losses} vs {ref}"
        assert losses != pytest.approx(eight[0]["full"][:AFTER], rel=1e-4)  # it did not restart from step 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tags_that_differ_across_ranks_are_an_error_everywhere(runs):
    root, eight, _, _ = runs
    for rank, r in enumerate(eight):
        assert r["tag_error"] is not None and "differs across ranks" in r["tag_error"], rank
        assert "rank1" in r["tag_error"]
    assert not os.path.exists(os.path.join(root, "bad"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_consolidated_model_reproduces_the_logits(runs, tmp_path):
    from safetensors.torch import load_model

    from engine.checkpoint import read_metadata
    from engine.models import GPT, ModelConfig

    root, eight, _, _ = runs
    src = os.path.join(root, "base")
    out = tmp_path / "consolidated"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "engine.checkpoint.consolidate", src, str(out)],
                          env=env, capture_output=True, text=True, timeout=scaled(120))
    assert proc.returncode == 0, proc.stderr
    cfg = ModelConfig.from_dict(read_metadata(os.path.join(src, f"global_step{BEFORE}"))["config"]["model"])
    ids = C.global_batch(100)[0]
    reference = GPT(cfg, seed=0)
    reference.load_state_dict(eight[0]["dense"], strict=True)  # the engine's own weights at step 2
    from_torch, from_st = GPT(cfg, seed=1), GPT(cfg, seed=2)
    from_torch.load_state_dict(torch.load(out / "pytorch_model_fp32.pt", weights_only=True), strict=True)
    missing, unexpected = load_model(from_st, str(out / "model.safetensors"))
    assert not missing and not unexpected
    with torch.no_grad():
        want = reference(ids)
        assert torch.equal(from_torch(ids), want)
        assert torch.equal(from_st(ids), want)
        assert not torch.equal(GPT(cfg, seed=C.config()["seed"])(ids), want)  # trained weights, not init
