"""Role groups on 4 gloo ranks (tp 2 x dp 2): a role over one axis IS that axis's group; a role
over several wide axes gets one flattened communicator, shared by every role over the same axes.

The second case is what context parallelism needs (grad and loss over cp x dp); it is
exercised here by re-reading the role table in the child processes (grad and loss over
tp x dp), so the mechanism is proven before a new axis exists. Sums of rank ids in float64
are exact.
"""

import torch
import torch.distributed as dist
from harness import run_ranks

from engine.distributed.groups import ParallelGroups
from engine.topology import ROLE_AXES, Axis, Role, Topology


def _sum(group):
    t = torch.tensor([float(dist.get_rank())], dtype=torch.float64)
    if group.size > 1:
        dist.all_reduce(t, group=group.process_group)
    return t.item()


def _roles(rank, world_size, widen):
    if widen:  # a table in which grad and loss span two wide axes
        ROLE_AXES[Role.GRAD] = ROLE_AXES[Role.LOSS] = (Axis.TP, Axis.DP)
    groups = ParallelGroups.build(Topology(dp=2, tp=2, world_size=world_size), timeout_s=40.0)
    out = {role: (list(groups.role(role).ranks), _sum(groups.role(role)))
           for role in ROLE_AXES if role is not Role.AMAX}
    out["amax"] = [list(g.ranks) for g in groups.role_axes(Role.AMAX)]
    out["same_as_dp"] = groups.role(Role.GRAD) is groups[Axis.DP]
    out["grad_is_loss"] = groups.role(Role.GRAD) is groups.role(Role.LOSS)
    out["built"] = len(groups.all_groups())
    out["speaks"] = groups.speaks_for(Role.GRAD)
    return out


def test_role_groups_one_axis_and_flattened():
    for widen in (False, True):
        results = run_ranks(_roles, 4, widen, timeout=120, collective_timeout=45)
        topo = Topology(dp=2, tp=2)
        for rank, res in enumerate(results):
            grad_axes = (Axis.TP, Axis.DP) if widen else (Axis.DP,)
            want = topo.ranks_along(grad_axes, rank)
            assert res[Role.GRAD] == res[Role.LOSS] == (want, float(sum(want)))
            assert res[Role.BATCH][0] == topo.ranks_along("dp", rank)
            assert res[Role.TP][0] == topo.ranks_along("tp", rank)
            assert res["amax"] == [topo.ranks_along("tp", rank), topo.ranks_along("dp", rank)]
            assert res["same_as_dp"] is (not widen)
            assert res["grad_is_loss"] is True  # one communicator for both roles
            assert res["built"] == 2 + widen  # tp, dp (+ the one flattened tp x dp group)
            assert res["speaks"] == topo.speaks_for(rank, grad_axes)
