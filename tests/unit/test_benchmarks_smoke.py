"""Smoke tests of the benchmark scripts (benchmarks/): they run end to end on tiny inputs and
produce well-formed output. The numbers themselves are shown by the benchmarks, not timed
here."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks import compare, memory, throughput  # noqa: E402
from benchmarks._compare_common import summarize_pair  # noqa: E402
from benchmarks.common import CommTimer, markdown_table, spread  # noqa: E402

TINY = {
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 0},
    "model": {"vocab_size": 128, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "seq_len": 16},
}


def test_throughput_runs_one_rank_and_writes_json(tmp_path, capsys):
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY))
    out = tmp_path / "t.json"
    assert throughput.main(["--config", str(cfg), "--nproc", "1", "--steps", "2", "--warmup", "0",
                            "--split-steps", "1", "--set", "zero_optimization.stage=1", "--json", str(out)]) == 0
    row = capsys.readouterr().out
    assert "dp1·tp1·pp1" in row and "zero_optimization.stage=1" in row
    res = json.loads(out.read_text())
    assert res["zero_stage"] == 1 and res["ranks"] == 1 and res["tokens_per_s"] > 0
    assert res["global_batch_tokens"] == 2 * 16
    assert res["step_ms"]["min"] <= res["step_ms"]["median"] <= res["step_ms"]["max"]
    assert res["peak_source"].startswith("measured") and 0 < res["mfu"]
    split = res["split_ms_mean_over_ranks"]
    assert {"forward", "backward", "optimizer", "communication", "bubble", "other"} <= set(split)
    assert split["forward"] > 0 and split["backward"] > 0
    mem = res["memory_per_rank"][0]
    assert mem["peak_bytes"] > 0 and mem["params_bytes"] > 0 and res["probes"]["memory_bw"] > 0


def test_throughput_overrides_and_bad_args(tmp_path):
    assert throughput.apply_overrides({"a": {"b": 1}}, ["a.b=2", "a.c=\"x\"", "d=[1, 2]"]) == \
        {"a": {"b": 2, "c": "x"}, "d": [1, 2]}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        throughput.apply_overrides({}, ["nokey"])
    with pytest.raises(SystemExit):
        throughput.parse_args(["--config", str(tmp_path / "missing.json")])


def test_compare_arguments_and_cases():
    args = compare.parse_args(["--suite", "ds", "pp", "--stages", "0", "3", "--steps", "3"])
    cases = compare._cases(args)
    assert [c[1] for c in cases] == ["ZeRO-0 dp2 vs DeepSpeed", "ZeRO-3 dp2 vs DeepSpeed",
                                     "1F1B pp2 m8 vs torch Schedule1F1B"]
    with pytest.raises(SystemExit):
        compare.parse_args(["--stages", "4"])
    with pytest.raises(SystemExit):
        compare.parse_args(["--suite", "pp", "--layers", "1"])


def _fake_rank(times_a, times_b, loss_a, loss_b):
    rec = lambda t, l: {"time": t, "loss": l, "comm": [0.0] * len(t), "p2p": [0.0] * len(t),  # noqa: E731
                        "phases": {"forward": [0.1] * len(t)}}
    return {"ours": rec(times_a, loss_a), "theirs": rec(times_b, loss_b)}


def test_compare_says_deepspeed_is_missing_instead_of_failing(monkeypatch, capsys):
    """Without deepspeed the DeepSpeed rows are skipped with one line each (no rank starts)."""
    monkeypatch.setattr(compare, "_deepspeed_missing", lambda: True)
    monkeypatch.setattr(compare, "launch", lambda *a, **k: pytest.fail("no rank may start"))
    args = compare.parse_args(["--suite", "ds", "--stages", "1", "--steps", "1", "--repeats", "1"])
    res = compare.run_case(args, compare._cases(args)[0])
    assert res["repetitions"] == [] and res["note"] == compare.DS_MISSING
    assert "deepspeed not installed, skipping" in capsys.readouterr().err
    assert compare.summary_row(res)["note"].startswith("deepspeed not installed, skipping")


def test_summarize_pair_ratio_and_loss_difference():
    per_rank = [_fake_rank([1.0, 1.0, 1.2], [2.0, 2.2, 2.0], [3.0, 2.0, 1.0], [3.0, 2.5, 1.0]),
                _fake_rank([1.0, 1.0, 1.2], [2.0, 2.2, 2.0], [3.0, 2.0, 1.0], [3.0, 1.5, 1.0])]
    s = summarize_pair(per_rank, "ours", "theirs", tokens_per_step=100)
    assert s["ratio"] == pytest.approx(2.0)  # median 2.0 s / median 1.0 s
    assert s["ours"]["tokens_per_s"] == pytest.approx(100.0)
    assert s["max_loss_diff"] == pytest.approx(0.0)  # rank means agree: (2.5 + 1.5) / 2 == 2.0
    row = compare.summary_row({"case": "x", "theirs": "theirs", "suite": "ds", "note": None,
                               "repetitions": [s, s]})
    assert row["ratio ours/theirs"] == "2.000" and "2 reps" in row["note"]


def test_compare_one_tiny_pipeline_case():
    """Both pipelines on 2 ranks, one step: fp32 losses identical."""
    args = compare.parse_args(["--suite", "pp", "--steps", "1", "--warmup", "0", "--repeats", "1",
                               "--vocab", "64", "--hidden", "32", "--heads", "2", "--layers", "2", "--seq", "16",
                               "--micro-batch", "2", "--pp-microbatches", "2", "--timeout", "120"])
    res = compare.run_case(args, compare._cases(args)[0])
    rep = res["repetitions"][0]
    assert rep["steps"] == 1 and rep["max_loss_diff"] == 0.0
    assert rep["ours"]["tokens_per_s"] > 0 and rep["torch"]["tokens_per_s"] > 0


def test_memory_peak_table_of_a_tiny_zero3_run(tmp_path, capsys):
    """benchmarks/memory.py as a user runs it (ours only, 2 ranks, ZeRO-3, one step): every
    rank reports a tensor and an RSS peak, and the row carries the formula and the planner."""
    out = tmp_path / "mem.json"
    assert memory.main(["--hidden", "32", "--layers", "2", "--vocab", "64", "--heads", "2", "--seq", "16",
                        "--dp", "2", "--bucket", "2000", "--stages", "3", "--dtypes", "fp32", "--ga", "1",
                        "--systems", "ours", "--timeout", "300", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    ours = row["ours"]
    assert "error" not in ours, ours
    assert len(ours["tensor_peak"]) == 2 and min(ours["tensor_peak"]) > 0 and min(ours["rss_peak"]) > 0
    assert row["formula"]["peak"] > 0 and row["predicted"]["peak"] > 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| fp32 | 1 | 3 |")]
    assert len(line) == 1 and "n/a" in line[0]  # no DeepSpeed column in this run


def test_common_helpers():
    import torch.distributed as dist

    orig = dist.all_reduce
    t = CommTimer().install()
    assert dist.all_reduce is not orig and dist.all_reduce.__wrapped__ is orig
    t.uninstall()
    assert dist.all_reduce is orig
    assert spread([3.0, 1.0, 2.0])["median"] == 2.0
    md = markdown_table([{"a": 1.23456, "b": None}], ["a", "b"])
    assert md.splitlines()[2] == "| 1.2 | - |"


def test_comm_timer_on_cuda_records_events_and_never_syncs_per_collective(monkeypatch):
    """On a GPU the comm timer must not synchronise the device after every collective (that
    serialises compute and communication, so every GPU ratio would be wrong): it records a
    CUDA event pair per call and resolves them when read. Fake events stand in for CUDA."""
    import time as time_mod

    import torch
    from fake_cuda import patch_cuda_timing

    patch_cuda_timing(monkeypatch, "the comm timer")
    timer = CommTimer(torch.device("cuda", 0))
    for kind in ("collective", "p2p", "collective"):
        with timer.region(kind):
            time_mod.sleep(0.01)
    assert len(timer._pending) == 3  # nothing resolved (no sync) until read
    assert timer.by_kind["collective"] >= 0.02 and timer.by_kind["p2p"] >= 0.01
    assert timer.calls == 3 and not timer._pending
