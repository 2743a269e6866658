"""FP8 scaling state in checkpoints (tiny reference GPT, bf16 + FP8 delayed scaling with an
amax history of 4, CPU: quantize-dequantize emulation of the FP8 GEMMs).

1. Exact resume at TP = 2: train 2 steps, save, build a fresh engine, load, train 3 more:
   the 5 per-step losses equal the uninterrupted run's BIT FOR BIT, and so does every
   scale and amax history of every FP8 layer at the end.
2. The test can fail: the same checkpoint with its FP8 state removed and its format
   version set back to 1 (what an old checkpoint is) still loads (old checkpoints stay
   readable; the layers keep fresh scales, a warning says so), and its resumed losses
   then DIFFER from the uninterrupted run's (the first resumed step quantizes with scale
   1 instead of the learned scales).
3. Reshape: the TP = 2 checkpoint loads at PP = 2 (each stage its layers, named
   ``layers.{i}.…`` whatever stage holds them): every FP8 layer's scales and histories
   equal the saved ones exactly (amaxes are MAX-reduced over TP x DP, so they do not
   depend on the layout).
"""

from __future__ import annotations

import json
import os

import _ckpt_common as C
import pytest
from harness import run_ranks

BEFORE, AFTER = 2, 3
FP8 = {"enabled": True, "recipe": "delayed", "amax_history_len": 4}


def _cfg(**layout):
    return C.config(**layout, layers=2, bf16={"enabled": True}, fp8=FP8)


def _fp8(eng):
    return eng.training_state().state_dict()["fp8"]


def _as_v1(src: str, dst: str) -> None:
    """Copy checkpoint ``src`` to ``dst`` as a format-version-1 checkpoint (no FP8 state)."""
    import shutil

    from engine.checkpoint.format import read_latest, read_metadata, write_metadata

    shutil.copytree(src, dst)
    tag = read_latest(dst)
    meta = read_metadata(os.path.join(dst, tag))
    meta.pop("fp8")
    meta.pop("checksum")
    meta["format_version"] = 1
    write_metadata(os.path.join(dst, tag), meta)


def _two(rank, world, root):
    import torch.distributed as dist

    from engine.checkpoint import load_checkpoint, save_checkpoint

    cfg = _cfg(tp=2)
    ref = C.build(cfg)
    full = C.train(ref, BEFORE + AFTER)
    eng = C.build(cfg)
    C.train(eng, BEFORE)
    saved_fp8 = _fp8(eng)
    src = os.path.join(root, "tp2")
    save_checkpoint(eng, src)
    resumed_eng = C.build(cfg)
    load_checkpoint(resumed_eng, src)
    resumed = C.train(resumed_eng, AFTER)
    old = os.path.join(root, "v1")
    if rank == 0:
        _as_v1(src, old)
    dist.barrier()
    old_eng = C.build(cfg)
    load_checkpoint(old_eng, old)
    fresh_after_old = _fp8(old_eng)
    old_resumed = C.train(old_eng, AFTER)
    pp_eng = C.build(_cfg(pp=2))
    load_checkpoint(pp_eng, src)
    return dict(full=full, resumed=resumed, end_ref=_fp8(ref), end_resumed=_fp8(resumed_eng), saved=saved_fp8,
                old_resumed=old_resumed, fresh_after_old=fresh_after_old, pp_loaded=_fp8(pp_eng))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt_fp8"))
    return root, run_ranks(_two, 2, root, timeout=300)


def test_fp8_resume_is_bitwise(runs):
    _, out = runs
    for r in out:
        assert r["resumed"] == r["full"][BEFORE:], (r["resumed"], r["full"])
        assert r["end_resumed"] == r["end_ref"]                   # every scale and history, exactly
        assert r["saved"] and all(st["weight"]["scale"] != 1.0 for st in r["saved"].values())


def test_an_old_checkpoint_without_fp8_state_loads_and_differs(runs):
    root, out = runs
    with open(os.path.join(root, "v1", "global_step2", "metadata.json")) as f:
        assert json.load(f)["format_version"] == 1
    for r in out:
        assert all(st["weight"]["scale"] == 1.0 for st in r["fresh_after_old"].values())  # fresh state kept
        assert r["old_resumed"] != r["full"][BEFORE:]                                     # so the run differs


def test_fp8_state_reshapes_by_layer_name(runs):
    _, out = runs
    saved = out[0]["saved"]
    names = set()
    for r in out:   # PP = 2: each stage holds its own layers' state, equal to the saved one
        assert r["pp_loaded"], "a pipeline stage has no FP8 layer"
        for name, st in r["pp_loaded"].items():
            assert st == saved[name], name
        names |= set(r["pp_loaded"])
    assert names == set(saved)
