"""LR schedules against their formulas (hand-written here, independently of the module),
against known points, and against DeepSpeed's own classes where DeepSpeed is installed.

DeepSpeed's three schedules count from its ``last_batch_iteration`` = -1 at construction, so
the lr of the ``k``-th optimizer step is ``f(k - 1)`` with ``f(-1)`` the start value
(``warmup_min_lr``; ratio 0 for WarmupCosineLR). Until 2026-11 ours used ``f(k)`` (one step
ahead of DeepSpeed); the expectations below were moved to DeepSpeed's indexing then."""

import math

import pytest
import torch

from engine.errors import ConfigError
from engine.optim.lr_schedules import build_lr_scheduler


def _opt(lr=0.1, groups=1):
    ps = [torch.nn.Parameter(torch.zeros(2)) for _ in range(groups)]
    return torch.optim.SGD([{"params": [p]} for p in ps], lr=lr)


def _trace(type_, params, steps, lr=0.1, groups=1):
    opt = _opt(lr, groups)
    sched = build_lr_scheduler(opt, type_, params)
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return out


# ------------------------------------------------------------------ DeepSpeed's schedules
@pytest.mark.parametrize("wtype", ["log", "linear"])
def test_warmup_lr_formula(wtype):
    lo, hi, w = 0.01, 0.5, 10
    got = _trace("WarmupLR", dict(warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=w, warmup_type=wtype), 15)
    for k, (lr,) in enumerate(got):
        s = k - 1  # DeepSpeed's last_batch_iteration when step k runs
        if s < 0:
            g = 0.0
        elif s < w:
            g = math.log(s + 1) / math.log(w) if wtype == "log" else s / w
        else:
            g = 1.0
        assert lr == pytest.approx(lo + (hi - lo) * g, rel=1e-12, abs=1e-15)
    assert got[0][0] == pytest.approx(lo) and got[-1][0] == pytest.approx(hi)


def test_warmup_lr_defaults_to_optimizer_lr_and_raises_one_step_warmup_to_two():
    got = _trace("WarmupLR", dict(warmup_min_lr=0.0, warmup_num_steps=1, warmup_type="linear"), 4, lr=0.3)
    # DeepSpeed raises warmup_num_steps to at least 2: min (iteration -1), then 0, 0.5, 1 (x 0.3)
    assert [g[0] for g in got] == pytest.approx([0.0, 0.0, 0.15, 0.3])


@pytest.mark.parametrize("wtype", ["log", "linear"])
def test_warmup_decay_lr_formula(wtype):
    lo, hi, w, t = 0.0, 0.2, 5, 20
    got = _trace("WarmupDecayLR", dict(total_num_steps=t, warmup_min_lr=lo, warmup_max_lr=hi,
                                       warmup_num_steps=w, warmup_type=wtype), 25)
    for k, (lr,) in enumerate(got):
        s = k - 1
        if s < 0:
            g = 0.0
        elif s < w:
            g = math.log(s + 1) / math.log(w) if wtype == "log" else s / w
        else:
            g = max(0.0, (t - s) / (t - w))
        assert lr == pytest.approx(lo + (hi - lo) * g, abs=1e-15)
    assert got[w + 1][0] == pytest.approx(hi) and got[t + 1][0] == 0.0 and got[24][0] == 0.0


@pytest.mark.parametrize("wtype", ["log", "linear"])
def test_warmup_cosine_lr_formula(wtype):
    base, m, c, w, t = 0.4, 0.1, 0.01, 4, 24
    got = _trace("WarmupCosineLR", dict(total_num_steps=t, warmup_min_ratio=m, warmup_num_steps=w,
                                        cos_min_ratio=c, warmup_type=wtype), 30, lr=base)
    for k, (lr,) in enumerate(got):
        s = k - 1
        if s < 0:
            r = 0.0  # DeepSpeed's ratio before its first step() is 0, not warmup_min_ratio
        elif s < w:
            g = math.log(s + 1) / math.log(w) if wtype == "log" else s / w
            r = m + g * (1 - m)
        else:
            p = min(1.0, (s - w + 1) / (t - w))
            r = c + (1 - c) * 0.5 * (1 + math.cos(math.pi * p))
        assert lr == pytest.approx(base * r, abs=1e-15)
    assert got[0][0] == 0.0 and got[1][0] == pytest.approx(base * m)
    assert got[29][0] == pytest.approx(base * c)  # clamped after the end, no second cosine lobe


_DS_CASES = [
    ("WarmupLR", dict(warmup_min_lr=0.001, warmup_max_lr=0.05, warmup_num_steps=7, warmup_type="log")),
    ("WarmupLR", dict(warmup_min_lr=0.0, warmup_max_lr=0.05, warmup_num_steps=7, warmup_type="linear")),
    ("WarmupDecayLR", dict(total_num_steps=30, warmup_min_lr=0.0, warmup_max_lr=0.05, warmup_num_steps=7,
                           warmup_type="log")),
    ("WarmupCosineLR", dict(total_num_steps=30, warmup_min_ratio=0.05, warmup_num_steps=7,
                            cos_min_ratio=0.001, warmup_type="linear")),
]


@pytest.mark.parametrize("type_,params", _DS_CASES)
def test_matches_deepspeed_implementation(type_, params):
    """Built and stepped the same way (one step() after each optimizer step), DeepSpeed's
    class and ours give the same lr to every optimizer step, the first included."""
    ds = pytest.importorskip("deepspeed.runtime.lr_schedules")
    ours = _trace(type_, params, 35, lr=0.05)
    opt = _opt(0.05)
    ds_sched = getattr(ds, type_)(opt, **params)
    for k in range(35):
        assert opt.param_groups[0]["lr"] == pytest.approx(ours[k][0], rel=1e-12, abs=1e-15), k
        opt.step()
        ds_sched.step()
    assert ds_sched.last_batch_iteration == 34


def test_last_batch_iteration_is_deepspeeds():
    sched = build_lr_scheduler(_opt(), "WarmupLR", dict(warmup_num_steps=3))
    assert sched.last_batch_iteration == -1
    sched.optimizer.step()
    sched.step()
    assert sched.last_batch_iteration == 0


# ------------------------------------------------------------------ ours
def test_cosine_formula_and_points():
    base, w, t, f = 1.0, 10, 110, 0.1
    got = _trace("cosine", dict(warmup_num_steps=w, total_num_steps=t, min_lr_ratio=f, warmup_type="linear"),
                 130, lr=base)
    for s, (lr,) in enumerate(got):
        if s < w:
            r = s / w
        else:
            p = min(1.0, (s - w) / (t - w))
            r = f + (1 - f) * 0.5 * (1 + math.cos(math.pi * p))
        assert lr == pytest.approx(r, abs=1e-15)
    assert got[0][0] == 0.0 and got[w][0] == pytest.approx(1.0)
    assert got[60][0] == pytest.approx((1 + f) / 2)  # half way through the decay
    assert got[t][0] == pytest.approx(f) and got[129][0] == pytest.approx(f)


def test_cosine_default_min_ratio_is_a_tenth():
    got = _trace("cosine", dict(warmup_num_steps=0, total_num_steps=4), 6)
    assert got[0][0] == pytest.approx(0.1) and got[5][0] == pytest.approx(0.01)


@pytest.mark.parametrize("decay", ["linear", "cosine", "sqrt"])
def test_wsd_formula_and_points(decay):
    base, w, t, d, f = 2.0, 4, 20, 8, 0.05
    got = _trace("WSD", dict(warmup_num_steps=w, total_num_steps=t, decay_num_steps=d, min_lr_ratio=f,
                             decay_type=decay), 24, lr=base)
    shape = {"linear": lambda p: 1 - p, "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
             "sqrt": lambda p: 1 - math.sqrt(p)}[decay]
    for s, (lr,) in enumerate(got):
        if s < w:
            r = s / w
        elif s < t - d:
            r = 1.0
        else:
            r = f + (1 - f) * shape(min(1.0, (s - (t - d)) / d))
        assert lr == pytest.approx(base * r, abs=1e-14)
    assert [g[0] for g in got[w:t - d + 1]] == pytest.approx([base] * (t - d - w + 1))  # stable phase
    assert got[t][0] == pytest.approx(base * f) and got[23][0] == pytest.approx(base * f)


# ------------------------------------------------------------------ mechanics
def test_state_dict_round_trip_resumes_the_curve():
    params = dict(warmup_num_steps=3, total_num_steps=12, decay_num_steps=5, decay_type="cosine")
    opt = _opt()
    sched = build_lr_scheduler(opt, "WSD", params)
    for _ in range(9):
        opt.step()
        sched.step()
    sd = sched.state_dict()
    opt2 = _opt()
    sched2 = build_lr_scheduler(opt2, "WSD", params)
    sched2.load_state_dict(sd)
    assert sched2.last_epoch == 9
    for _ in range(3):
        opt.step()
        sched.step()
        opt2.step()
        sched2.step()
        assert sched.get_last_lr() == pytest.approx(sched2.get_last_lr())
        assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])


def test_per_group_values_and_wrapper_with_inner_optimizer():
    class Wrapper:
        def __init__(self, o):
            self.optimizer = o

    opt = _opt(groups=2)
    sched = build_lr_scheduler(Wrapper(opt), "WarmupLR", dict(warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.2],
                                                             warmup_num_steps=2, warmup_type="linear"))
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.0, 0.1])  # DeepSpeed's iteration -1
    for _ in range(2):
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5, 0.15])


@pytest.mark.parametrize("type_,params,match", [
    ("Cyclic", {}, "scheduler.type"),
    ("WarmupLR", dict(warmup_num_steps=0), "warmup_num_steps"),
    ("WarmupLR", dict(warmup_type="exp"), "warmup_type"),
    ("WarmupLR", dict(warmup_min_lr=[0.0, 1.0]), "param groups"),
    ("WarmupLR", dict(warmup_steps=3), "unknown keys"),
    ("WSD", dict(warmup_num_steps=5, total_num_steps=10, decay_num_steps=6), "exceed total_num_steps"),
    ("WSD", dict(warmup_num_steps=1, total_num_steps=10, decay_num_steps=6, decay_type="exp"), "decay_type"),
    ("cosine", dict(warmup_num_steps=1, total_num_steps=10, min_lr_ratio=1.5), "min_lr_ratio"),
    ("WarmupCosineLR", dict(total_num_steps=0), "total_num_steps"),
])
def test_bad_params_are_config_errors(type_, params, match):
    with pytest.raises(ConfigError, match=match):
        build_lr_scheduler(_opt(), type_, params)
