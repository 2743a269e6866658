"""Expert-parallel checkpoints are layout-independent: a run saved at (dp 4, ep 4) resumes at
(dp 2, ep 2) and at one process with the uninterrupted run's losses, and the expert
parameters and their optimizer state are stored by GLOBAL expert index (bit-identical per
expert whatever layout wrote them).

How: an expert shard (``Placement.expert``: experts ``[first, first + count)`` stacked along
dim 0) is recorded like a TP slice along dim 0 (engine.checkpoint.layout.tp_slice_of), so its
fragments are indices into the full ``(num_experts, ...)`` tensor and any layout reads them.

Tolerance: resumed losses equal the uninterrupted ones within 1e-5 relative (a different
layout reorders the floating-point sums of the gradient reductions and the all-to-all);
the re-saved checkpoint's tensors are compared with ``torch.equal`` (a reshard copies values).
"""

from __future__ import annotations

import pytest
import torch
from _ckpt_common import config, train
from harness import run_ranks

SAVE_AT, MORE, RTOL = 2, 3, 1e-5
STATES = ("master", "exp_avg", "exp_avg_sq")


def _cfg(dp: int, ep: int, zero: int = 1) -> dict:
    cfg = config(dp=dp, zero=zero, layers=2, expert_parallel={"size": ep})
    cfg["model"]["moe"] = {"num_experts": 4, "top_k": 2, "expert_hidden_size": 32, "aux_loss_coef": 0.01}
    return cfg


def _save_and_continue(rank, world, path):
    from _ckpt_common import build

    eng = build(_cfg(world, world))
    train(eng, SAVE_AT)
    eng.save_checkpoint(path, tag="t")
    losses = train(eng, MORE)
    eng.destroy()
    return losses


def _resume(rank, world, path, resaved, zero):
    from _ckpt_common import build

    eng = build(_cfg(world, world, zero))
    eng.load_checkpoint(path, tag="t")
    eng.save_checkpoint(resaved, tag="t")  # what this layout holds, written back by global expert
    losses = train(eng, MORE)
    eng.destroy()
    return losses


def _full_states(path):
    from engine.checkpoint.reader import iter_full_params

    return {name: {s: t.clone() for s, t in states.items()} for name, _, states in iter_full_params(f"{path}/t", STATES)}


def _resumes_at(tmp_path, world, zero):
    saved, resaved = str(tmp_path / "saved"), str(tmp_path / f"resaved{world}")
    uninterrupted = run_ranks(_save_and_continue, 4, saved, timeout=300)[0]
    resumed = run_ranks(_resume, world, saved, resaved, zero, timeout=300)[0]
    for a, b in zip(resumed, uninterrupted):
        assert a == pytest.approx(b, rel=RTOL), (resumed, uninterrupted)
    want, got = _full_states(saved), _full_states(resaved)
    experts = [n for n in want if ".experts." in n]
    assert experts and set(want) == set(got)
    for name in want:
        for s in STATES:
            assert torch.equal(want[name][s], got[name][s]), (name, s)


def test_saved_at_dp4_ep4_resumes_at_dp2_ep2(tmp_path):
    _resumes_at(tmp_path, 2, zero=1)


@pytest.mark.extended
@pytest.mark.parametrize("world,zero", [(1, 1), (2, 3)])
def test_saved_at_dp4_ep4_resumes_elsewhere(tmp_path, world, zero):
    _resumes_at(tmp_path, world, zero)
