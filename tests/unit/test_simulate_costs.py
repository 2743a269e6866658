"""The one pipeline cost table and bubble measure (engine/pipeline/simulate.py) behind the
simulator, the communication placement, the planner and the measured bubble."""

import pytest

from engine.pipeline.actions import Action, ActionKind
from engine.pipeline.schedule import build_all
from engine.pipeline.simulate import (
    DEFAULT_COSTS,
    bubble_formula,
    bubble_fraction,
    cost_table,
    per_stage_costs,
    simulate,
)
from engine.pipeline.timeline import measured_bubble


def test_cost_table_splits_the_backward():
    assert DEFAULT_COSTS == {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    assert cost_table(3.0, 4.0) == {"F": 3.0, "B": 4.0, "I": 2.0, "W": 2.0}
    assert cost_table(1.0, 2.0, input_grad=0.5) == {"F": 1.0, "B": 2.0, "I": 0.5, "W": 1.5}


def test_per_stage_costs_index_virtual_stages_chunk_major():
    p = 2
    cost = per_stage_costs([1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0], p)
    assert cost(1, Action(ActionKind.FORWARD, 0, 1)) == 4.0  # chunk 1 on rank 1: piece 3
    assert cost(0, Action(ActionKind.BACKWARD, 0, 1)) == 30.0
    assert cost(1, Action(ActionKind.BACKWARD_WEIGHT, 0, 0)) == 10.0


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 8, 1), ("interleaved-1f1b", 2, 4, 2), ("gpipe", 3, 5, 1)])
def test_simulated_bubble_is_the_formula_and_the_measured_bubble_of_its_timeline(name, p, m, v):
    res = simulate(build_all(name, p, m, v), m, v)
    assert res.bubble_fraction == pytest.approx(bubble_formula(name, p, m, v))
    # the simulator's timeline read as executor records gives the same bubble through timeline.py
    records = [[{"kind": t.action.kind.value, "start": t.start, "end": t.end} for t in rank if t.action.is_compute]
               for rank in res.timeline]
    assert measured_bubble(records) == pytest.approx(res.bubble_fraction)
    assert bubble_fraction([1.0, 0.5], 1.0) == 0.25 and bubble_fraction([0.0], 0.0) == 0.0
