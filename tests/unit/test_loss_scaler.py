"""fp16 loss scaler: the rules one by one, and a randomized cross-check against DeepSpeed's
DynamicLossScaler (where DeepSpeed is installed)."""

import random
import types

import pytest
import torch

from engine.errors import ConfigError
from engine.precision.loss_scaler import (
    DynamicLossScaler,
    LossScaleAtMinimumError,
    StaticLossScaler,
    build_loss_scaler,
)


def _run(scaler, outcomes):
    scales = []
    for o in outcomes:
        scaler.update(bool(o))
        scales.append(scaler.loss_scale)
    return scales


def test_initial_scale_is_two_to_the_power():
    s = build_loss_scaler(torch.float16, initial_scale_power=12)
    assert isinstance(s, DynamicLossScaler) and s.loss_scale == 4096.0


def test_bf16_and_fp32_do_not_scale_and_static_scale_is_fixed():
    assert build_loss_scaler(torch.bfloat16).loss_scale == 1.0
    assert build_loss_scaler(torch.float32, loss_scale=128.0).loss_scale == 1.0
    s = build_loss_scaler(torch.float16, loss_scale=128.0)
    assert isinstance(s, StaticLossScaler)
    assert _run(s, [1, 0, 1, 1]) == [128.0] * 4


def test_hysteresis_delays_the_halving():
    s = DynamicLossScaler(init_scale=1024, scale_window=100, min_scale=1, hysteresis=3)
    # two overflows spend the budget (3 -> 2 -> 1) and keep the scale; the third halves it
    assert _run(s, [1, 1, 1, 1]) == [1024, 1024, 512, 256]
    assert s.cur_hysteresis == 1


def test_clean_steps_do_not_refill_hysteresis_unless_consecutive():
    plain = DynamicLossScaler(init_scale=1024, scale_window=100, min_scale=1, hysteresis=2)
    assert _run(plain, [1, 0, 1]) == [1024, 1024, 512]
    cons = DynamicLossScaler(init_scale=1024, scale_window=100, min_scale=1, hysteresis=2,
                             consecutive_hysteresis=True)
    assert _run(cons, [1, 0, 1, 0, 1, 1]) == [1024, 1024, 1024, 1024, 1024, 512]


def test_scale_doubles_after_a_window_of_clean_steps_and_refills_hysteresis():
    s = DynamicLossScaler(init_scale=8, scale_window=3, min_scale=1, hysteresis=2)
    # from the start (last overflow at -1) the 4th clean step (iteration 3) doubles, as in DeepSpeed
    assert _run(s, [0, 0, 0, 0]) == [8, 8, 8, 16]
    assert _run(s, [0, 0, 0]) == [16, 16, 32]  # every further window
    s.update(True)  # hysteresis 2 -> 1, scale kept
    assert (s.loss_scale, s.cur_hysteresis) == (32, 1)
    # after an overflow at k the window restarts: doubling on the 4th clean step after it
    assert _run(s, [0, 0, 0, 0]) == [32, 32, 32, 64]
    assert s.cur_hysteresis == 2


def test_halving_stops_at_the_minimum_and_an_overflow_there_is_a_clear_error():
    s = DynamicLossScaler(init_scale=8, scale_window=1000, min_scale=2, hysteresis=1)
    assert _run(s, [1, 1]) == [4, 2]
    with pytest.raises(LossScaleAtMinimumError, match="minimum"):
        s.update(True)
    lenient = DynamicLossScaler(init_scale=3, scale_window=1000, min_scale=2, hysteresis=1,
                                raise_error_at_min_scale=False)
    assert _run(lenient, [1, 1, 1]) == [2, 2, 2]  # 3/2 clamps to the minimum, then stays


def test_state_dict_round_trip():
    a = DynamicLossScaler(init_scale=64, scale_window=2, min_scale=1, hysteresis=2)
    _run(a, [1, 0, 1, 0])
    b = DynamicLossScaler(init_scale=64, scale_window=2, min_scale=1, hysteresis=2)
    b.load_state_dict(a.state_dict())
    seq = [0, 0, 0, 1, 1, 0, 0, 0]
    assert _run(a, seq) == _run(b, seq)


@pytest.mark.parametrize("kwargs,match", [
    (dict(loss_scale_window=0), "loss_scale_window"),
    (dict(min_loss_scale=0), "min_loss_scale"),
    (dict(hysteresis=0), "hysteresis"),
    (dict(loss_scale=-1.0), "loss_scale"),
    (dict(initial_scale_power=99), "initial_scale_power"),
])
def test_bad_config_values(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        build_loss_scaler(torch.float16, **kwargs)


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("hysteresis", [1, 2, 4])
def test_random_sequences_match_deepspeed(monkeypatch, consecutive, hysteresis):
    ds = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    # DeepSpeed asks its comm layer for the rank only to decide who logs.
    monkeypatch.setattr(ds, "dist", types.SimpleNamespace(get_rank=lambda: 0))
    rng = random.Random(1234 + hysteresis + 10 * consecutive)
    for _ in range(20):
        window = rng.choice([1, 2, 3, 5])
        p_overflow = rng.choice([0.05, 0.3, 0.6])
        ours = DynamicLossScaler(init_scale=2.0 ** 10, scale_window=window, min_scale=1.0, hysteresis=hysteresis,
                                 consecutive_hysteresis=consecutive)
        theirs = ds.DynamicLossScaler(init_scale=2.0 ** 10, scale_window=window, min_scale=1.0,
                                      delayed_shift=hysteresis, consecutive_hysteresis=consecutive)
        for _ in range(200):
            overflow = rng.random() < p_overflow
            try:
                theirs.update_scale(overflow)
            except Exception as e:  # DeepSpeed raises a bare Exception at the minimum
                assert "minimum" in str(e)
                with pytest.raises(LossScaleAtMinimumError):
                    ours.update(overflow)
                break
            ours.update(overflow)
            assert (ours.loss_scale, ours.cur_hysteresis) == (theirs.cur_scale, theirs.cur_hysteresis)
