"""The planner's predicted per-rank peak (engine.planner.cost.peak_estimate) against the
peaks benchmarks/memory.py measured (benchmarks/results/zero_peak_110m_dp4.json: the reference
GPT at DP = 4, ZeRO 0-3; the exact tensor high-water mark of the worst rank). The
prediction is recomputed here from the row's config, so a change to the planner or to the
engine's memory that breaks the agreement fails this test. Tolerance: 15% (the issue's)."""

import json
import os

from engine.models.config import ModelConfig
from engine.planner.cost import Layout, peak_estimate

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results", "zero_peak_110m_dp4.json")


def _rows():
    with open(RESULTS, encoding="utf-8") as fh:
        data = json.load(fh)
    a = data["args"]
    model = ModelConfig(vocab_size=a["vocab"], hidden_size=a["hidden"], num_layers=a["layers"],
                        num_heads=a["heads"], seq_len=a["seq"])
    return model, a, [r for r in data["rows"] if "tensor_peak" in r.get("ours", {})]


def test_the_table_covers_every_stage_at_dp4_with_a_100m_model():
    model, a, rows = _rows()
    from engine.models import param_count

    assert param_count(model) >= 100e6 and a["dp"] == 4
    assert {r["stage"] for r in rows} == {0, 1, 2, 3}


def test_predicted_peak_within_15_percent_of_measured():
    model, a, rows = _rows()
    for r in rows:
        layout = Layout(dp=r["dp"], tp=1, pp=1, micro_batch=a["micro"], num_microbatches=r["ga"],
                        zero_stage=r["stage"])
        pred = peak_estimate(model, layout, param_bytes=2 if r["dtype"] == "bf16" else 4,
                             bucket_numel=r["inputs"]["bucket_numel"], prefetch_numel=a["bucket"],
                             torch_adam=not a.get("fused_adam", False))["peak"]
        measured = max(r["ours"]["tensor_peak"])
        assert abs(pred - measured) <= 0.15 * measured, (r["stage"], r["dtype"], r["ga"], pred, measured)
