"""The context-parallel axis in the mesh (pure, no processes): rank order ``tp, cp, dp, pp``
innermost first, and the roles CP plays (grad and loss over ``cp x dp``, batch over ``dp``).

Expected values come from brute-force enumeration of the documented rank formula
``rank = ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp``, not from the methods under test.
"""

from __future__ import annotations

import itertools

import pytest

from engine.topology import ROLE_AXES, Axis, Role, Topology, TopologyError

LAYOUTS = [(1, 1, 1, 2), (2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 2, 2), (2, 2, 2, 2), (1, 1, 1, 4), (3, 2, 1, 4)]


def _brute(dp: int, tp: int, pp: int, cp: int) -> dict[int, dict[str, int]]:
    return {((p * dp + d) * cp + c) * tp + t: {"dp": d, "tp": t, "pp": p, "cp": c}
            for d, t, p, c in itertools.product(range(dp), range(tp), range(pp), range(cp))}


@pytest.mark.parametrize("dp,tp,pp,cp", LAYOUTS)
def test_rank_formula_and_round_trip(dp, tp, pp, cp):
    topo = Topology(dp=dp, tp=tp, pp=pp, cp=cp)
    assert topo.world_size == dp * tp * pp * cp
    for r, c in _brute(dp, tp, pp, cp).items():
        assert topo.coord(r)._asdict() == c
        assert topo.rank(**c) == r


@pytest.mark.parametrize("dp,tp,pp,cp", LAYOUTS)
def test_cp_groups_and_roles(dp, tp, pp, cp):
    topo = Topology(dp=dp, tp=tp, pp=pp, cp=cp)
    coords = _brute(dp, tp, pp, cp)

    def along(r: int, axes: tuple[str, ...]) -> list[int]:
        fixed = [a for a in ("dp", "tp", "pp", "cp") if a not in axes]
        return sorted(q for q in coords if all(coords[q][a] == coords[r][a] for a in fixed))

    for r in coords:
        assert topo.ranks_along(Axis.CP, r) == along(r, ("cp",))
        # CP peers are tp apart: between TP (innermost) and DP
        assert topo.ranks_along(Axis.CP, r) == [topo.ranks_along(Axis.CP, r)[0] + i * tp for i in range(cp)]
        assert topo.role_ranks(Role.GRAD, r) == along(r, ("cp", "dp"))
        assert topo.role_ranks(Role.LOSS, r) == along(r, ("cp", "dp"))
        assert topo.role_ranks(Role.BATCH, r) == along(r, ("dp",))
        assert sorted(topo.ranks_along(ROLE_AXES[Role.AMAX], r)) == along(r, ("tp", "cp", "dp"))
        # the grad group's index of a rank is dp * cp + cp_rank (CP varies fastest)
        c = coords[r]
        assert topo.role_ranks(Role.GRAD, r).index(r) == c["dp"] * cp + c["cp"]
        assert topo.speaks_for(r, ROLE_AXES[Role.GRAD]) == (c["dp"] == 0 and c["cp"] == 0)
    assert topo.role_size(Role.GRAD) == topo.role_size(Role.LOSS) == dp * cp
    assert topo.role_size(Role.BATCH) == dp
    groups = topo.groups(Axis.CP)
    assert sorted(x for g in groups for x in g) == list(range(topo.world_size))


def test_cp_errors_and_names():
    assert Axis.parse("CP") is Axis.CP
    with pytest.raises(TopologyError, match="cp"):
        Topology(cp=0)
    with pytest.raises(TopologyError, match="dp\\*cp = 2\\*2 = 4 does not equal the world size 8"):
        Topology(dp=2, cp=2, world_size=8)
    assert str(Topology(dp=2, cp=2)) == "Topology(dp=2, tp=1, pp=1, cp=2)"
