"""V placement and the ZB-V schedule: stage_index, the order as data, the simulator's checks."""

import pytest

from engine.errors import ConfigError
from engine.pipeline.actions import Action, ActionKind, is_local_hop, next_hop, parse_action, prev_hop
from engine.pipeline.schedule import SCHEDULES, build_all, compute_order, loss_stage, stage_index
from engine.pipeline.simulate import ScheduleError, bubble_formula, check_actions, simulate
from engine.pipeline.vshape import _I_WORK, _memory_peak

K = ActionKind


def test_stage_index_loop_and_v():
    # loop placement: chunk c of rank r is c*p + r (interleaved 1F1B; the rank with one chunk)
    assert [stage_index("1f1b", r, 0, 4) for r in range(4)] == [0, 1, 2, 3]
    assert [stage_index("interleaved-1f1b", r, c, 4, 2) for c in range(2) for r in range(4)] == list(range(8))
    # V: rank r holds r and 2p-1-r; the first and the last stage are both on rank 0
    assert [(stage_index("zb-v", r, 0, 4, 2), stage_index("zb-v", r, 1, 4, 2)) for r in range(4)] == [
        (0, 7), (1, 6), (2, 5), (3, 4)]
    with pytest.raises(ConfigError, match="chunk"):
        stage_index("zb-v", 0, 2, 4, 2)


def test_v_hops_turn_locally_on_the_last_rank():
    p = 3
    assert next_hop(2, 0, p, 2, "v") == (2, 1) and is_local_hop(2, next_hop(2, 0, p, 2, "v"))
    assert prev_hop(2, 1, p, "v") == (2, 0)
    assert next_hop(1, 1, p, 2, "v") == (0, 1) and next_hop(0, 1, p, 2, "v") is None
    assert prev_hop(0, 0, p, "v") is None and not is_local_hop(0, next_hop(0, 0, p, 2, "v"))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16])
def test_zb_v_every_compute_once_and_simulated(p, m):
    per_rank = build_all("zb-v", p, m, 2)
    for r in range(p):
        compute = [a for a in per_rank[r] if a.is_compute]
        assert compute == compute_order("zb-v", r, p, m, 2)
        # model stage 0 (rank 0, chunk 0) has no input gradient: one full backward B there
        split = [c for c in range(2) if (r, c) != (0, 0)]
        want = {K.FORWARD: [(i, c) for i in range(m) for c in range(2)],
                K.BACKWARD: [(i, 0) for i in range(m)] if r == 0 else [],
                K.BACKWARD_INPUT: [(i, c) for i in range(m) for c in split],
                K.BACKWARD_WEIGHT: [(i, c) for i in range(m) for c in split]}
        for kind, pairs in want.items():
            assert sorted((a.microbatch, a.chunk) for a in compute if a.kind is kind) == pairs, (r, kind)
    res = simulate(per_rank, m, 2, placement="v")
    # memory: at most 2p half-stage chunks (p stages, as 1F1B's rank 0), and within the order
    # search's modelled budget (a pending W, an input pass's working memory, the loss chunk)
    assert max(res.peak_activations) <= 2 * p
    assert max(_memory_peak(per_rank[r], r) for r in range(p)) <= 2 * p + _I_WORK + 1e-9
    # uneven costs and communication latency: still valid, no deadlock
    simulate(per_rank, m, 2, costs=lambda r, a: 1.0 + 0.3 * r + (0.7 if a.kind is K.BACKWARD_WEIGHT else 0.0),
             comm_cost=0.4, placement="v")


COSTS = {"F": 0.5, "B": 1.0, "I": 0.5, "W": 0.5}  # a chunk is half of a stage (f=1, b=2)


# (within the memory budget the order search does not reach the bound at every m: at p = 2 the
# budget costs one unit (test_zb_v_p2_pays_one_unit_for_memory), at p = 3 and 4 some m a few;
# test_zb_v_bubble_above_the_bound_below_1f1b covers those)
@pytest.mark.parametrize("p,m", [(4, 4), (4, 8)])
def test_zb_v_bubble_is_the_analytic_lower_bound(p, m):
    res = simulate(build_all("zb-v", p, m, 2), m, 2, costs=COSTS, placement="v")
    assert res.bubble_fraction == pytest.approx(bubble_formula("zb-v", p, m), abs=1e-9)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [4, 5, 9, 12, 16])
def test_zb_v_bubble_above_the_bound_below_1f1b(p, m):
    if m < p:
        pytest.skip("the bound assumes m >= p")
    res = simulate(build_all("zb-v", p, m, 2), m, 2, costs=COSTS, placement="v")
    assert res.bubble_fraction >= bubble_formula("zb-v", p, m) - 1e-9  # a lower bound
    assert res.bubble_fraction < simulate(build_all("1f1b", p, m), m).bubble_fraction


def test_zb_v_p4_m8_figures():
    res = simulate(build_all("zb-v", 4, 8, 2), 8, 2, placement="v")
    assert res.bubble_fraction == pytest.approx(3 / 51)  # (p-1)/(6m+p-1); 1F1B: 3/11
    # 2p chunks = p stages at most, 1F1B's rank 0 (1F1B: 4, 3, 2, 1 stages)
    assert res.peak_activations == (7, 8, 8, 8)


@pytest.mark.parametrize("m", [4, 8])
def test_zb_v_p2_pays_one_unit_for_memory(m):
    """At p = 2 the plans on the bound keep the loss chunk's W (the logits' gradient) pending
    while rank 0 holds 2p chunks; the kept plan runs that W right after its I (measured: zb-v's
    peak below 1F1B's, benchmarks/results/zb-v_memory_cpu-2core_2026-11-27b.md) at one unit."""
    per_rank = build_all("zb-v", 2, m, 2)
    res = simulate(per_rank, m, 2, costs=COSTS, placement="v")
    assert res.bubble_fraction == pytest.approx(1 - 6 * m / (6 * m + 2), abs=1e-9)  # bound: 1 - 6m / (6m + 1)
    rank0 = [a for a in per_rank[0] if a.is_compute]
    for i, a in enumerate(rank0):
        if a.kind is K.BACKWARD_INPUT and a.chunk == 1:
            assert rank0[i + 1] == Action(K.BACKWARD_WEIGHT, a.microbatch, 1), rank0


def test_local_hop_has_no_transfer_and_keeps_its_order():
    per_rank = [list(r) for r in build_all("zb-v", 2, 1, 2)]
    assert not any(a.is_comm and a.chunk == 1 and a.kind in (K.RECV_ACT, K.SEND_GRAD) for a in per_rank[1])
    bad = [list(r) for r in per_rank]
    bad[1].insert(0, parse_action("RECV_ACT0.1"))
    with pytest.raises(ScheduleError, match="local hop"):
        check_actions(bad, 1, 2, placement="v")
    swapped = [list(r) for r in per_rank]
    i, j = swapped[1].index(Action(K.FORWARD, 0)), swapped[1].index(Action(K.FORWARD, 0, 1))
    swapped[1][i], swapped[1][j] = swapped[1][j], swapped[1][i]
    with pytest.raises(ScheduleError, match="local producer"):
        check_actions(swapped, 1, 2, placement="v")


def test_zb_v_arguments():
    assert "zb-v" in SCHEDULES
    with pytest.raises(ConfigError, match="two model chunks"):
        build_all("zb-v", 4, 8, 1)
    with pytest.raises(ConfigError, match="at least 2"):
        build_all("zb-v", 1, 8, 2)


@pytest.mark.parametrize("name", ["zb-v", "dualpipe-v"])
def test_config_takes_v_schedules_with_two_chunks(name):
    from engine.config import load_config

    def cfg(**pipe):
        return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8,
                "pipeline": {"stages": 2, "schedule": name, "virtual_stages": 2, **pipe}}

    got = load_config(cfg(), world_size=2).pipeline
    assert (got.schedule, got.virtual_stages, got.stages) == (name, 2, 2)
    with pytest.raises(ConfigError, match="exactly two model chunks.*set pipeline.virtual_stages to 2"):
        load_config(cfg(virtual_stages=1), world_size=2)
    with pytest.raises(ConfigError, match="needs pipeline.stages >= 2"):
        load_config(cfg(stages=1), world_size=1)


# ------------------------------------------------------------------ DualPipeV
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("extra", [0, 1, 3, 8])
def test_dualpipe_v_every_compute_once_and_simulated(p, extra):
    m = 2 * p + extra
    per_rank = build_all("dualpipe-v", p, m, 2)
    for r in range(p):
        compute = [a for a in per_rank[r] if a.is_compute]
        assert compute == compute_order("dualpipe-v", r, p, m, 2)
        fwd = sorted((a.microbatch, a.chunk) for a in compute if a.kind is K.FORWARD)
        assert fwd == [(i, c) for i in range(m) for c in range(2)]
        # each (micro-batch, chunk) one full backward B, or an input grad I and its weight grad W
        full = {(a.microbatch, a.chunk) for a in compute if a.kind is K.BACKWARD}
        inp = sorted((a.microbatch, a.chunk) for a in compute if a.kind is K.BACKWARD_INPUT)
        wgt = sorted((a.microbatch, a.chunk) for a in compute if a.kind is K.BACKWARD_WEIGHT)
        assert inp == wgt and not full & set(inp) and sorted(full | set(inp)) == fwd
        assert inp, "the zero-bubble phases split some backwards"
    res = simulate(per_rank, m, 2, placement="v")
    assert max(res.peak_activations) <= 2 * p + 1
    assert res.bubble_fraction < simulate(build_all("1f1b", p, m), m).bubble_fraction
    simulate(per_rank, m, 2, costs=lambda r, a: 1.0 + 0.3 * r + (0.7 if a.kind is K.BACKWARD_WEIGHT else 0.0),
             comm_cost=0.4, placement="v")


def test_dualpipe_v_overlapped_pairs_are_adjacent_and_few_microbatches_are_refused():
    # phase 4 of rank 0 at p 2, m 6: F0 B1 F1 B0 pairs (forward of one chunk, backward of the other)
    order = [str(a) for a in compute_order("dualpipe-v", 0, 2, 6, 2)]
    assert "F3 B1.1 F2.1 B0 F4 B2.1 F3.1 B1" in " ".join(order)
    with pytest.raises(ConfigError, match="at least 2 x pipeline stages = 8 micro-batches"):
        build_all("dualpipe-v", 4, 7, 2)


def test_loss_stage_is_rank_0_in_v_placement():
    assert [loss_stage(s, 4, v) for s, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-v", 2))] == [3, 3, 0]
