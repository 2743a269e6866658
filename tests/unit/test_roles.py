"""The mesh's axis list, the role table and the one "speaks for" predicate (pure, no processes).

Expected values come from brute-force enumeration of the rank formula, not from the methods
under test. The last test scans engine/ so that no module outside engine/distributed/ (and
the topology itself) names the data-parallel group, rank or size: code asks for a role.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from engine.topology import (
    EXPERT_ROLE_AXES,
    MESH_AXES,
    PER_AXIS_ROLES,
    ROLE_AXES,
    Axis,
    Mesh,
    Role,
    Topology,
    TopologyError,
)

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = [(2, 2, 2), (1, 4, 2), (4, 1, 2), (2, 3, 1), (3, 1, 1), (1, 1, 4), (2, 2, 3)]


def _brute(dp: int, tp: int, pp: int) -> dict[int, dict[str, int]]:
    """rank -> coordinates, from the formula rank = pp*(dp*tp) + dp*tp_size... (innermost tp)."""
    return {p * dp * tp + d * tp + t: {"dp": d, "tp": t, "pp": p}
            for d, t, p in itertools.product(range(dp), range(tp), range(pp))}


def test_axis_list_and_role_table_are_complete():
    assert set(MESH_AXES) == set(Axis) and len(MESH_AXES) == len(Axis)
    assert MESH_AXES[0] is Axis.TP and MESH_AXES[-1] is Axis.PP  # TP innermost, PP outermost
    assert set(ROLE_AXES) | set(EXPERT_ROLE_AXES) == set(Role) and not set(ROLE_AXES) & set(EXPERT_ROLE_AXES)
    for role, axes in ROLE_AXES.items():
        assert axes and list(axes) == [a for a in MESH_AXES if a in axes], f"{role}: axes not in mesh order"
    assert PER_AXIS_ROLES <= set(Role)


@pytest.mark.parametrize("dp,tp,pp", LAYOUTS)
def test_flattened_groups_over_several_axes(dp, tp, pp):
    topo = Topology(dp=dp, tp=tp, pp=pp)
    coords = _brute(dp, tp, pp)
    for k in (1, 2, 3):
        for axes in itertools.combinations(["tp", "dp", "pp"], k):
            fixed = [a for a in ("dp", "tp", "pp") if a not in axes]
            for r in range(topo.world_size):
                want = sorted(q for q in coords if all(coords[q][a] == coords[r][a] for a in fixed))
                got = topo.ranks_along(list(axes), r)
                assert sorted(got) == want and got[0] == min(want), (axes, r)
                # innermost axis varies fastest: the flattened index of r is its mixed-radix digit string
                assert got == sorted(got)
            groups = topo.groups(list(axes))
            assert sorted(x for g in groups for x in g) == list(range(topo.world_size))
            assert topo.size(list(axes)) == len(groups[0])


@pytest.mark.parametrize("dp,tp,pp", LAYOUTS)
def test_role_ranks_follow_the_table(dp, tp, pp):
    topo = Topology(dp=dp, tp=tp, pp=pp)
    for role, axes in ROLE_AXES.items():
        assert topo.role_size(role) == topo.size(axes)
        for r in range(topo.world_size):
            assert topo.role_ranks(role, r) == topo.ranks_along(axes, r)
    assert topo.role_size(Role.BATCH) == dp  # the batch arithmetic's divisor


@pytest.mark.parametrize("dp,tp,pp", LAYOUTS)
def test_speaks_for_is_coordinate_zero_on_the_replicated_axes(dp, tp, pp):
    topo = Topology(dp=dp, tp=tp, pp=pp)
    coords = _brute(dp, tp, pp)
    for r, c in coords.items():
        assert topo.speaks_for(r, Axis.DP) == (c["dp"] == 0)
        assert topo.speaks_for(r, (Axis.DP, Axis.TP)) == (c["dp"] == 0 and c["tp"] == 0)
        assert topo.speaks_for(r, ()) is True
    # exactly one speaker in every group of the replicated axes
    for axes in (["dp"], ["tp", "dp"], ["pp"]):
        for g in topo.groups(axes):
            assert sum(topo.speaks_for(r, axes) for r in g) == 1


def test_generic_mesh_and_errors():
    mesh = Mesh(("a", "b", "c"), (2, 3, 2))
    assert mesh.world_size == 12
    for r in range(12):
        c = mesh.coords(r)
        assert r == c["a"] + 2 * c["b"] + 6 * c["c"] and mesh.rank(c) == r
    assert mesh.ranks_along(["a", "c"], 0) == [0, 1, 6, 7]
    with pytest.raises(TopologyError, match="unknown axis"):
        mesh.ranks_along(["z"], 0)
    with pytest.raises(TopologyError, match="do not match"):
        Mesh(("a", "a"), (1, 2))
    with pytest.raises(TopologyError, match="outside"):
        mesh.coords(12)


@pytest.mark.parametrize("dp,tp,pp,ep", [(4, 2, 2, 2), (4, 1, 1, 4), (2, 2, 2, 1), (6, 1, 2, 3)])
def test_expert_folding_covers_the_same_ranks(dp, tp, pp, ep):
    """tp, ep, edp, pp over the same world: TP and PP groups are the dense ones; ep x edp is
    the dense data axis refolded (an expert group is ep neighbouring DP replicas)."""
    topo = Topology(dp=dp, tp=tp, pp=pp)
    experts = topo.expert_mesh(ep)
    assert all(set(axes) <= set(experts.names) for axes in EXPERT_ROLE_AXES.values())
    assert experts.world_size == topo.world_size and experts.sizes == (tp, ep, dp // ep, pp)
    assert experts.groups(["tp"]) == topo.groups("tp") and experts.groups(["pp"]) == topo.groups("pp")
    assert experts.groups(["ep", "edp"]) == topo.groups("dp")
    for r in range(topo.world_size):
        c, e = topo.coord(r), experts.coords(r)
        assert c.dp == e["ep"] + ep * e["edp"]
    assert Topology(dp=2, tp=2).groups("tp") == [[0, 1], [2, 3]]  # the dense folding is untouched
    with pytest.raises(TopologyError, match="does not divide"):
        topo.expert_mesh(5)


# ------------------------------------------------------------------ roles, not axes, in the code
FORBIDDEN = {"dp_group", "dp_rank", "dp_size", "dp_ranks"}
EXEMPT = ("engine/distributed/", "engine/topology.py")


def _identifiers(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.id, node.lineno
        elif isinstance(node, ast.Attribute):
            yield node.attr, node.lineno
        elif isinstance(node, ast.arg):
            yield node.arg, node.lineno
        elif isinstance(node, ast.keyword) and node.arg is not None:
            yield node.arg, node.value.lineno
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name, node.lineno


def role_violations(root: Path = ROOT) -> list[str]:
    found = []
    for path in sorted((root / "engine").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(EXEMPT):
            continue
        for name, line in _identifiers(ast.parse(path.read_text(), rel)):
            if name in FORBIDDEN:
                found.append(f"{rel}:{line}: {name}")
    return found


def test_code_asks_for_a_role_not_the_dp_group():
    assert role_violations() == [], ("ask ParallelGroups.role(Role.X) / Topology.role_size instead of naming the "
                                     "data-parallel group, rank or size")


def test_the_scan_catches_a_planted_use(tmp_path):
    (tmp_path / "engine" / "zero").mkdir(parents=True)
    (tmp_path / "engine" / "zero" / "x.py").write_text("def f(groups):\n    return groups.dp_group\n")
    (tmp_path / "engine" / "distributed").mkdir()
    (tmp_path / "engine" / "distributed" / "y.py").write_text("dp_rank = 0\n")
    assert role_violations(tmp_path) == ["engine/zero/x.py:2: dp_group"]
