"""Layers to pipeline stages: uniform and parameter-balanced partitions."""

import itertools
import random

import pytest

from engine.errors import ConfigError
from engine.pipeline.partition import layers_of, part_sizes, partition_balanced, partition_layers


def _valid(bounds, n, parts):
    assert len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == n
    assert all(a < b for a, b in zip(bounds, bounds[1:])), bounds  # contiguous, non-empty


def test_uniform_splits_blocks_and_pins_ends():
    # embedding + 8 blocks + head over 4 stages: 2 blocks each, embedding first, head last
    assert partition_layers([5] * 10, 4, "blocks") == [0, 3, 5, 7, 10]
    # 7 blocks over 3 stages: remainder to the first stages
    assert partition_layers([1] * 9, 3, "blocks") == [0, 4, 6, 9]
    assert partition_layers([1] * 4, 1, "blocks") == [0, 4]


def test_uniform_blocks_per_stage_counts():
    for blocks in range(1, 20):
        for parts in range(1, blocks + 1):
            n = blocks + 2
            b = partition_layers([1] * n, parts, "blocks")
            _valid(b, n, parts)
            inner = [hi - lo for lo, hi in zip(b, b[1:])]
            if parts > 1:
                inner[0] -= 1
                inner[-1] -= 1
            else:
                inner[0] -= 2
            assert max(inner) - min(inner) <= 1 and sum(inner) == blocks


def _brute_force(counts, parts):
    n = len(counts)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        b = [0, *cuts, n]
        sizes = part_sizes(counts, b)
        key = (max(sizes), sum(s * s for s in sizes))
        if best is None or key < best:
            best = key
    return best


def test_parameters_method_is_optimal():
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(1, 9)
        counts = [rng.randint(0, 50) for _ in range(n)]
        for parts in range(1, n + 1):
            b = partition_layers(counts, parts, "parameters")
            _valid(b, n, parts)
            sizes = part_sizes(counts, b)
            assert (max(sizes), sum(s * s for s in sizes)) == _brute_force(counts, parts), (counts, parts)


def test_parameters_method_on_a_gpt_like_model():
    # big embedding, 6 equal blocks, big head: the embedding and head get fewer blocks
    counts = [400] + [100] * 6 + [400]
    b = partition_layers(counts, 4, "parameters")
    assert b[0] == 0 and b[-1] == len(counts)
    assert part_sizes(counts, b) == [400, 300, 300, 400]


def test_layers_of_virtual_stages():
    b = partition_layers([1] * 10, 4, "blocks")  # 2 stages x 2 chunks
    assert list(layers_of(b, stage=0, num_stages=2, chunk=0)) == [0, 1, 2]
    assert list(layers_of(b, stage=1, num_stages=2, chunk=0)) == [3, 4]
    assert list(layers_of(b, stage=0, num_stages=2, chunk=1)) == [5, 6]
    assert list(layers_of(b, stage=1, num_stages=2, chunk=1)) == [7, 8, 9]


@pytest.mark.parametrize("counts,parts,method,match", [
    ([1, 1, 1], 4, "parameters", "cannot cut 3 layers into 4"),
    ([1, 1, 1, 1], 3, "blocks", "needs at least one block per pipeline piece"),
    ([1, 1], 1, "balanced", "unknown pipeline.partition"),
    ([1, -1], 1, "uniform", "layer 1"),
    ([], 1, "uniform", "empty"),
    ([1], 0, "uniform", "positive integer"),
])
def test_bad_inputs(counts, parts, method, match):
    with pytest.raises(ConfigError, match=match):
        partition_layers(counts, parts, method)


def test_uniform_is_deepspeeds_layer_count_and_agrees_with_pipeline_module():
    """One meaning per name: ``uniform`` balances the number of layers (the embedding and the
    head count as layers), for the config and for PipelineModule alike; Megatron's even split
    of the blocks is ``blocks``. (PipelineModule's ``parameters`` is DeepSpeed's
    ``partition_balanced``, tests/unit/test_pipe_partition_ds.py.)"""
    import torch.nn as nn

    from engine.config.sections import PARTITION_METHODS
    from engine.pipe import PipelineModule

    counts = [100, 1, 1, 1, 1, 1, 1, 1, 1, 100]
    assert part_sizes([1] * 10, partition_layers(counts, 4, "uniform")) == [3, 3, 2, 2] or \
        sorted(part_sizes([1] * 10, partition_layers(counts, 4, "uniform"))) == [2, 2, 3, 3]
    assert partition_layers([1] * 11, 4, "uniform") != partition_layers([1] * 11, 4, "blocks")
    assert max(part_sizes([1] * 11, partition_layers([1] * 11, 4, "uniform"))) == 3  # ceil(11 / 4)
    for method in ("uniform", "parameters", "blocks"):
        pm = PipelineModule([nn.Linear(2, 2) for _ in range(11)], num_stages=4, partition_method=method)
        want = partition_balanced([6] * 11, 4) if method == "parameters" else \
            partition_layers(pm.layer_weights(), 4, method)  # "parameters": DeepSpeed's partition_balanced
        assert pm.partition(4) == want, method
    assert set(PARTITION_METHODS) == {"parameters", "uniform", "blocks", "type:<regex>"}
