"""zb-v's measured activation peak per rank is at most 1F1B's at p = 2 (the issue's criterion,
benchmarks/results/zb-v_memory_cpu-2core_2026-11-27b.md) on a tiny model: equal pieces (every
zb-v chunk one block, every 1F1B stage two), the exact live-tensor high-water mark of
engine.zero.peak.LiveMemoryTracker (deterministic: no allocator, no other process). Before the
input pass freed as it went and the order kept the loss chunk's W eager, zb-v's largest rank held
more than 1F1B's (20.18 vs 16.42 MiB at the benchmark's size)."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks import pipeline_memory  # noqa: E402


def test_zb_v_peak_at_most_1f1b_at_p2():
    args = pipeline_memory.parse_args(["--stages", "2", "--microbatches", "4", "--micro", "1", "--seq", "32",
                                       "--hidden", "64", "--layers", "4", "--vocab", "256", "--partition", "blocks",
                                       "--schedules", "1f1b", "zb-v"])
    res = pipeline_memory.run(args)["schedules"]
    peak = {name: max(r["activation_peak"] for r in ranks) for name, ranks in res.items()}
    assert peak["zb-v"] <= peak["1f1b"], peak
