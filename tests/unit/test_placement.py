"""The typed placement a parameter carries (engine/placement.py): the value, its defaults,
that it survives what a model does to its parameters, and its round trip through the
checkpoint's TP slice."""

import dataclasses
import pickle

import pytest
import torch
import torch.nn as nn

from engine.checkpoint.format import TPSlice
from engine.checkpoint.layout import tp_slice_of
from engine.distributed.groups import NO_TP
from engine.placement import (
    REPLICATED,
    ExpertShard,
    Placement,
    TPShard,
    has_placement,
    placement_of,
    set_placement,
    tp_shard,
)
from engine.tensor_parallel.auto import AutoTPLinear
from engine.tensor_parallel.layers import ColumnParallelLinear, NormalInit, vocab_parallel_weight

# the placements the engine's layers give: column/row-parallel, fused q/k/v, padded vocab, tied head
USED = [REPLICATED, tp_shard(0), tp_shard(1), tp_shard(0, (8, 4, 4)), tp_shard(0, unpadded_size=50),
        Placement(tp=TPShard(0, None, 50), tied_copy=True), Placement(tied_copy=True)]


def test_defaults_are_replicated_and_untied():
    p = Placement()
    assert p == REPLICATED and p.tp is None and not p.tp_sharded
    assert not p.tied_copy and p.expert is None and not p.expert_sharded
    assert placement_of(torch.zeros(2)) is REPLICATED and not has_placement(torch.zeros(2))
    assert TPShard(1) == TPShard(1, None, None)


def test_frozen_and_hashable():
    p = tp_shard(0, [6, 3, 3])
    assert p.tp == TPShard(0, (6, 3, 3)) and p.tp_sharded
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.tied_copy = True  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.tp.dim = 1  # type: ignore[misc, union-attr]
    assert len({p, tp_shard(0, (6, 3, 3)), REPLICATED}) == 2
    assert dataclasses.replace(p, tied_copy=True).tp == p.tp


def test_expert_shard_is_a_field_only():
    p = Placement(expert=ExpertShard(first=2, count=2, num_experts=8))
    assert p.expert_sharded and not p.tp_sharded
    with pytest.raises(ValueError, match="experts"):
        ExpertShard(first=7, count=2, num_experts=8)


def test_invalid_values_are_refused():
    with pytest.raises(ValueError, match="dim"):
        TPShard(-1)
    with pytest.raises(ValueError, match="fused_parts"):
        TPShard(0, (4, 0))
    with pytest.raises(ValueError, match="unpadded"):
        TPShard(0, None, 0)
    with pytest.raises(TypeError, match="Placement"):
        set_placement(torch.zeros(1), TPShard(0))  # type: ignore[arg-type]


@pytest.mark.parametrize("placement", USED)
def test_round_trip_through_checkpoint_slice(placement):
    """The checkpoint records the TP part as a TPSlice (JSON in the metadata); reading it
    back gives the same TPShard, and a tied copy stays an alias (no slice of its own)."""
    p = nn.Parameter(torch.zeros(4, 2))
    set_placement(p, placement)
    assert placement_of(p) is placement and has_placement(p)
    tp = tp_slice_of(p, 1, 2)
    if placement.tp is None:
        assert tp is None
        return
    back = TPSlice.from_json(tp.to_json())
    assert back == tp and (back.rank, back.world) == (1, 2)
    assert TPShard(back.dim, back.parts, back.unpadded) == placement.tp
    assert pickle.loads(pickle.dumps(placement)) == placement


def test_survives_to_data_swap_and_to_empty():
    lin = ColumnParallelLinear(4, [4, 2, 2], NO_TP, init=NormalInit(0.02, 0, "qkv"), bias=True)
    want = tp_shard(0, (4, 2, 2))
    lin.to(torch.float64)                                 # module.to: the same Parameter objects
    lin.weight.data = torch.empty(0, dtype=torch.float64)  # what zero.Init does to a partitioned one
    assert placement_of(lin.weight) == want and placement_of(lin.bias) == want
    w = vocab_parallel_weight(10, 4, NO_TP, init=NormalInit(0.02, 0, "embedding"))
    assert placement_of(w) == tp_shard(0, unpadded_size=10)
    with torch.device("meta"):
        auto = AutoTPLinear("column", nn.Linear(4, 6).weight, None, NO_TP, parts=(2, 2, 2))
    auto.to_empty(device="cpu")                           # swaps tensors: the layer places them again
    assert placement_of(auto.weight) == tp_shard(0, (2, 2, 2))
