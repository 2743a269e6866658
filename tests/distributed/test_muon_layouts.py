"""Muon on the reference GPT at every layout of the issue, against one process, and its
checkpoints (one spawn per world size serves both, to keep the suite short).

A. Layouts.
(dp, tp, pp) in {(2,1,1), (4,1,1), (1,2,1), (1,1,2), (2,2,2)} x ZeRO 0-3 x gradient
accumulation 1 and 4 (same global batch of 16), 3 steps each (the default suite runs half of
these 40: each layout at every stage and both accumulations, each (stage, accumulation) pair
at some layout; the other half is marked extended), built through
``engine.initialize`` from a DeepSpeed-format config (what launch/train.py does; a subset
also runs through launch/train.py itself in test_muon_train_entry.py). The model has tied
embeddings (AdamW, summed across pipeline stages) and fused q/k/v and gate/up weights
(orthogonalised as their parts, TP-sliced under TP).

Checked: per-step losses equal the single-process run's within 1e-5 relative with fp32
Newton-Schulz, and within 1e-3 with bf16 Newton-Schulz (torch's default) for one layout
per world size; Newton-Schulz ran exactly once per Muon matrix (or fused part) per step
summed over the whole job (14 per step: 2 blocks x q, k, v, proj, gate, up, down).

Tolerance: fp32 losses differ only by the order of floating-point sums (TP splits matmuls,
DP/ZeRO sum gradients elsewhere, PP accumulates micro-batches elsewhere): observed
~1e-7 relative; 1e-5 is the issue's bound. bf16 Newton-Schulz rounds the orthogonalised
update to 8 bits of mantissa, so a different summation order can flip a rounding: 1e-3.
(Observed: the fp32 and bf16 references themselves differ by only 6e-6 relative after 3
steps of this tiny model, so 1e-5 does not tell the two Newton-Schulz precisions apart; what
it does catch is an orthogonalisation of the wrong matrix: Newton-Schulz of a TP slice or a
ZeRO shard is O(1) away from the slice of the whole matrix's (tests/unit/test_muon.py), and
so is a missing one, which moves the second loss by O(lr) ~ 1e-3 relative.)

B. Checkpoints, fp32 Newton-Schulz.
1. Exact resume at (2,2,2)/ZeRO-1 (GA 2): train 2 steps, save, fresh engine, load, train 3:
   the losses equal the uninterrupted run's bit for bit.
2. Reshape chain (2,2,2)/ZeRO-1 -> (4,1,1)/ZeRO-3 -> (1,1,1)/ZeRO-0: each load is saved
   again at once and its state compared parameter by parameter with the source: the same
   fp32 master, ``momentum_buffer`` (Muon matrices) and ``exp_avg`` / ``exp_avg_sq`` / step
   (AdamW parameters) bits; then the next 3 losses equal the uninterrupted run's within
   rtol 1e-5 (the state is identical; only the order of sums changes with the layout,
   ~1e-7). A lost or misplaced momentum changes the next loss by ~1e-3.
"""

from __future__ import annotations

import os

import _muon_common as M
import pytest
import torch
from harness import run_ranks

STEPS, RTOL, RTOL_BF16 = 3, 1e-5, 1e-3
BEFORE, AFTER = 2, 3
MUON_STATES = ("master", "momentum_buffer", "exp_avg", "exp_avg_sq")
LAYOUTS = {2: [(2, 1, 1), (1, 2, 1), (1, 1, 2)], 4: [(4, 1, 1)], 8: [(2, 2, 2)]}
BF16 = {2: (2, 1, 1, 1, 4), 4: (4, 1, 1, 3, 1), 8: (2, 2, 2, 2, 4)}  # dp, tp, pp, zero, ga


def _cases(part: str) -> list[tuple[int, int, int, int, int]]:
    """(dp, tp, pp, zero, ga) of one part of the matrix: "default" gives every layout each ZeRO
    stage once and both accumulations (alternating which stage gets which, so that every
    (stage, accumulation) pair still runs at some layout); "rest" (extended) the other half."""
    out = []
    for i, (dp, tp, pp) in enumerate(lay for world in sorted(LAYOUTS) for lay in LAYOUTS[world]):
        for zero in (0, 1, 2, 3):
            for ga in (1, 4):
                if ((zero + (ga == 4) + i) % 2 == 0) == (part == "default"):
                    out.append((dp, tp, pp, zero, ga))
    return out


def _worker(rank, world, root, part="default"):
    out = {("ckpt", world): _checkpoint_part(world, root) if part == "default" else None}
    for dp, tp, pp, zero, ga in _cases(part):
        if dp * tp * pp == world:
            out[(dp, tp, pp, zero, ga, "float32")] = M.run(M.config(dp, tp, pp, zero, ga), STEPS)
    if part == "rest":
        if world == 1:
            out[(1, 1, 1, 0, 1, "float32")] = M.run(M.config(), STEPS)
        return out
    if world in BF16:
        dp, tp, pp, zero, ga = BF16[world]
        out[(dp, tp, pp, zero, ga, "bfloat16")] = M.run(M.config(dp, tp, pp, zero, ga, "bfloat16"), STEPS)
    if world == 1:
        for ns in ("float32", "bfloat16"):
            out[(1, 1, 1, 0, 1, ns)] = M.run(M.config(ns_dtype=ns), STEPS)
    return out


def _checkpoint_part(world, root):
    from engine.checkpoint import load_checkpoint, save_checkpoint

    if world == 8:
        cfg = M.config(2, 2, 2, zero=1, ga=2)
        full = M.train(M.build(cfg), BEFORE + AFTER)
        eng = M.build(cfg)
        first = M.train(eng, BEFORE)
        save_checkpoint(eng, os.path.join(root, "base"))
        again = M.build(cfg)
        load_checkpoint(again, os.path.join(root, "base"))
        return dict(full=full, first=first, resumed=M.train(again, AFTER))
    if world == 4:
        return _reload(os.path.join(root, "base"), os.path.join(root, "411_z3"), M.config(4, 1, 1, zero=3))
    if world == 1:
        return _reload(os.path.join(root, "411_z3"), os.path.join(root, "111_z0"), M.config(zero=0))
    return None


def _reload(src: str, dst: str, cfg: dict) -> list[float]:
    from engine.checkpoint import load_checkpoint, save_checkpoint

    eng = M.build(cfg)
    load_checkpoint(eng, src)
    assert eng.global_steps == BEFORE
    save_checkpoint(eng, dst, tag="reloaded")
    return M.train(eng, AFTER)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("muon"))
    out = {"root": root}
    for world in (8, 4, 2, 1):  # the checkpoint chain: saved at 8, reshaped at 4, then at 1
        per_rank = run_ranks(_worker, world, root, timeout=400)
        out.update(per_rank[0])
        out[("ckpt_all", world)] = [r[("ckpt", world)] for r in per_rank]
    return out


def _check_layouts(runs, part):
    refs = {ns: runs[(1, 1, 1, 0, 1, ns)][0] for ns in ("float32", "bfloat16") if (1, 1, 1, 0, 1, ns) in runs}
    assert refs["float32"][-1] < refs["float32"][0] - 0.05, f"the model did not learn: {refs['float32']}"
    assert set(_cases(part)) <= {k[:5] for k in runs}
    for key, value in runs.items():
        if key == "root" or key[0] in ("ckpt", "ckpt_all"):
            continue
        (losses, calls), ns = value, key[-1]
        rtol = RTOL if ns == "float32" else RTOL_BF16
        assert losses == pytest.approx(refs[ns], rel=rtol), f"{key}: {losses} vs {refs[ns]}"
        assert calls == M.MATRICES_PER_STEP * STEPS, f"{key}: {calls} Newton-Schulz calls"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_layout_matches_one_process(runs):
    """Half of the (layout, ZeRO stage, accumulation) matrix: every layout at every stage and
    both accumulations, every (stage, accumulation) pair at some layout; the other half is
    test_the_rest_of_the_matrix_matches_one_process (extended)."""
    both = set(_cases("default")) | set(_cases("rest"))
    assert len(both) == 40 and not set(_cases("default")) & set(_cases("rest"))
    for dp, tp, pp in (lay for layouts in LAYOUTS.values() for lay in layouts):
        mine = [(z, ga) for d, t, p, z, ga in _cases("default") if (d, t, p) == (dp, tp, pp)]
        assert {z for z, _ in mine} == {0, 1, 2, 3} and {ga for _, ga in mine} == {1, 4}, (dp, tp, pp, mine)
    assert {c[3:] for c in _cases("default")} == {(z, ga) for z in range(4) for ga in (1, 4)}
    _check_layouts(runs, "default")


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_rest_of_the_matrix_matches_one_process(tmp_path):
    runs = {}
    for world in (8, 4, 2, 1):
        runs.update(run_ranks(_worker, world, str(tmp_path), "rest", timeout=400)[0])
    _check_layouts(runs, "rest")


def _states(path: str) -> dict:
    from engine.checkpoint import iter_full_params

    return {name: st for name, _, st in iter_full_params(path, MUON_STATES)}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_muon_resume_is_bitwise_and_reshapes_keep_the_state(runs):
    from engine.checkpoint import read_metadata

    root = runs["root"]
    for r in runs[("ckpt_all", 8)]:
        assert r["first"] == r["full"][:BEFORE]
        assert r["resumed"] == r["full"][BEFORE:], (r["resumed"], r["full"])
    ref = runs[("ckpt", 8)]["full"][BEFORE:]
    assert runs[("ckpt", 4)] == pytest.approx(ref, rel=RTOL), (runs[("ckpt", 4)], ref)
    assert runs[("ckpt", 1)] == pytest.approx(ref, rel=RTOL), (runs[("ckpt", 1)], ref)
    base_dir = os.path.join(root, "base", f"global_step{BEFORE}")
    src = _states(base_dir)
    kinds = {name: tuple(sorted(st)) for name, st in src.items()}
    assert kinds["layers.1.attn.qkv.weight"] == ("master", "momentum_buffer")
    assert kinds["layers.0.weight"] == ("exp_avg", "exp_avg_sq", "master")  # tied embedding: AdamW
    assert any(st["momentum_buffer"].abs().max() > 0 for st in src.values() if "momentum_buffer" in st)
    base = read_metadata(base_dir)
    for layout in ("411_z3", "111_z0"):
        got = _states(os.path.join(root, layout, "reloaded"))
        assert list(got) == list(src)
        for name, st in src.items():
            assert sorted(got[name]) == sorted(st), (layout, name)
            for k, v in st.items():
                assert torch.equal(got[name][k], v), f"{layout}: {name} {k}"
        meta = read_metadata(os.path.join(root, layout, "reloaded"))
        assert meta["optimizer"]["scalar_state"] == base["optimizer"]["scalar_state"]  # AdamW's step
        assert meta["optimizer"]["param_groups"] == base["optimizer"]["param_groups"]
