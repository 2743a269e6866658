"""benchmarks/pipeline_memory.py runs end to end on a tiny model (2 stages, 1F1B and zb-v) and
reports every rank's measured activation peak next to the simulator's chunks in flight. The
figures themselves are the benchmark's (benchmarks/results/), not asserted here."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks import pipeline_memory  # noqa: E402


def test_pipeline_memory_reports_each_rank_of_each_schedule(capsys):
    assert pipeline_memory.main(["--stages", "2", "--microbatches", "2", "--micro", "1", "--seq", "16",
                                 "--hidden", "32", "--layers", "2", "--vocab", "64", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    for name in ("1f1b", "zb-v"):
        ranks = res["schedules"][name]
        assert [r["rank"] for r in ranks] == [0, 1]
        assert all(r["activation_peak"] > 0 and r["predicted_chunks"] >= 1 for r in ranks), ranks
