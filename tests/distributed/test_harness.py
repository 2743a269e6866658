import os

import pytest
import torch
import torch.distributed as dist
from harness import RankFailure, RankTimeout, run_ranks


def _allreduce_rank(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_one(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom on rank one")
    dist.barrier()


def _die_on_one(rank, world_size):
    if rank == 1:
        os._exit(7)
    return rank


def _hang(rank, world_size):
    if rank == 0:
        import time
        time.sleep(60)
    dist.barrier()


def test_allreduce_sum():
    assert run_ranks(_allreduce_rank, 4) == [6.0] * 4


def test_failing_rank_traceback_is_shown():
    with pytest.raises(RankFailure, match="rank 1 failed:(.|\n)*boom on rank one"):
        run_ranks(_raise_on_one, 3, timeout=60)


def test_dead_rank_is_named():
    with pytest.raises(RankFailure, match="rank 1 exited with code 7"):
        run_ranks(_die_on_one, 2, timeout=60)


def test_hang_is_bounded_by_timeout():
    with pytest.raises((RankTimeout, RankFailure)):
        run_ranks(_hang, 2, timeout=8, collective_timeout=4)


def _return_tensor(rank, world_size):
    return {"t": torch.full((3,), float(rank))}


def test_tensors_come_back():
    out = run_ranks(_return_tensor, 2)
    assert torch.equal(out[1]["t"], torch.full((3,), 1.0))
