"""Calibrate the cost model on measured runs and check its predictions.

Input: the JSON records of ``benchmarks/throughput.py`` (dicts; the CLI reads the files).
Each holds the model, the layout, the measured step time and split, the measured per-rank
matmul peak and the probes (all-reduce bus bandwidth, latency per ring step, memory copy
bandwidth). From them:

- :func:`measured_cluster`: a :class:`Cluster` of the machine the runs were measured on
  (peak = median measured matmul peak, bandwidths and latency from the probes, no
  communication overlap: on a CPU, communication and compute share the cores), and
  :func:`run_cluster` the same with the peak measured by runs of the same rank count (on
  a shared CPU two ranks get less of a core each than one rank does);
- :func:`fit_efficiency`: the one free parameter, ``compute_efficiency``, as the median
  ratio of the model's FLOPs at peak to the measured forward + backward compute time over
  the runs without a pipeline;
- :func:`check_runs`: predicted vs measured step time for every run.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any, Mapping, Sequence

from engine.errors import ConfigError
from engine.models.config import ModelConfig
from engine.planner.cluster import Cluster, GiB
from engine.planner.cost import Layout, time_estimate

__all__ = ["run_layout", "measured_cluster", "run_cluster", "fit_efficiency", "check_runs", "median_runs", "PARAM_BYTES"]

PARAM_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}


def run_layout(run: Mapping[str, Any]) -> tuple[ModelConfig, Layout, float]:
    """(model, layout, compute-dtype bytes) of a throughput record."""
    try:
        model = ModelConfig.from_dict(dict(run["model"]))
        lay = run["layout"]
        pp = int(lay["pp"])
        schedule = run.get("schedule") or "none"
        layout = Layout(dp=int(lay["dp"]), tp=int(lay["tp"]), pp=pp, micro_batch=int(run["micro_batch"]),
                        num_microbatches=int(run["grad_accum"]), zero_stage=int(run["zero_stage"]),
                        schedule=schedule if pp > 1 else "none",
                        virtual_stages=2 if schedule == "interleaved-1f1b" else 1,
                        cp=int(lay.get("cp", 1)), cp_mode=str(lay.get("cp_mode", "ring")))  # records without CP: 1
        return model, layout, PARAM_BYTES[run["precision"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"not a benchmarks/throughput.py record ({exc!r}): rerun it with --json") from exc


def median_runs(runs: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """One record per configuration (config file, overrides, ranks): of repeated runs, the
    one with the median step time (a shared machine's noise is in the repetitions)."""
    groups: dict[tuple, list] = {}
    for r in runs:
        key = (r.get("config"), tuple(r.get("overrides", [])), r.get("ranks"))
        groups.setdefault(key, []).append(r)
    out = []
    for recs in groups.values():
        recs = sorted(recs, key=lambda r: r["step_ms"]["median"])
        out.append(recs[(len(recs) - 1) // 2])
    return out


def measured_cluster(runs: Sequence[Mapping[str, Any]], efficiency: float = 1.0) -> Cluster:
    """The machine of the runs, from their measured peaks and probes."""
    if not runs:
        raise ConfigError("no runs to calibrate on")
    peaks = [p for r in runs for p in r["peak_flops_per_rank"] if p]
    probes = [r.get("probes") or {} for r in runs]
    bw = [p["allreduce_busbw"] for p in probes if "allreduce_busbw" in p]
    lat = [p["latency_s"] for p in probes if "latency_s" in p]
    mem = [p["memory_bw"] for p in probes if "memory_bw" in p]
    if not peaks or not bw or not mem:
        raise ConfigError("the runs carry no measured peak / probes (throughput.py records with probes needed)")
    ranks = max(int(r["ranks"]) for r in runs)
    med = statistics.median
    return Cluster(name="measured: " + str(runs[0].get("machine", {}).get("cpu", "?")), gpus_per_node=ranks,
                   nodes=1, memory_bytes=1024 * GiB, peak_flops=med(peaks), intra_node_bw=med(bw),
                   inter_node_bw=med(bw), hbm_bw=med(mem), compute_efficiency=efficiency,
                   latency_s=med(lat) if lat else 0.0, reserved_bytes=0.0, comm_overlap=0.0)


def run_cluster(run: Mapping[str, Any], pooled: Cluster, runs: Sequence[Mapping[str, Any]]) -> Cluster:
    """The machine as runs with ``run``'s number of ranks saw it: the median measured peak
    over those runs (ranks measure together, so the contention of that rank count is in
    it: on a shared CPU two ranks get less of a core each than one rank does); the pooled
    bandwidths and latency."""
    n = int(run.get("ranks", 1))
    peaks = [p for r in runs if int(r.get("ranks", 1)) == n for p in r.get("peak_flops_per_rank", []) if p]
    return replace(pooled, gpus_per_node=max(1, n), peak_flops=statistics.median(peaks) if peaks else pooled.peak_flops)


def _measured_compute_s(run: Mapping[str, Any]) -> float:
    s = run["split_ms_mean_over_ranks"]
    return (s["forward"] + s["backward"]) / 1e3


def fit_efficiency(runs: Sequence[Mapping[str, Any]]) -> float:
    """Median over the runs without a pipeline of (compute time at peak) / (measured forward
    + backward compute time)."""
    base = measured_cluster(runs, 1.0)
    ratios = []
    for r in runs:
        model, layout, pb = run_layout(r)
        if layout.pp > 1 or not r.get("split_ms_mean_over_ranks", {}).get("forward"):
            continue
        at_peak = time_estimate(model, layout, run_cluster(r, base, runs), param_bytes=pb).compute_s
        ratios.append(at_peak / _measured_compute_s(r))
    if not ratios:
        raise ConfigError("no run without a pipeline and with a time split to fit the compute efficiency on")
    return min(1.0, statistics.median(ratios))


def check_runs(runs: Sequence[Mapping[str, Any]], cluster: Cluster) -> list[dict[str, Any]]:
    """Predicted vs measured step time (ms) per run (with the peak of its rank count:
    :func:`run_cluster`), with the parts of the prediction."""
    out = []
    for r in runs:
        model, layout, pb = run_layout(r)
        c = run_cluster(r, cluster, runs)
        t = time_estimate(model, layout, c, param_bytes=pb)
        measured = r["step_ms"]["median"]
        out.append({
            "config": r.get("config"), "overrides": r.get("overrides", []), "layout": layout.describe(),
            "measured_ms": measured, "predicted_ms": 1e3 * t.step_s, "ratio": 1e3 * t.step_s / measured,
            "predicted_parts_ms": {"compute": 1e3 * t.compute_s, "tp_comm": 1e3 * t.tp_comm_s,
                                   "bubble": 1e3 * t.bubble_s, "dp_comm": 1e3 * t.dp_comm_s,
                                   "optimizer": 1e3 * t.optimizer_s},
            "measured_split_ms": r.get("split_ms_mean_over_ranks"),
        })
    return out
