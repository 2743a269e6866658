"""engine.distributed.comm.reduce_scatter (gloo): with ``inp_is_scratch`` between two ranks it runs
as one ``reduce`` per owner (half the traffic of gloo's reduce-scatter); the result must be
exactly the native one's, blocking and async, for SUM and MAX; at four ranks the native op
is used. Exact: a sum or max of two fp32 values does not depend on their order; the inputs
are integers in fp32 at four ranks (exact sums in any order)."""

import pytest
import torch
from harness import run_ranks


def _case(rank, world):
    import torch.distributed as dist

    from engine.distributed import comm
    from engine.distributed.groups import AxisGroup

    group = AxisGroup.world()
    n = 1000
    inputs = [torch.randn(world * n, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    if world > 2:
        inputs = [x.mul(100).round() for x in inputs]
    out = {"by_owner": comm._reduces_by_owner(group)}
    for name, op, ref in (("sum", dist.ReduceOp.SUM, sum(inputs)),
                          ("max", dist.ReduceOp.MAX, torch.stack(inputs).amax(0))):
        want = ref[rank * n:(rank + 1) * n]
        for async_op in (False, True):
            got = torch.empty(n)
            work = comm.reduce_scatter(got, inputs[rank].clone(), group, op=op, async_op=async_op,
                                       inp_is_scratch=True)
            if work is not None:
                work.wait()
                work.wait()  # a second wait is harmless
            native = torch.empty(n)
            comm.reduce_scatter(native, inputs[rank].clone(), group, op=op)
            out[(name, async_op)] = (torch.equal(got, want), torch.equal(native, want))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_by_owner_equals_the_native_one(world):
    for r in run_ranks(_case, world, timeout=120):
        assert r.pop("by_owner") == (world == 2)
        assert all(a and b for a, b in r.values()), r
