"""Pure ZeRO partition maths: layouts, shards, pieces, buckets, grouping (no processes)."""

import random

import pytest
import torch

from engine.placement import Placement, set_placement, tp_shard
from engine.zero.partition import align_up, bucketize, build_layout, group_params


def test_align_up():
    assert [align_up(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 4, 4, 8, 8]
    with pytest.raises(ValueError):
        align_up(3, 0)


def test_layout_offsets_are_aligned_and_total_divides_into_equal_aligned_shards():
    lay = build_layout([5, 3, 8, 1], num_shards=3, align=4)
    assert lay.offsets == (0, 8, 12, 20)
    assert lay.padded_numel == 24 and lay.shard_numel == 8  # 21 -> multiple of 3*4
    assert [lay.shard_range(r) for r in range(3)] == [(0, 8), (8, 16), (16, 24)]
    assert all(lay.shard_range(r)[0] % 4 == 0 for r in range(3))


def test_param_straddling_shards_is_split_into_pieces():
    lay = build_layout([3, 10, 2], num_shards=4, align=1)  # 15 -> 16, shards of 4
    assert lay.owners(1) == (0, 1, 2, 3)
    p0 = lay.pieces(0)
    assert [(q.param_index, q.param_start, q.shard_start, q.numel) for q in p0] == [(0, 0, 0, 3), (1, 0, 3, 1)]
    p3 = lay.pieces(3)
    assert [(q.param_index, q.param_start, q.shard_start, q.numel) for q in p3] == [(1, 9, 0, 1), (2, 0, 1, 2)]


@pytest.mark.parametrize("seed", range(30))
def test_pieces_cover_every_element_exactly_once(seed):
    """Rebuild each parameter from all shards' pieces: a flat copy round trip."""
    rng = random.Random(seed)
    numels = [rng.choice([0, 1, 2, 3, 7, 16, 33, 100]) for _ in range(rng.randint(1, 8))]
    shards, align = rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 2, 4, 8])
    lay = build_layout(numels, shards, align)
    params = [torch.randn(n) for n in numels]
    flat = torch.zeros(lay.padded_numel)
    for p, off in zip(params, lay.offsets):
        flat[off:off + p.numel()] = p
    rebuilt = [torch.full((n,), float("nan")) for n in numels]
    counted = [0] * len(numels)
    for r in range(shards):
        lo, hi = lay.shard_range(r)
        shard = flat[lo:hi]
        for q in lay.pieces(r):
            rebuilt[q.param_index][q.param_start:q.param_start + q.numel] = shard[q.shard_start:q.shard_start + q.numel]
            counted[q.param_index] += q.numel
    assert counted == numels
    for a, b in zip(params, rebuilt):
        assert torch.equal(a, b)
    assert lay.padded_numel % (shards * align) == 0
    assert lay.padded_numel - (lay.offsets[-1] + numels[-1]) < shards * align  # no more tail than needed


def test_empty_layout_still_has_one_aligned_chunk_per_shard():
    lay = build_layout([], num_shards=2, align=4)
    assert lay.padded_numel == 8 and lay.pieces(0) == ()


def test_bad_layout_arguments():
    with pytest.raises(ValueError, match="num_shards"):
        build_layout([1], 0)
    with pytest.raises(ValueError, match="sizes"):
        build_layout([-1], 1)
    with pytest.raises(ValueError, match="out of range"):
        build_layout([4], 2).shard_range(2)


def test_bucketize_keeps_order_and_gives_big_params_their_own_bucket():
    assert bucketize([3, 3, 3, 10, 1, 1], 6) == [[0, 1], [2], [3], [4, 5]]
    assert bucketize([], 5) == []
    with pytest.raises(ValueError):
        bucketize([1], 0)


def test_group_params_by_dtype_tp_layout_and_optimizer_group():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    c = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    d, e = torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(6))
    t = torch.nn.Parameter(torch.zeros(7))
    set_placement(b, tp_shard(0))
    set_placement(t, Placement(tied_copy=True))
    groups = group_params([[a, b, c, d], [e, t]], tied=[t])
    keys = list(groups)
    assert [[id(p) for p in groups[k]] for k in keys] == [[id(a), id(d)], [id(b)], [id(c)], [id(e)], [id(t)]]
    assert keys[1].tp_sharded and not keys[0].tp_sharded
    assert keys[2].dtype == torch.bfloat16
    assert keys[3].param_group == 1
    assert keys[4].tied_copy and keys[4].tied_index == 0
    with pytest.raises(ValueError, match="twice"):
        group_params([[a], [a]])
    with pytest.raises(ValueError, match="tied"):
        group_params([[a]], tied=[b])
