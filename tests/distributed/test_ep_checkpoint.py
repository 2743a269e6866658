"""Expert-parallel checkpoints are layout-independent: a run saved at (dp 4, ep 4) resumes at
(dp 2, ep 2) and at one process with the uninterrupted run's losses, and the expert
parameters and their optimizer state are stored by GLOBAL expert index (bit-identical per
expert whatever layout wrote them).

How: an expert shard (``Placement.expert``: experts ``[first, first + count)`` stacked along
dim 0) is recorded like a TP slice along dim 0 (engine.checkpoint.layout.tp_slice_of), so its
fragments are indices into the full ``(num_experts, ...)`` tensor and any layout reads them.

Aux-free balancing: the per-expert routing biases (``expert_bias``, whole on every rank) are
saved in the checkpoint's metadata by layer name and global expert index
(engine.training_state's ``moe_bias``); a run saved at (dp 2, ep 2) resumes in one process
with the saved biases bit for bit, the same biases on every rank after more steps, and the
uninterrupted losses.

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


def _cfg(dp: int, ep: int, zero: int = 1, balancing: str = "aux_loss") -> dict:
    cfg = config(dp=dp, zero=zero, layers=2, expert_parallel={"size": ep})
    cfg["model"]["moe"] = {"num_experts": 4, "top_k": 2, "expert_hidden_size": 32, "aux_loss_coef": 0.01,
                           "load_balancing": balancing}
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


@pytest.mark.slow
def test_saved_at_dp4_ep4_resumes_at_dp2_ep2(tmp_path):
    _resumes_at(tmp_path, 2, zero=1)


@pytest.mark.extended
@pytest.mark.parametrize("world,zero", [(1, 1), (2, 3)])
def test_saved_at_dp4_ep4_resumes_elsewhere(tmp_path, world, zero):
    _resumes_at(tmp_path, world, zero)


def _biases(eng) -> list[list[float]]:
    from engine.moe.stats import moe_layers

    return [m.expert_bias.tolist() for m in moe_layers(eng.module)]


def _aux_free_save(rank, world, path):
    from _ckpt_common import build

    eng = build(_cfg(world, world, balancing="aux_free"))
    train(eng, SAVE_AT)
    saved = _biases(eng)
    eng.save_checkpoint(path, tag="t")
    losses = train(eng, MORE)
    out = (saved, losses, _biases(eng))
    eng.destroy()
    return out


def _aux_free_resume(rank, world, path):
    from _ckpt_common import build

    eng = build(_cfg(world, world, balancing="aux_free"))
    fresh = _biases(eng)
    eng.load_checkpoint(path, tag="t")
    loaded = _biases(eng)
    losses = train(eng, MORE)
    out = (fresh, loaded, losses, _biases(eng))
    eng.destroy()
    return out


def test_aux_free_biases_are_saved_and_restored(tmp_path):
    path = str(tmp_path / "af")
    runs = run_ranks(_aux_free_save, 2, path, timeout=300)
    saved, losses, final = runs[0]
    assert all(r == runs[0] for r in runs[1:]), "every rank holds the same biases and losses"
    assert any(v != 0.0 for layer in saved for v in layer), "the biases moved before the save"
    (fresh, loaded, resumed, resumed_final), = run_ranks(_aux_free_resume, 1, path, timeout=300)
    assert all(v == 0.0 for layer in fresh for v in layer)
    assert loaded == saved, "the biases are restored bit for bit, by global expert"
    for a, b in zip(resumed, losses):
        assert a == pytest.approx(b, rel=RTOL), (resumed, losses)
    assert resumed_final == final
