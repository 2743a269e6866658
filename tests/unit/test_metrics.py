import json

import pytest
import torch

from engine.metrics import device_peak_flops, mfu, peak_memory_bytes, summarize_times


def test_mfu_formula():
    # 6 GFLOP/token at 1000 tok/s over 12 TFLOP/s total is 0.5
    assert mfu(6e9, 1000.0, 12e12) == pytest.approx(0.5)
    assert mfu(6e9, 1000.0, None) is None


def test_peak_override_and_cpu_unknown():
    cpu = torch.device("cpu")
    assert device_peak_flops(cpu) is None
    assert device_peak_flops(cpu, override_tflops=2.5) == pytest.approx(2.5e12)


def test_summarize_times():
    s = summarize_times([0.010, 0.030, 0.020, 0.040])
    assert s["median_ms"] == pytest.approx(25.0)
    assert s["min_ms"] == pytest.approx(10.0) and s["max_ms"] == pytest.approx(40.0)
    with pytest.raises(ValueError):
        summarize_times([])


def test_peak_memory_positive_on_cpu():
    assert peak_memory_bytes(torch.device("cpu")) > 1 << 20


def test_metrics_jsonl_lines_parse_and_nonwriter_writes_nothing(tmp_path):
    from engine.config.schema import MonitorConfig
    from engine.monitor import build_monitor

    w = build_monitor(MonitorConfig(), is_writer=True, metrics_dir=str(tmp_path / "a"))
    w.write_events([("Train/Samples/train_loss", 2.5, 8)], {"step": 1, "loss": 2.5, "grad_norm": float("nan")})
    w.write_events([("Train/Samples/eval_loss", 2.0, 8)])  # an event without a row: no line
    w.write_events([], {"step": 2, "loss": float("inf")})
    w.close()
    lines = [json.loads(l) for l in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 2.5, "grad_norm": None}, {"step": 2, "loss": None}]
    w2 = build_monitor(MonitorConfig(), is_writer=False, metrics_dir=str(tmp_path / "b"))
    w2.write_events([], {"step": 1})
    w2.close()
    assert not (tmp_path / "b").exists()


def test_peak_table_picks_the_hopper_variant_from_the_driver_name(monkeypatch):
    import torch

    from engine.metrics import device_peak_flops

    expected = {"NVIDIA H100 80GB HBM3": 989.5, "NVIDIA H100 PCIe": 756.5, "NVIDIA H100 NVL": 835.5,
                "NVIDIA H200": 989.5, "NVIDIA H200 NVL": 835.5, "NVIDIA H800": 989.5, "NVIDIA H800 PCIe": 756.5}
    for name, bf16 in expected.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert device_peak_flops(torch.device("cuda", 0), "bf16") == bf16 * 1e12, name
        assert abs(device_peak_flops(torch.device("cuda", 0), "fp8") / (bf16 * 1e12) - 2) < 0.01, name


def test_step_timer_on_cuda_does_not_drain_the_device_before_the_step(monkeypatch):
    import time as time_mod

    import torch
    from fake_cuda import patch_cuda_timing

    from engine.metrics import StepTimer

    patch_cuda_timing(monkeypatch, "StepTimer")
    timer = StepTimer(torch.device("cuda", 0))
    timer.start()
    time_mod.sleep(0.01)
    assert 0.009 < timer.stop() < 1.0
