"""The planner models zb-v (two chunks per rank in V placement): pieces by stage_index, the
tied embedding and head counted once on rank 0, the simulator in V placement, the search."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.models.config import ModelConfig
from engine.pipeline.schedule import build_all
from engine.pipeline.simulate import bubble_formula, simulate
from engine.planner import Cluster, Layout, cluster_preset, memory_estimate, pipeline_makespan, plan, time_estimate
from engine.planner.cost import activation_peaks, check_layout, model_states_bytes, peak_estimate, stage_shapes

SMALL = ModelConfig(vocab_size=64, hidden_size=256, num_layers=8, num_heads=4, seq_len=128)
FREE: Cluster = replace(cluster_preset("h100", nodes=1), gpus_per_node=4, intra_node_bw=1e30, inter_node_bw=1e30,
                        latency_s=0.0)


def _layout(**kw) -> Layout:
    base = dict(dp=1, tp=1, pp=4, micro_batch=1, num_microbatches=8, zero_stage=0, schedule="zb-v",
                virtual_stages=2)
    base.update(kw)
    return Layout(**base)


def test_zb_v_layouts_are_accepted_with_two_chunks():
    assert check_layout(SMALL, _layout(), FREE) == []
    assert any("two model chunks" in w for w in check_layout(SMALL, _layout(virtual_stages=1), FREE))


def test_rank_0_holds_the_first_and_last_piece_and_the_tied_matrix_once():
    big_vocab = replace(SMALL, vocab_size=32768)
    vh = big_vocab.vocab_size * big_vocab.hidden_size
    shapes = stage_shapes(big_vocab, 4, 2)
    v_rank0 = shapes[0].params + shapes[7].params - vh  # embedding piece + head piece, one matrix
    loop_last = shapes[3].params + shapes[7].params  # interleaved: rank 3 holds the head's copy
    per_param = 2 + 4 + 12  # bf16 param, fp32 grad, Adam (ZeRO-0)
    assert model_states_bytes(big_vocab, _layout(), param_bytes=2.0) == pytest.approx(v_rank0 * per_param)
    inter = _layout(schedule="interleaved-1f1b")
    assert model_states_bytes(big_vocab, inter, param_bytes=2.0) == pytest.approx(
        max(loop_last, shapes[0].params + shapes[4].params) * per_param)


def test_zb_v_bubble_and_activations_come_from_the_v_simulation():
    _, bubble, _ = pipeline_makespan(SMALL, _layout(), FREE)
    _, one_f, _ = pipeline_makespan(SMALL, _layout(schedule="1f1b", virtual_stages=1), FREE)
    assert bubble < one_f / 2
    # the planner's costs are not uniform (the head's piece is heavier): the simulator with the
    # same per-piece costs is the reference, not the uniform formula
    assert bubble == pytest.approx(bubble_formula("zb-v", 4, 8), abs=0.08)
    mem = memory_estimate(SMALL, _layout(), FREE)
    peaks = simulate(build_all("zb-v", 4, 8, 2), 8, 2, placement="v").peak_activations
    assert mem.inflight_microbatches == peaks[mem.stage]
    # the activation peak walks the V compute order on every rank; zb-v keeps its graphs and
    # captured gradients until the weight passes, so it holds more than 1F1B's rank 0
    acts = activation_peaks(SMALL, _layout())
    one_f_acts = activation_peaks(SMALL, _layout(schedule="1f1b", virtual_stages=1))
    assert len(acts) == 4 and min(acts) > 0 and max(acts) > max(one_f_acts)
    assert peak_estimate(SMALL, _layout())["peak"] > max(acts)
    assert time_estimate(SMALL, _layout(), FREE).bubble_fraction == pytest.approx(bubble)


def test_the_search_takes_zb_v_when_named():
    plans = plan(SMALL, FREE, 8, micro_batches=(1,), zero_stages=(0,), recompute=("none",),
                 schedules=("1f1b", "zb-v"))
    found = {(p.layout.schedule, p.layout.virtual_stages) for p in plans if p.layout.pp == 4 and not p.reasons}
    assert ("zb-v", 2) in found and ("1f1b", 1) in found


def test_dualpipe_v_is_modelled_and_needs_2p_microbatches():
    lay = _layout(schedule="dualpipe-v")
    assert check_layout(SMALL, lay, FREE) == []
    assert any("2 x pipeline stages" in w for w in check_layout(SMALL, _layout(schedule="dualpipe-v",
                                                                                num_microbatches=6), FREE))
    _, bubble, _ = pipeline_makespan(SMALL, lay, FREE)
    _, one_f, _ = pipeline_makespan(SMALL, _layout(schedule="1f1b", virtual_stages=1), FREE)
    assert 0 < bubble < one_f
    # longer than the simulated length: extrapolated from at least 2p micro-batches
    assert pipeline_makespan(SMALL, _layout(pp=4, schedule="dualpipe-v", num_microbatches=64), FREE)[0] > 0
