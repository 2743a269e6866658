"""Topology: every factorisation (dp, tp, pp) of world sizes 1..16, checked exhaustively.

The expected values are derived independently of Topology's own methods (from the rank
formula written out here, or by brute-force enumeration), so a bug in one method cannot
hide behind another.
"""

import dataclasses
import itertools

import pytest

from engine.topology import Axis, Coord, Topology, TopologyError

AXES = ("dp", "tp", "pp")


def factorizations(max_world=16):
    for world in range(1, max_world + 1):
        for dp, tp in itertools.product(range(1, world + 1), repeat=2):
            if world % (dp * tp) == 0:
                yield dp, tp, world // (dp * tp)


ALL = list(factorizations())


def test_enumeration_is_complete():
    # number of ordered 3-factorisations summed over 1..16 (d3(n): 1,3,3,6,3,9,3,10,6,9,3,18,3,9,9,15)
    assert len(ALL) == 1 + 3 + 3 + 6 + 3 + 9 + 3 + 10 + 6 + 9 + 3 + 18 + 3 + 9 + 9 + 15
    assert len(set(ALL)) == len(ALL)


def formula(dp_rank, tp_rank, pp_rank, dp, tp):
    return pp_rank * (dp * tp) + dp_rank * tp + tp_rank


def brute_coords(dp, tp, pp):
    """rank -> (dp, tp, pp) by enumeration of the formula, independent of Topology.coord."""
    out = {}
    for d, t, p in itertools.product(range(dp), range(tp), range(pp)):
        out[formula(d, t, p, dp, tp)] = Coord(dp=d, tp=t, pp=p)
    return out


@pytest.mark.parametrize("world", range(1, 17))
def test_coords_rank_formula_and_round_trip(world):
    for dp, tp, pp in [f for f in ALL if f[0] * f[1] * f[2] == world]:
        _coords_rank_formula_and_round_trip(dp, tp, pp)


def _coords_rank_formula_and_round_trip(dp, tp, pp):
    topo = Topology(dp=dp, tp=tp, pp=pp)
    world = dp * tp * pp
    assert topo.world_size == world
    expected = brute_coords(dp, tp, pp)
    assert sorted(expected) == list(range(world))
    for r in range(world):
        c = topo.coord(r)
        assert c == expected[r]
        assert topo.rank(dp=c.dp, tp=c.tp, pp=c.pp) == r
        assert formula(c.dp, c.tp, c.pp, dp, tp) == r


@pytest.mark.parametrize("world", range(1, 17))
def test_axis_groups_partition_and_share_other_coords(world):
    for dp, tp, pp in [f for f in ALL if f[0] * f[1] * f[2] == world]:
        _axis_groups_partition_and_share_other_coords(dp, tp, pp)


def _axis_groups_partition_and_share_other_coords(dp, tp, pp):
    topo = Topology(dp=dp, tp=tp, pp=pp)
    world = topo.world_size
    coords = brute_coords(dp, tp, pp)
    for axis in AXES:
        groups = topo.groups(axis)
        size = {"dp": dp, "tp": tp, "pp": pp}[axis]
        assert len(groups) == world // size
        flat = [r for g in groups for r in g]
        assert sorted(flat) == list(range(world)), f"{axis} groups do not partition the world"
        others = [a for a in AXES if a != axis]
        for g in groups:
            assert len(g) == size
            # members share the other two coordinates and cover this axis 0..size-1 in order
            assert len({tuple(getattr(coords[r], a) for a in others) for r in g}) == 1
            assert [getattr(coords[r], axis) for r in g] == list(range(size))
        for r in range(world):
            containing = [g for g in groups if r in g]
            assert len(containing) == 1
            assert topo.ranks_along(axis, r) == containing[0]
            assert topo.ranks_along(Axis(axis), r) == containing[0]


@pytest.mark.parametrize("world", range(1, 17))
def test_tp_groups_contiguous_pp_outermost(world):
    for dp, tp, pp in [f for f in ALL if f[0] * f[1] * f[2] == world]:
        _tp_groups_contiguous_pp_outermost(dp, tp, pp)


def _tp_groups_contiguous_pp_outermost(dp, tp, pp):
    topo = Topology(dp=dp, tp=tp, pp=pp)
    for g in topo.groups("tp"):
        assert g == list(range(g[0], g[0] + tp))
    # a pipeline stage is the contiguous block [s*dp*tp, (s+1)*dp*tp)
    for r in range(topo.world_size):
        assert topo.coord(r).pp == r // (dp * tp)


@pytest.mark.parametrize("world", range(1, 17))
def test_pipeline_neighbours(world):
    for dp, tp, pp in [f for f in ALL if f[0] * f[1] * f[2] == world]:
        _pipeline_neighbours(dp, tp, pp)


def _pipeline_neighbours(dp, tp, pp):
    topo = Topology(dp=dp, tp=tp, pp=pp)
    for r in range(topo.world_size):
        c = topo.coord(r)
        assert topo.is_first_stage(r) == (c.pp == 0)
        assert topo.is_last_stage(r) == (c.pp == pp - 1)
        prev, nxt = topo.prev_stage_rank(r), topo.next_stage_rank(r)
        assert prev == (None if c.pp == 0 else r - dp * tp)
        assert nxt == (None if c.pp == pp - 1 else r + dp * tp)
        if nxt is not None:
            assert topo.prev_stage_rank(nxt) == r


@pytest.mark.parametrize("world", range(1, 17))
def test_embedding_and_model_parallel_groups(world):
    for dp, tp, pp in [f for f in ALL if f[0] * f[1] * f[2] == world]:
        _embedding_and_model_parallel_groups(dp, tp, pp)


def _embedding_and_model_parallel_groups(dp, tp, pp):
    topo = Topology(dp=dp, tp=tp, pp=pp)
    world = topo.world_size
    coords = brute_coords(dp, tp, pp)
    emb = topo.embedding_groups()
    assert len(emb) == dp * tp
    mp = topo.model_parallel_groups()
    assert sorted(r for g in mp for r in g) == list(range(world))
    assert len(mp) == dp and all(len(g) == tp * pp for g in mp)
    for r in range(world):
        c = coords[r]
        want_emb = sorted({formula(c.dp, c.tp, 0, dp, tp), formula(c.dp, c.tp, pp - 1, dp, tp)})
        assert topo.embedding_ranks(r) == want_emb
        assert len(want_emb) == (1 if pp == 1 else 2)
        if c.pp in (0, pp - 1):
            assert r in want_emb and want_emb in emb
        want_mp = sorted(q for q in range(world) if coords[q].dp == c.dp)
        assert topo.model_parallel_ranks(r) == want_mp
        assert want_mp in mp
    # every rank on the first or last stage is in exactly one embedding group
    ends = [r for r in range(world) if coords[r].pp in (0, pp - 1)]
    assert sorted(r for g in emb for r in g) == sorted(ends)


@pytest.mark.parametrize("bad", [0, -1, -4, True, False, 1.0, "2", None])
@pytest.mark.parametrize("axis", AXES)
def test_bad_degree(axis, bad):
    with pytest.raises(TopologyError, match=f"{axis} must be a positive integer"):
        Topology(**{axis: bad})


def test_product_mismatch_names_the_numbers():
    with pytest.raises(TopologyError, match=r"2\*2\*2 = 8 does not equal the world size 6"):
        Topology(dp=2, tp=2, pp=2, world_size=6)
    assert Topology(dp=2, tp=3, pp=1, world_size=6).world_size == 6


@pytest.mark.parametrize("axis", ["xp", "", "DPP", 3])
def test_bad_axis_names(axis):
    topo = Topology(dp=2, tp=2)
    with pytest.raises(TopologyError, match="unknown axis"):
        topo.groups(axis)
    with pytest.raises(TopologyError, match="unknown axis"):
        topo.ranks_along(axis, 0)


def test_axis_names_case_insensitive():
    topo = Topology(dp=2, tp=2)
    assert topo.groups("TP") == topo.groups(Axis.TP) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("rank", [-1, 8, 100, True, 1.5, "0"])
def test_out_of_range_ranks(rank):
    topo = Topology(dp=2, tp=2, pp=2)
    for call in (topo.coord, topo.model_parallel_ranks, topo.embedding_ranks,
                 topo.prev_stage_rank, topo.next_stage_rank, topo.is_first_stage):
        with pytest.raises(TopologyError, match="outside"):
            call(rank)
    with pytest.raises(TopologyError, match="outside"):
        topo.ranks_along("dp", rank)


@pytest.mark.parametrize("kw", [dict(dp=2), dict(tp=-1), dict(pp=2), dict(tp=5)])
def test_out_of_range_coordinates(kw):
    topo = Topology(dp=2, tp=2, pp=2)
    with pytest.raises(TopologyError, match="coordinate"):
        topo.rank(**kw)


def test_immutable():
    topo = Topology(dp=2, tp=2, pp=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.dp = 4
