"""Checkpoints written before load after: tests/assets/ckpt_golden/ was saved at step 2 by the
engine at commit 8869245 (before the renames, the role groups, the typed placement and the
token-mean loss; tests/assets/make_ckpt_golden.py, which also recorded the uninterrupted
steps 3 and 4). Today's engine loads it on 2 ranks and trains on.

Same layout (dp 2, ZeRO-1): the losses of steps 3 and 4 equal the old engine's bit for bit
(the arithmetic did not change; tolerance 0). Another layout (tp 2, ZeRO-2): 1e-5 relative
(TP sums the same terms in another order).
"""

import json
import os
import shutil
import sys

from harness import run_ranks

ASSET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "assets", "ckpt_golden")
sys.path.insert(0, os.path.join(ASSET, ".."))


def _resume(rank, world, src):
    import _ckpt_common as C
    from make_ckpt_golden import golden_config

    from engine.checkpoint import load_checkpoint

    out = {}
    for name, layout in {"same": {}, "tp2_z2": {"dp": 1, "tp": 2, "zero": 2}}.items():
        cfg = golden_config()
        if layout:
            cfg = C.config(layers=2, model=cfg["model"], **layout)
        eng = C.build(cfg)
        load_checkpoint(eng, src)
        assert eng.global_steps == 2, eng.global_steps
        out[name] = C.train(eng, 2)
    return out


def test_a_checkpoint_of_the_previous_engine_resumes(tmp_path):
    src = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(ASSET, "ckpt"), src)  # loading never writes, but keep the asset pristine
    with open(os.path.join(ASSET, "golden.json")) as f:
        golden = json.load(f)["losses"]
    results = run_ranks(_resume, 2, src, timeout=240)
    for res in results:
        assert res["same"] == golden, (res["same"], golden)
        for got, want in zip(res["tp2_z2"], golden):
            assert abs(got - want) <= 1e-5 * abs(want), (res["tp2_z2"], golden)
