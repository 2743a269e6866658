"""FusedAdamW never falls back to the PyTorch reference silently: the constructor warns once
per device type (a RuntimeWarning and a log line) naming the cause, e.g. an op built without
its CUDA kernel because nvcc was missing (the CPU kernel loads, the GPU would run the
reference). Without a GPU the CUDA case is reproduced by patching what the op reports."""

import warnings

import pytest
import torch

import engine.ops.adam as adam_ops
import engine.optim.fused_adamw as fused_adamw_mod
from engine.optim import FusedAdamW


class _CpuOnlyBuild:
    """The adam op as it stands after a build on a host without nvcc."""

    def is_loaded(self):
        return True

    def jit_problem(self):
        return None

    def cuda_problem(self):
        return "nvcc not found (CUDA_HOME is not set and no nvcc on PATH)"


def test_cuda_device_without_its_kernel_names_nvcc(monkeypatch):
    monkeypatch.setattr(adam_ops, "fused_adamw_available", lambda device: torch.device(device).type == "cpu")
    monkeypatch.setattr(adam_ops, "get_builder", lambda name: _CpuOnlyBuild())
    problem = adam_ops.fused_adamw_problem("cuda:0")
    assert "without its CUDA kernel" in problem and "nvcc" in problem and "rebuild" in problem
    assert adam_ops.fused_adamw_problem("cpu") is None


def test_constructor_warns_once_per_device_type_naming_the_cause(monkeypatch, caplog):
    monkeypatch.setattr(fused_adamw_mod, "_WARNED", set())
    monkeypatch.setattr(fused_adamw_mod, "fused_adamw_problem", lambda device: "nvcc not found")
    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.warns(RuntimeWarning, match="NO FUSED KERNEL.*nvcc not found"):
        FusedAdamW([p], lr=1e-3)
    assert any("nvcc not found" in r.getMessage() for r in caplog.records)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FusedAdamW([p], lr=1e-3)  # once per process and device type


def test_no_warning_when_the_kernel_runs(monkeypatch):
    monkeypatch.setattr(fused_adamw_mod, "_WARNED", set())
    monkeypatch.setattr(fused_adamw_mod, "fused_adamw_problem", lambda device: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FusedAdamW([torch.nn.Parameter(torch.zeros(4))], lr=1e-3)
