"""The schedule simulator: every schedule over many (stages, microbatches) passes it and
meets its analytic bubble; broken schedules are caught with a message naming the problem."""

import pytest

from engine.pipeline.actions import ScheduleError, parse_action
from engine.pipeline.schedule import build_all
from engine.pipeline.simulate import bubble_formula, format_timeline, simulate

# Many (p, m) pairs, kept fast: every m <= 8 plus a few large ones up to 32.
MICROBATCHES = list(range(1, 9)) + [12, 16, 23, 32]
STAGES = list(range(1, 9))
EQUAL = {"F": 1.0, "B": 1.0, "I": 0.5, "W": 0.5}
B2F = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # backward = 2 x forward


def _acts(text_rows):
    return [[parse_action(t) for t in row.split()] for row in text_rows]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_1f1b_bubble_and_memory(name):
    for p in STAGES:
        for m in MICROBATCHES:
            per_rank = build_all(name, p, m)
            for costs in (EQUAL, B2F):
                r = simulate(per_rank, m, costs=costs)
                # exact: all costs are small binary fractions
                assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (p, m)
            if name == "1f1b":
                assert all(r.peak_activations[s] <= p - s for s in range(p)), (p, m, r.peak_activations)
                assert r.peak_activations[0] == min(p, m)
            else:
                assert r.peak_activations == (m,) * p


def test_interleaved_bubble():
    for p in range(2, 9):
        for m in sorted({p, 2 * p} | {k for k in (16, 32) if k % p == 0}):
            for v in (2, 3, 4) if p <= 4 else (2, 3):
                per_rank = build_all("interleaved-1f1b", p, m, v)
                for costs in (EQUAL, B2F):
                    r = simulate(per_rank, m, v, costs=costs)
                    assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12), (p, m, v)
                    assert r.bubble_fraction == pytest.approx(bubble_formula("interleaved-1f1b", p, m, v))


def test_zb_h1_bubble_is_a_third_of_1f1b():
    for p in STAGES:
        for m in MICROBATCHES:
            r = simulate(build_all("zb-h1", p, m), m, costs=B2F)
            ref = simulate(build_all("1f1b", p, m), m, costs=B2F)
            assert max(r.peak_activations) <= p  # 1F1B's peak (stage 0), held until W
            if m >= p:
                # idle time per rank: (p-1)(F+I-W) = (p-1) vs 1F1B's (p-1)(F+B) = 3(p-1)
                idle = r.makespan - r.busy[0]
                idle_ref = ref.makespan - ref.busy[0]
                assert idle == pytest.approx(idle_ref / 3, abs=1e-12), (p, m)
                assert r.bubble_fraction == pytest.approx(bubble_formula("zb-h1", p, m), abs=1e-12)
            assert r.makespan <= ref.makespan


def test_all_schedules_pass_with_uneven_costs_and_comm_latency():
    # Deadlock freedom is structural: any positive costs, per-rank costs and comm latency.
    def costs(rank, a):
        return {"F": 1.0 + 0.3 * rank, "B": 2.5 - 0.2 * rank, "I": 1.1, "W": 0.7 + 0.1 * rank}[a.kind.value]

    for name, v in [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)]:
        for p in (2, 3, 5, 8):
            for m in (p, 2 * p, 3 * p):
                r = simulate(build_all(name, p, m, v), m, v, costs=costs, comm_cost=0.25)
                assert 0 < r.bubble_fraction < 1


def test_golden_1f1b_timeline():
    r = simulate(build_all("1f1b", 2, 3), 3, costs=B2F)
    assert format_timeline(r).splitlines() == [
        "stage 0: F0 F1 .  .  B0 B0 F2 B1 B1 .  B2 B2",
        "stage 1: .  F0 B0 B0 F1 B1 B1 F2 B2 B2 .  .",
    ]
    assert r.makespan == 12 and r.peak_activations == (2, 1)


# ------------------------------------------------------------------ broken schedules
def test_missing_backward_is_caught():
    rows = ["F0 SEND_ACT0 RECV_GRAD0 B0 F1 SEND_ACT1 RECV_GRAD1",
            "RECV_ACT0 F0 B0 SEND_GRAD0 RECV_ACT1 F1 B1 SEND_GRAD1"]
    with pytest.raises(ScheduleError, match="rank 0: microbatch 1 chunk 0 is missing B1"):
        simulate(_acts(rows), 2)


def test_duplicate_and_misordered_actions_are_caught():
    with pytest.raises(ScheduleError, match="duplicate"):
        simulate(_acts(["F0 F0 B0"]), 1)
    with pytest.raises(ScheduleError, match="comes before F0"):
        simulate(_acts(["B0 F0"]), 1)
    with pytest.raises(ScheduleError, match="comes before I0"):
        simulate(_acts(["F0 W0 I0"]), 1)
    with pytest.raises(ScheduleError, match="comes before RECV_ACT0"):
        simulate(_acts(["F0 SEND_ACT0 RECV_GRAD0 B0", "F0 RECV_ACT0 B0 SEND_GRAD0"]), 1)
    with pytest.raises(ScheduleError, match="mixes a full backward"):
        simulate(_acts(["F0 I0 B0 W0"]), 1)
    with pytest.raises(ScheduleError, match="microbatch 2 is outside"):
        simulate(_acts(["F0 B0 F2 B2"]), 2)


def test_unpaired_send_is_caught():
    # rank 0 sends the activation, rank 1 never receives it: each rank alone is fine
    # only if rank 1 is the first stage, which it is not - so the per-rank check names it.
    rows = ["F0 SEND_ACT0 RECV_GRAD0 B0", "F0 B0 SEND_GRAD0"]
    with pytest.raises(ScheduleError, match="rank 1.*comes before RECV_ACT0"):
        simulate(_acts(rows), 1)


def test_pair_order_mismatch_is_caught():
    # rank 1 receives microbatch 1 before microbatch 0: content-blind matching would swap them
    rows = ["F0 SEND_ACT0 F1 SEND_ACT1 RECV_GRAD0 B0 RECV_GRAD1 B1",
            "RECV_ACT1 RECV_ACT0 F0 B0 SEND_GRAD0 F1 B1 SEND_GRAD1"]
    with pytest.raises(ScheduleError, match="another order"):
        simulate(_acts(rows), 2)


def test_deadlock_is_detected():
    # rank 0 posts its gradient receive before sending the activation; on a FIFO stream the
    # receive waits for rank 1's backward, which waits for the activation behind it.
    rows = ["RECV_GRAD0 F0 SEND_ACT0 B0", "RECV_ACT0 F0 B0 SEND_GRAD0"]
    with pytest.raises(ScheduleError, match="deadlock: rank 0 .*rank 1"):
        simulate(_acts(rows), 1)


def test_gradient_before_activation_deadlocks():
    # rank 1 sends its gradient only after a forward that needs rank 0's second
    # activation, which rank 0 sends only after receiving that gradient.
    rows = ["F0 SEND_ACT0 RECV_GRAD0 B0 F1 SEND_ACT1 RECV_GRAD1 B1",
            "RECV_ACT0 RECV_ACT1 F0 F1 B0 SEND_GRAD0 B1 SEND_GRAD1"]
    with pytest.raises(ScheduleError, match="deadlock: rank 0 .*rank 1"):
        simulate(_acts(rows), 2)


def test_comm_latency_on_the_critical_path():
    rows = ["F0 SEND_ACT0 RECV_GRAD0 B0", "RECV_ACT0 F0 B0 SEND_GRAD0"]
    # F0, transfer, F0 + B0 on rank 1, transfer, B0 on rank 0
    assert simulate(_acts(rows), 1, costs=B2F).makespan == 6
    assert simulate(_acts(rows), 1, costs=B2F, comm_cost=0.5).makespan == 7


# ------------------------------------------------------------------ timeline of a recorded step
def _records():
    from engine.pipeline.executor import ActionRecord
    # stage 0: F0 [0,1] ... B0 [3,5]; stage 1: F0 [1,2] B0 [2,4]: 6 busy of 2 x 5
    return [[ActionRecord("F0", "F", 0, 0, 10.0, 11.0), ActionRecord("SEND_ACT0", "COMM", 0, 0, 11.0, 11.1),
             ActionRecord("WAIT", "WAIT", 0, 0, 11.1, 13.0), ActionRecord("B0", "B", 0, 0, 13.0, 15.0)],
            [ActionRecord("F0", "F", 0, 0, 11.0, 12.0), ActionRecord("B0", "B", 0, 0, 12.0, 14.0)]]


def test_measured_bubble_and_chrome_trace():
    from engine.pipeline.timeline import chrome_trace, measured_bubble

    assert measured_bubble(_records()) == pytest.approx(1 - 6 / 10)
    events = [e for e in chrome_trace(_records())["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["name"], e["ts"], e["dur"]) for e in events if e["cat"] == "F"] == [
        (1, "F0", 0.0, pytest.approx(1e6)), (2, "F0", pytest.approx(1e6), pytest.approx(1e6))]
    assert {e["tid"] for e in events if e["cat"] in ("COMM", "WAIT")} == {1}


def test_png_writers(tmp_path):
    import struct
    import zlib

    from engine.pipeline.timeline import write_gantt_png, write_png

    path = tmp_path / "raw.png"
    write_png(str(path), [[(255, 0, 0), (0, 0, 255)]] * 3)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (2, 3)  # IHDR width, height
    idat = data[data.index(b"IDAT") + 4:data.index(b"IEND") - 8]
    assert zlib.decompress(idat)[:7] == b"\x00\xff\x00\x00\x00\x00\xff"  # filter byte, red, blue
    gantt = tmp_path / "gantt.png"
    assert write_gantt_png(_records(), str(gantt)) in ("matplotlib", "raw")
    assert gantt.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_raw_gantt_raster_colours():
    from engine.pipeline import timeline

    px = timeline._raster(_records(), width=101, row=2, gap=1)  # 5 time units -> 20 px each
    stage0, stage1 = px[0], px[3]
    assert len(px) == 2 * 3 and len(stage0) == 101
    assert stage0[5] == timeline._COLOURS["F"] and stage0[30] == timeline._IDLE
    assert stage0[70] == timeline._COLOURS["B"] and stage1[30] == timeline._COLOURS["F"]
    assert stage1[90] == timeline._IDLE  # stage 1 finished at 4 of 5
