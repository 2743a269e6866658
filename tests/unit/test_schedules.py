"""Pipeline actions and schedules: printable form, structure, golden lists, errors."""

import dataclasses
import os

import pytest

from engine.errors import ConfigError
from engine.pipeline.actions import Action, ActionKind, comm_batches, next_hop, parse_action, prev_hop
from engine.pipeline.schedule import SCHEDULES, build_all, build_schedule, compute_order, format_table, schedule_table

ASSETS = os.path.join(os.path.dirname(__file__), "..", "assets")
F, B, I, W = "F", "B", "I", "W"


def _compute_str(acts):
    return " ".join(str(a) for a in acts if a.is_compute)


# ------------------------------------------------------------------ actions
def test_action_printable_form_round_trips():
    for text in ["F0", "B12", "I3", "W3", "SEND_ACT3", "RECV_ACT0.1", "SEND_GRAD2.3", "RECV_GRAD7"]:
        assert str(parse_action(text)) == text
    assert str(Action(ActionKind.FORWARD, 3, 0)) == "F3"
    assert str(Action(ActionKind.BACKWARD, 2, 1)) == "B2.1"
    assert Action("F", 1) == Action(ActionKind.FORWARD, 1)  # kind given by its prefix
    with pytest.raises(ValueError, match="cannot parse"):
        parse_action("X3")
    with pytest.raises(ValueError, match="non-negative"):
        Action(ActionKind.FORWARD, -1)


def test_actions_are_frozen_and_hashable():
    a = Action(ActionKind.FORWARD, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.microbatch = 2  # type: ignore[misc]
    assert len({a, Action(ActionKind.FORWARD, 1)}) == 1


def test_virtual_stage_route():
    # p=2, v=2: rank0 chunk0 -> rank1 chunk0 -> rank0 chunk1 -> rank1 chunk1
    assert next_hop(0, 0, 2, 2) == (1, 0)
    assert next_hop(1, 0, 2, 2) == (0, 1)
    assert next_hop(0, 1, 2, 2) == (1, 1)
    assert next_hop(1, 1, 2, 2) is None
    assert prev_hop(0, 1, 2) == (1, 0)
    assert prev_hop(0, 0, 2) is None


def test_comm_batches_group_consecutive_comm():
    acts = [parse_action(t) for t in "F0 SEND_ACT0 RECV_GRAD0 B0 SEND_GRAD0".split()]
    assert [(c, [str(a) for a in g]) for c, g in comm_batches(acts)] == [
        (False, ["F0"]), (True, ["SEND_ACT0", "RECV_GRAD0"]), (False, ["B0"]), (True, ["SEND_GRAD0"])]


# ------------------------------------------------------------------ golden lists
def test_golden_1f1b_p4_m8():
    with open(os.path.join(ASSETS, "golden_1f1b_p4_m8.txt")) as f:
        lines = [ln for ln in f.read().splitlines() if ln and not ln.startswith("#")]
    golden = [[parse_action(t) for t in ln.split(":", 1)[1].split()] for ln in lines]
    assert build_all("1f1b", 4, 8) == golden


def test_1f1b_compute_order_by_hand():
    # Written out independently of the implementation: warmup p-s-1 forwards, then
    # one-forward-one-backward, then the cooldown backwards.
    assert _compute_str(build_schedule("1f1b", 0, 4, 8)) == \
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert _compute_str(build_schedule("1f1b", 2, 4, 8)) == \
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7"
    assert _compute_str(build_schedule("1f1b", 3, 4, 8)) == \
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"


@pytest.mark.parametrize("p,m", [(1, 1), (2, 1), (3, 2), (4, 8), (8, 3), (8, 32)])
def test_1f1b_phases(p, m):
    for s in range(p):
        comp = compute_order("1f1b", s, p, m)
        warmup = min(p - s - 1, m)
        assert [a.kind.value for a in comp[:warmup]] == [F] * warmup
        steady = comp[warmup:warmup + 2 * (m - warmup)]
        assert [a.kind.value for a in steady] == [F, B] * (m - warmup)
        assert [a.kind.value for a in comp[warmup + 2 * (m - warmup):]] == [B] * warmup


def test_gpipe_is_all_forward_all_backward():
    assert _compute_str(build_schedule("gpipe", 1, 3, 4)) == "F0 F1 F2 F3 B0 B1 B2 B3"


def test_interleaved_by_hand():
    # p=2, v=2, m=4: microbatches in groups of p through chunk 0 then chunk 1
    assert _compute_str(build_schedule("interleaved-1f1b", 0, 2, 4, 2)) == \
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3"
    assert _compute_str(build_schedule("interleaved-1f1b", 1, 2, 4, 2)) == \
        "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3"


def test_zb_h1_by_hand():
    # Stage s defers each weight grad by s input-grad steps; the rest fill the cooldown.
    assert _compute_str(build_schedule("zb-h1", 0, 4, 8)) == \
        "F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7"
    assert _compute_str(build_schedule("zb-h1", 3, 4, 8)) == \
        "F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7"


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_every_compute_once(name, v):
    p, m = 4, 8
    for s in range(p):
        comp = compute_order(name, s, p, m, v)
        kinds = [W, I] if name == "zb-h1" else [B]
        for c in range(v):
            for mb in range(m):
                for k in [F] + kinds:
                    assert comp.count(Action(ActionKind(k), mb, c)) == 1


def test_comm_placement_send_after_producer_recv_before_consumer():
    for name, v in [("1f1b", 1), ("interleaved-1f1b", 3), ("zb-h1", 1), ("gpipe", 1)]:
        for acts in build_all(name, 4, 8, v):
            pos = {a: i for i, a in enumerate(acts)}
            for a, i in pos.items():
                if a.kind is ActionKind.SEND_ACT:
                    assert pos[Action(ActionKind.FORWARD, a.microbatch, a.chunk)] < i
                if a.kind is ActionKind.RECV_ACT:
                    assert pos[Action(ActionKind.FORWARD, a.microbatch, a.chunk)] > i


def test_tables_print():
    table = schedule_table("1f1b", 2, 2)
    assert table.splitlines()[0].split() == ["stage", "0:", "F0", "F1", "B0", "B1"]
    assert table.splitlines()[1].split() == ["stage", "1:", "F0", "B0", "F1", "B1"]
    full = format_table(build_all("1f1b", 2, 2), compute_only=False)
    assert "SEND_ACT0" in full and "RECV_GRAD1" in full


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("args,match", [
    (("pipedream", 0, 2, 4), "unknown pipeline.schedule"),
    (("1f1b", 2, 2, 4), "outside"),
    (("1f1b", 0, 0, 4), "num_stages"),
    (("gpipe", 0, 2, 0), "num_microbatches"),
    (("interleaved-1f1b", 0, 4, 6, 2), "multiple of the pipeline stages"),
    (("interleaved-1f1b", 0, 4, 2, 2), "multiple of the pipeline stages"),
    (("interleaved-1f1b", 0, 4, 8, 1), "virtual_stages >= 2"),
    (("interleaved-1f1b", 0, 1, 4, 2), "at least 2 pipeline stages"),
    (("1f1b", 0, 2, 4, 2), "needs schedule 'interleaved-1f1b'"),
])
def test_unsupported_combinations_are_clear_errors(args, match):
    with pytest.raises(ConfigError, match=match):
        build_schedule(*args)


def test_all_schedule_names():
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v")
