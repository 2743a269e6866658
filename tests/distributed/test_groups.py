"""ParallelGroups on 8 gloo ranks: every group's all-reduce of the rank id gives the sum
over the members that Topology (pure, tested exhaustively in tests/unit) says it has.

Exact integer sums in float64, so the comparison is exact (no tolerance). One spawn of 8
ranks checks several layouts, because starting 8 interpreters dominates the cost.
"""

import datetime

import torch
import torch.distributed as dist
from harness import run_ranks

from engine.distributed.groups import ParallelGroups
from engine.topology import Topology

LAYOUTS = [(2, 2, 2), (1, 4, 2), (4, 1, 2), (2, 4, 1), (1, 1, 8)]


def _group_sums(rank, world_size):
    out = {}
    for dp, tp, pp in LAYOUTS:
        topo = Topology(dp=dp, tp=tp, pp=pp, world_size=world_size)
        groups = ParallelGroups.build(topo, timeout_s=40.0)
        sums = {}
        for name in ("tp", "dp", "pp", "embedding"):
            if name == "embedding" and not groups.in_embedding_group:  # middle pipeline stage
                sums[name] = (None, list(groups.embedding_ranks))
                try:
                    _ = groups.embedding_group
                except ValueError as e:  # asked for anyway: an error that says why, not None
                    sums["middle_error"] = str(e)
                continue
            group = groups.embedding_group if name == "embedding" else groups[name]
            t = torch.tensor([float(rank)], dtype=torch.float64)
            if group.size > 1:  # a size-1 axis has no communicator (its all-reduce is the identity)
                dist.all_reduce(t, group=group.process_group)
                assert (dist.get_world_size(group.process_group), dist.get_rank(group.process_group)) == \
                    (group.size, group.rank)
                assert dist.get_process_group_ranks(group.process_group) == list(group.ranks)
            else:
                assert group.handle is None
            sums[name] = (t.item(), list(getattr(groups, f"{name}_ranks")), group.size, group.rank)
        # subgroups carry the requested timeout, not torch's 30-minute default
        timed = groups.all_groups()[0].process_group
        sums["timeout"] = timed._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        sums["axis_sizes"] = [groups[a].size for a in ("dp", "tp", "pp")]
        sums["facts"] = (groups.coord, groups.tp_rank, groups.dp_rank, groups.pp_rank,
                         groups.tp_size, groups.dp_size, groups.pp_size, groups.is_first_stage,
                         groups.is_last_stage, groups.prev_stage_rank, groups.next_stage_rank,
                         groups.in_embedding_group, len(groups.all_groups()),
                         groups.in_embedding_group and groups.embedding_group.handle is groups.pp_group.handle)
        # p2p between pipeline neighbours uses the global ranks the groups report
        if groups.pp_size > 1:
            send = torch.tensor([float(rank)])
            recv = torch.tensor([-1.0])
            ops = []
            if groups.next_stage_rank is not None:
                ops.append(dist.P2POp(dist.isend, send, groups.next_stage_rank))
            if groups.prev_stage_rank is not None:
                ops.append(dist.P2POp(dist.irecv, recv, groups.prev_stage_rank))
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            sums["from_prev"] = recv.item()
        out[(dp, tp, pp)] = sums
    # inherit the default group's timeout when none is given
    inherited = ParallelGroups.build(Topology(dp=world_size, world_size=world_size))
    out["inherited"] = inherited.dp_group.process_group._get_backend(torch.device("cpu")).options._timeout
    out["errors"] = _errors(rank, inherited)
    return out


def _errors(rank, groups):
    """Bad calls fail on every rank before any new_group, so the ranks stay in step."""
    msgs = []
    try:
        ParallelGroups.build(Topology(dp=2, tp=2, pp=1))
    except ValueError as e:
        msgs.append(str(e))
    try:
        ParallelGroups.build(Topology(dp=8), rank=(rank + 1) % 8)
    except ValueError as e:
        msgs.append(str(e))
    try:
        ParallelGroups.build(Topology(dp=8), timeout_s=0)
    except ValueError as e:
        msgs.append(str(e))
    try:
        groups.tp_group = None
    except Exception as e:  # frozen dataclass
        msgs.append(type(e).__name__)
    return msgs


def test_group_allreduce_sums_match_topology():
    results = run_ranks(_group_sums, 8, timeout=120, collective_timeout=45)
    for rank, res in enumerate(results):
        assert res["inherited"] == datetime.timedelta(seconds=45)
        for dp, tp, pp in LAYOUTS:
            topo = Topology(dp=dp, tp=tp, pp=pp)
            got = res[(dp, tp, pp)]
            want = {
                "tp": topo.ranks_along("tp", rank),
                "dp": topo.ranks_along("dp", rank),
                "pp": topo.ranks_along("pp", rank),
                "embedding": topo.embedding_ranks(rank),
            }
            c = topo.coord(rank)
            if 0 < c.pp < pp - 1:  # a middle stage holds no embedding
                assert got["embedding"] == (None, [])
                assert "middle pipeline stage" in got["middle_error"]
                del want["embedding"]
            for name, members in want.items():
                total, ranks, size, group_rank = got[name]
                assert ranks == members, (rank, (dp, tp, pp), name)
                assert total == float(sum(members)), (rank, (dp, tp, pp), name, total)
                assert size == len(members) and group_rank == members.index(rank)
            ends = c.pp in (0, pp - 1)
            # one communicator per axis of size > 1, plus the embedding group when it is not the pp group
            built = sum(n > 1 for n in (dp, tp, pp)) + (1 if ends and pp > 2 else 0)
            assert got["facts"] == (c, c.tp, c.dp, c.pp, tp, dp, pp, c.pp == 0, c.pp == pp - 1,
                                    topo.prev_stage_rank(rank), topo.next_stage_rank(rank),
                                    ends, built, ends and pp <= 2)
            assert got["axis_sizes"] == [dp, tp, pp]
            assert got["timeout"] == 40.0
            if pp > 1 and c.pp > 0:
                assert got["from_prev"] == float(topo.prev_stage_rank(rank))
        # the layouts above include the special cases: pp == 1 (singleton embedding group,
        # the pp group itself) and pp == 2 (the embedding group is the pp group: not built twice)
        assert results[rank][(2, 4, 1)]["embedding"][1] == [rank]
        errors = results[rank]["errors"]
        assert "needs 4 ranks but the job has 8" in errors[0]
        assert "is not this process's rank" in errors[1]
        assert "timeout_s must be positive" in errors[2]
        assert errors[3] == "FrozenInstanceError"
    # (1, 1, 8): only ranks 0 and 7 hold the embedding; they sum to 7
    assert [r[(1, 1, 8)]["embedding"][0] for r in results] == [7.0] + [None] * 6 + [7.0]
