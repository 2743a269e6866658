"""The pure parts of issue 30's guards: the divergence counter, the metrics file reader
(torn last line), the resume's model comparison, the config file's limits, the
preemption handler's repeated signals and the failure diagnosis's real times."""

from __future__ import annotations

import json
import os
import signal

import pytest

from engine.config import ConfigError, load_config
from engine.config.reader import read_json_file
from engine.monitor.jsonl import MetricsFileError, keep_metrics_up_to, read_metrics
from engine.training.divergence import DivergenceGuard, is_nonfinite_step
from engine.training.resume import metrics_problem, model_differences

MODEL = {"vocab_size": 256, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "seq_len": 16}


def _rec(step, loss=1.0, norm=1.0, skipped=False):
    return {"step": step, "loss": loss, "grad_norm": norm, "skipped": skipped}


def test_divergence_guard_counts_consecutive_nonfinite_steps_only():
    g = DivergenceGuard(3)
    assert not g.observe(_rec(1)) and not g.in_streak
    assert g.observe(_rec(2, loss=float("nan"), skipped=True)) and g.in_streak
    assert g.observe(_rec(3, norm=float("inf"), skipped=True)) and not g.tripped
    assert not g.observe(_rec(4))  # a finite step resets the streak
    for s in (5, 6, 7):
        g.observe(_rec(s, loss=None, norm=None, skipped=True))  # metrics.jsonl writes NaN as null
    assert g.tripped and (g.first_step, g.last_step) == (5, 7)
    assert "steps 5-7, all skipped" in g.message("ck/global_step4")
    assert "the last finite checkpoint is ck/global_step4" in g.message("ck/global_step4")
    assert "no checkpoint of this run holds a finite state" in g.message(None)
    g0 = DivergenceGuard(0)  # 0: never stop
    for s in range(100):
        g0.observe(_rec(s, skipped=True))
    assert not g0.tripped
    # bf16 without check_grad_overflow: a non-finite step the optimizer applied still counts
    assert is_nonfinite_step(_rec(1, loss=float("nan"))) and not is_nonfinite_step(_rec(1, norm=None))


def test_metrics_torn_last_line_is_dropped_and_others_are_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3))
    path.write_text(good + '{"step": 4, "lo')
    rows, torn = read_metrics(str(path))
    assert [r["step"] for r, _ in rows] == [1, 2, 3] and torn == 4
    warned = []
    keep_metrics_up_to(str(tmp_path), 2, warn=lambda *a: warned.append(a[0] % a[1:]))
    assert path.read_text() == "".join(good.splitlines(keepends=True)[:2]) and "line 4 was cut off" in warned[0]
    path.write_text('{"step": 1}\n{"step": \n{"step": 3}\n')
    with pytest.raises(MetricsFileError, match=r"metrics.jsonl line 2 is not JSON"):
        read_metrics(str(path))
    assert "line 2 is not JSON" in metrics_problem(str(tmp_path))
    path.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(MetricsFileError, match="line 2 is not a metrics record"):
        read_metrics(str(path))
    keep_metrics_up_to(str(tmp_path), 0)  # a fresh run starts a new file whatever the old one holds
    assert path.read_text() == ""


def test_model_differences_name_every_key():
    assert model_differences(MODEL, dict(MODEL)) == []
    assert model_differences(MODEL, {**MODEL, "ffn_hidden_size": 128}) == []  # 128 is the default for 32
    # resolved values are compared: num_kv_heads follows num_heads when unset
    assert model_differences(MODEL, {**MODEL, "num_heads": 8, "seq_len": 32}) == [
        ("num_heads", 4, 8), ("num_kv_heads", 4, 8), ("seq_len", 16, 32)]


@pytest.mark.parametrize("text,match", [
    ('{"seed": ' + "9" * 5000 + "}", "an integer of 5000 digits"),
    ('{"seed": ' + "[" * 200_000 + "]" * 200_000 + "}", "nested more than 64 levels"),
    ('{"seed": 1,}', "is not valid JSON"),
    ('{"a": "' + "[" * 82 + '"}', None),
], ids=["int_5000_digits", "nested_200k", "trailing_comma", "brackets_in_a_string"])
def test_hostile_json_is_one_config_error(tmp_path, text, match):
    path = tmp_path / "c.json"
    path.write_text(text)
    if match is None:  # brackets inside a string are not nesting
        assert read_json_file(str(path)) == {"a": "[" * 82}
        return
    with pytest.raises(ConfigError, match=match) as e:
        read_json_file(str(path))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("over,key", [
    ({"train_micro_batch_size_per_gpu": 1e300}, "train_micro_batch_size_per_gpu = 1e+300"),
    ({"train_batch_size": 2**40}, "train_batch_size"),
    ({"model": {**MODEL, "hidden_size": 10**7}}, "model.hidden_size = 1e+07"),
    ({"model": {**MODEL, "seq_len": 2**30}}, "model.seq_len"),
    ({"model": {**MODEL, "hidden_size": 65536, "num_layers": 4000, "num_heads": 64}}, "parameters"),
])
def test_sizes_have_upper_bounds(over, key):
    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "model": MODEL}
    with pytest.raises(ConfigError, match="above the limit") as e:
        load_config({**base, **over}, world_size=1)
    assert key in str(e.value)
    assert load_config(base, world_size=1).max_consecutive_nonfinite_steps == 20


def test_preemption_handler_counts_repeats_and_ignores_at_exit():
    from engine.checkpoint.preempt import PreemptionHandler

    before = signal.getsignal(signal.SIGUSR1)
    h = PreemptionHandler(signals=(signal.SIGUSR1,)).install()
    try:
        for _ in range(3):
            os.kill(os.getpid(), signal.SIGUSR1)
        assert h.received == signal.SIGUSR1 and h.repeats == 2
        h.ignore_until_exit()  # kept through interpreter finalisation, which resets Python handlers
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGUSR1)
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_failure_diagnosis_says_the_time_really_waited():
    from engine.distributed.env import DistEnv, LaunchInfo
    from engine.distributed.failures import _describe

    env = DistEnv(launch=LaunchInfo("torchrun", 1, 1, 3, 3, "h", 1), device=None, backend="gloo", timeout_s=1.0,
                  store=None)
    early = _describe(env, {}, {}, [], [0], [2], grace_s=5.0, waited_s=0.76)
    assert "rank 0 still running, not stopped after 0.8s" in early and "within 5s" not in early
    assert "rank 2 not heard from after 0.8s" in early
    assert "not stopped within 5s" in _describe(env, {}, {}, [], [0], [], grace_s=5.0, waited_s=5.02)
