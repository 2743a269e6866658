"""Throughput, MFU and memory (pure values; every rank can compute them).

MFU is model FLOPs per token x tokens/s over the peak of all devices. Writing the per-step
record is the monitors' (:mod:`engine.monitor`, ``metrics.jsonl`` included).
"""

from __future__ import annotations

import resource
import statistics
import time
from typing import Any, Optional

import torch

__all__ = ["PEAK_TFLOPS", "device_peak_flops", "mfu", "peak_memory_bytes", "reset_peak_memory",
           "current_memory_bytes",
           "StepTimer", "summarize_times"]

# Dense (no sparsity) peak TFLOP/s per device by compute dtype, from NVIDIA's data sheets
# (which quote Hopper tensor-core figures with 2:4 sparsity: halved here). Matched by
# substring of torch.cuda.get_device_name(), longest key first, so a variant ("H100 NVL",
# "H100 PCIe", "H200 NVL", "H800 PCIe") wins over its family. Names as the driver reports
# them: the H100 SXM is "NVIDIA H100 80GB HBM3" (the bare "H100" row), the H200 SXM
# "NVIDIA H200". The NVL cards (PCIe form factor, lower clocks) are ~15% below the SXM parts;
# the H800 is the H100 with cut FP64 and NVLink, the same tensor-core peaks.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "fp8": 1670.5, "fp32": 60.0},
    "H200": {"bf16": 989.5, "fp16": 989.5, "fp8": 1979.0, "fp32": 67.0},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "fp8": 1670.5, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "fp8": 1513.0, "fp32": 51.0},
    "H100 SXM": {"bf16": 989.5, "fp16": 989.5, "fp8": 1979.0, "fp32": 67.0},
    "H100": {"bf16": 989.5, "fp16": 989.5, "fp8": 1979.0, "fp32": 67.0},
    "H800 PCIe": {"bf16": 756.5, "fp16": 756.5, "fp8": 1513.0, "fp32": 51.0},
    "H800": {"bf16": 989.5, "fp16": 989.5, "fp8": 1979.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp8": 733.0, "fp32": 91.6},
    "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}


def device_peak_flops(device: torch.device, dtype: str = "bf16",
                      override_tflops: Optional[float] = None) -> Optional[float]:
    """Peak FLOP/s of ONE device for ``dtype`` ("bf16", "fp16", "fp8", "fp32"), or None if unknown.

    ``override_tflops`` (from a flag or the config) wins. CPUs have no table entry: the
    benchmarks measure a matmul peak and pass it as the override.
    """
    if override_tflops is not None:
        return float(override_tflops) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            tflops = PEAK_TFLOPS[key].get(dtype)
            return tflops * 1e12 if tflops else None
    return None


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops_total: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation in [0, 1]; None when the peak is unknown."""
    if not peak_flops_total:
        return None
    return flops_per_token * tokens_per_s / peak_flops_total


def _proc_status_kib(field: str) -> Optional[int]:
    """A ``kB`` field of /proc/self/status (Linux), or None where there is none."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak bytes since the process started or the last :func:`reset_peak_memory`: max
    allocated on CUDA; on CPU the resident set's high-water mark (``VmHWM``, which
    :func:`reset_peak_memory` can reset; ``ru_maxrss`` where /proc is missing).

    On CPU run with ``MALLOC_MMAP_THRESHOLD_`` fixed (e.g. 131072): glibc's threshold
    otherwise grows with the largest freed block, freed tensors stay in the heap and the
    RSS over-counts what is live."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    hwm = _proc_status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def current_memory_bytes(device: torch.device) -> int:
    """Bytes held now: allocated on CUDA, resident set size on CPU (0 where unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    rss = _proc_status_kib("VmRSS")
    return 0 if rss is None else rss * 1024


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new high-water mark from what is held now (CUDA: the allocator's peak
    statistics; CPU: writes ``5`` to /proc/self/clear_refs, which resets ``VmHWM``).
    Returns False where the platform cannot reset it (the peak then stays process-wide)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class StepTimer:
    """Time of a step. CPU: wall time. CUDA: a pair of events on the current stream, so the
    time covers the step's queued kernels without draining the device before the step
    (the old ``synchronize()`` in ``start()`` was a second host sync per step); ``stop()``
    waits for the step's last event only, since the caller wants the number now."""

    def __init__(self, device: torch.device):
        self.device = device
        self._t0 = 0.0
        self._start: Any = None

    def start(self) -> None:
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        """Seconds since start() (on CUDA: from when the device reached start() to the end of
        the step's work)."""
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return self._start.elapsed_time(end) / 1e3
        return time.perf_counter() - self._t0


def summarize_times(seconds: list[float]) -> dict[str, float]:
    """Median and spread (min, max, interquartile range) of step times, in ms."""
    if not seconds:
        raise ValueError("summarize_times needs at least one time")
    ms = sorted(s * 1e3 for s in seconds)
    q = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [ms[0]] * 3
    return {"median_ms": statistics.median(ms), "min_ms": ms[0], "max_ms": ms[-1], "iqr_ms": q[2] - q[0]}
