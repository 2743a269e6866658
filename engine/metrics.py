"""Throughput, MFU, memory and the per-step metrics stream.

``MetricsWriter`` appends one JSON object per optimizer step to ``metrics.jsonl`` (and
mirrors scalars to TensorBoard when it is installed). Only the writer rank writes; every
rank can compute. MFU is model FLOPs per token x tokens/s over the peak of all devices.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import statistics
import time
from typing import IO, Any, Optional

import torch

__all__ = ["PEAK_TFLOPS", "device_peak_flops", "mfu", "peak_memory_bytes", "reset_peak_memory",
           "current_memory_bytes", "MetricsWriter",
           "StepTimer", "summarize_times", "get_rank_logger"]

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


class MetricsWriter:
    """Appends one JSON object per step to ``<output_dir>/metrics.jsonl`` on the writer rank.

    Non-finite floats are written as ``null`` (JSON has no NaN) so every line parses.
    """

    def __init__(self, output_dir: Optional[str], is_writer: bool, tensorboard: bool = True):
        self.is_writer = bool(is_writer and output_dir)
        self._file: Optional[IO[str]] = None
        self._tb: Any = None  # torch.utils.tensorboard.SummaryWriter when available
        if not self.is_writer or output_dir is None:
            return
        os.makedirs(output_dir, exist_ok=True)
        self._file = open(os.path.join(output_dir, "metrics.jsonl"), "a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
            except Exception:  # noqa: BLE001 - TensorBoard is optional
                pass
            else:
                self._tb = SummaryWriter(log_dir=os.path.join(output_dir, "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        if not self.is_writer:
            return
        assert self._file is not None, "MetricsWriter.write after close()"
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean, sort_keys=False) + "\n")
        self._file.flush()
        if self._tb is not None and "step" in record:
            for k, v in clean.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None:
                    self._tb.add_scalar(f"train/{k}", v, record["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def get_rank_logger(name: str, rank: int, all_ranks: bool = False) -> logging.Logger:
    """A logger that is quiet (WARNING and above only) on ranks other than 0 unless all_ranks."""
    logger = logging.getLogger(name)
    if rank != 0 and not all_ranks:
        logger.setLevel(logging.WARNING)
    return logger
