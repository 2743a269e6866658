"""Context parallelism in the planner: the Layout's CP degree and mode, the memory model (S/cp
tokens per rank, ZeRO over cp x dp, the CP attention's saved positions), the time model (ring
and Ulysses communication), the search at cp > 1, and --write-config's context_parallel
section loading and running (its measured activation peak against the prediction, 10%)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from engine.config import load_config
from engine.models.config import ModelConfig
from engine.planner import cluster_preset, model_preset
from engine.planner.cost import (
    Layout,
    activation_peaks,
    check_layout,
    cp_comm_seconds,
    model_states_bytes,
    time_estimate,
)
from engine.planner.search import enumerate_layouts, format_plans, plan
from engine.planner.write import layout_config, layout_of_config

TINY = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2, seq_len=128)


def test_layout_cp_validation_world_size_and_describe():
    lay = Layout(dp=2, tp=2, pp=2, micro_batch=1, num_microbatches=4, zero_stage=1, schedule="1f1b", cp=4,
                 cp_mode="ulysses")
    assert lay.world_size == 32 and lay.grad_ranks == 8 and lay.ulysses_size == 4
    assert "cp4(ulysses)" in lay.describe()
    plain = Layout(dp=2, tp=2, pp=1, micro_batch=1, num_microbatches=4, zero_stage=1)
    assert plain.cp == 1 and plain.world_size == 4 and "cp" not in plain.describe()
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="Layout.cp must be"):
            Layout(dp=1, tp=1, pp=1, micro_batch=1, num_microbatches=1, zero_stage=0, cp=bad)  # type: ignore
    with pytest.raises(ValueError, match="hybrid"):
        Layout(dp=1, tp=1, pp=1, micro_batch=1, num_microbatches=1, zero_stage=0, cp=2, cp_mode="hybrid")


def test_check_layout_uses_the_engines_cp_rules():
    cluster = replace(cluster_preset("h100", nodes=1), gpus_per_node=2)
    odd = replace(TINY, seq_len=130)  # not a multiple of 2 x cp
    lay = Layout(dp=1, tp=1, pp=1, micro_batch=1, num_microbatches=1, zero_stage=0, cp=2)
    assert any("2 x context_parallel.size" in w for w in check_layout(odd, lay, cluster))
    assert check_layout(TINY, lay, cluster) == []
    # Ulysses over 16 ranks: 8 query heads are not divisible by 16
    uly = Layout(dp=1, tp=1, pp=1, micro_batch=1, num_microbatches=1, zero_stage=0, cp=16, cp_mode="ulysses")
    assert any("ulysses_size" in w for w in check_layout(replace(TINY, seq_len=256), uly,
                                                          replace(cluster, gpus_per_node=16)))


def test_cp_divides_activations_and_zero_shards_over_cp_times_dp():
    model = model_preset("llama3-8b")
    base = Layout(dp=2, tp=2, pp=1, micro_batch=1, num_microbatches=8, zero_stage=3)
    cp2 = replace(base, dp=1, cp=2)
    a1, a2 = activation_peaks(model, base)[0], activation_peaks(model, cp2)[0]
    assert 0.45 < a2 / a1 < 0.55  # S/2 tokens per rank, plus the saved positions
    # ZeRO-3 over cp x dp = 2 ranks in both: the same model states
    assert model_states_bytes(model, cp2) == pytest.approx(model_states_bytes(model, base))
    assert model_states_bytes(model, replace(base, cp=2)) < model_states_bytes(model, base)


def test_cp_time_model_ring_hides_behind_attention_ulysses_does_not():
    cluster = cluster_preset("h100", nodes=1)
    long = replace(model_preset("llama3-8b"), seq_len=65536)
    ring = Layout(dp=1, tp=1, pp=1, micro_batch=1, num_microbatches=4, zero_stage=3, cp=8)
    uly = replace(ring, cp_mode="ulysses")
    # 64k tokens: the K/V hops hide behind the attention; only the backward's last fp32
    # dK/dV hop (after the last block) is exposed
    lay_tokens = 65536 // 8
    kv_dim = long.kv_heads * long.head_dim
    last_acc = 2 * lay_tokens * kv_dim * 4 / cluster.intra_node_bw + cluster.latency_s
    assert cp_comm_seconds(long, ring, cluster) == (0.0, pytest.approx(last_acc))
    f, b = cp_comm_seconds(long, uly, cluster)
    assert f > 0 and b > 0
    short = replace(long, seq_len=2048)  # little attention to hide the ring behind
    assert cp_comm_seconds(short, replace(ring, micro_batch=1), replace(cluster, intra_node_bw=1e9))[0] > 0
    t = time_estimate(long, uly, cluster)
    assert t.cp_comm_s == pytest.approx(4 * 32 * (f + b))
    # per-rank compute falls with cp (S/cp tokens; the head-tail shards balance the causal attention)
    t8 = time_estimate(long, ring, cluster)
    t1 = time_estimate(long, replace(ring, cp=1, dp=8), cluster)
    assert t8.compute_s == pytest.approx(t1.compute_s / 8, rel=1e-9)


@pytest.mark.parametrize("mode,kv,cp", [("ring", 2, 2), ("ring", 2, 4), ("ulysses", 2, 2), ("ulysses", 1, 4)])
def test_cp_comm_bytes_are_the_engines_documented_volume(mode, kv, cp):
    """At 1 byte/s, no latency and no overlap the seconds are the bytes each rank sends, which
    must be docs/context_parallel.md's table (benchmarks/context_parallel.py formula_bytes, which
    equals the bytes the engine hands to isend / all-to-all / all-gather in every mode of
    benchmarks/results/context_parallel_cpu.md)."""
    from benchmarks.context_parallel import formula_bytes

    cluster = replace(cluster_preset("h100", nodes=1), intra_node_bw=1.0, latency_s=0.0, comm_overlap=0.0)
    model = replace(TINY, num_kv_heads=kv, seq_len=256)
    lay = Layout(dp=1, tp=1, pp=1, micro_batch=2, num_microbatches=1, zero_stage=0, cp=cp, cp_mode=mode)
    f, b = cp_comm_seconds(model, lay, cluster, param_bytes=4.0)
    u = cp if mode == "ulysses" else 1
    assert f + b == pytest.approx(formula_bytes(2, 256, 8, kv, 8, cp, u, elem=4))


def test_search_at_cp_gives_right_world_sizes_and_default_is_unchanged():
    cluster = replace(cluster_preset("h100", nodes=1), memory_bytes=1e15)
    model = replace(TINY, seq_len=256)
    kwargs = dict(micro_batches=(1,), zero_stages=(1,), schedules=("1f1b",), recompute=("none",))
    default = [lay for lay, _ in enumerate_layouts(model, cluster, 16, **kwargs)]
    assert default and all(lay.cp == 1 for lay in default)
    lays = [lay for lay, _ in enumerate_layouts(model, cluster, 16, cp_sizes=(1, 2, 4), cp_modes=("ring", "ulysses"),
                                                **kwargs)]
    assert {lay.cp for lay in lays} == {1, 2, 4} and {lay.cp_mode for lay in lays if lay.cp > 1} == {"ring", "ulysses"}
    assert all(lay.world_size == 8 and lay.dp * lay.tp * lay.pp * lay.cp == 8 for lay in lays)
    plans = plan(model, cluster, 16, cp_sizes=(2,), cp_modes=("ulysses",), **kwargs)
    assert any(p.feasible for p in plans) and "CP comm" in format_plans(plans)
    assert "CP comm" not in format_plans(plan(model, cluster, 16, **kwargs))


def test_write_config_round_trip_with_cp(tmp_path):
    lay = Layout(dp=2, tp=2, pp=2, micro_batch=1, num_microbatches=4, zero_stage=1, schedule="1f1b", cp=2,
                 cp_mode="ulysses")
    cfg = layout_config(replace(TINY, num_layers=4), lay)
    assert cfg["context_parallel"] == {"size": 2, "mode": "ulysses"}
    path = tmp_path / "cp.json"
    path.write_text(json.dumps(cfg))
    conf = load_config(str(path), world_size=lay.world_size)
    assert (conf.dp, conf.cp, conf.context_parallel.mode) == (2, 2, "ulysses")
    assert layout_of_config(conf) == lay
    assert "context_parallel" not in layout_config(TINY, replace(lay, cp=1, dp=4))


def test_cli_searches_cp_and_writes_a_loadable_config(tmp_path, capsys):
    from engine.planner.__main__ import main

    out = tmp_path / "plan.json"
    rc = main(["plan", "--layers", "2", "--hidden", "64", "--heads", "8", "--kv-heads", "2", "--vocab", "256",
               "--seq", "128", "--cluster", "h100", "--nodes", "1", "--gpus-per-node", "4", "--global-batch", "8",
               "--micro-batches", "1", "--zero", "1", "--cp", "2", "4", "--cp-modes", "ring", "ulysses",
               "--write-config", str(out)])
    assert rc == 0 and "CP comm" in capsys.readouterr().out
    conf = load_config(str(out), world_size=4)
    assert conf.cp in (2, 4) and conf.dp * conf.tp * conf.pp * conf.cp == 4
    assert layout_of_config(conf).cp == conf.cp


@pytest.mark.timeout(300)
def test_written_cp_config_runs_and_its_peak_matches_the_plan():
    """The ring layout the planner writes runs on 2 gloo ranks; its measured activation peak is
    the planner's within 10% (fp32, so the probe's count is exact)."""
    from benchmarks.activation_memory_planner import MICRO, _measure_rank
    from engine.distributed.spawn import spawn

    lay = Layout(dp=1, tp=1, pp=1, micro_batch=MICRO, num_microbatches=1, zero_stage=1, cp=2)
    cfg = layout_config(TINY, lay, param_bytes=4.0)
    out = spawn(_measure_rank, lay.world_size, (cfg,), timeout=240)
    pred = activation_peaks(TINY, lay, param_bytes=4.0)[0]
    for r in out:
        assert abs(pred - r["activation_peak_bytes"]) <= 0.10 * r["activation_peak_bytes"], (pred, r)
