import os

import pytest
import torch
import torch.distributed as dist
from harness import RankFailure, RankTimeout, run_ranks, scaled


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


# ------------------------------------------------------------------ forked ranks (the fork server)
def _env_and_output(rank, world_size, tag):
    import sys

    print(f"rank-stdout {tag} {rank}", flush=True)
    sys.stderr.write(f"rank-stderr {tag} {rank}\n")
    return os.environ.get("ENGINE_HARNESS_PROBE"), os.getcwd()


def test_forked_ranks_get_the_parents_environment_cwd_and_output_at_the_call(monkeypatch, capfd, tmp_path):
    """The fork server is started once (by an earlier test or here) with the environment of
    that moment; each rank still sees the parent's environment, working directory and
    stdout/stderr (pytest's capture of this test) as they are at the call."""
    run_ranks(_allreduce_rank, 2)  # the fork server exists before the environment changes
    monkeypatch.setenv("ENGINE_HARNESS_PROBE", "set-after-start")
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    out = run_ranks(_env_and_output, 2, "probe")
    assert out == [("set-after-start", str(tmp_path))] * 2
    captured = capfd.readouterr()
    assert all(f"rank-stdout probe {r}" in captured.out for r in range(2)), captured
    assert all(f"rank-stderr probe {r}" in captured.err for r in range(2)), captured
    monkeypatch.delenv("ENGINE_HARNESS_PROBE")
    assert run_ranks(_env_and_output, 2, "unset") == [(None, str(tmp_path))] * 2


def test_unknown_start_method_is_refused():
    from engine.distributed.spawn import spawn

    with pytest.raises(ValueError, match="start_method must be 'forkserver' or 'spawn'"):
        spawn(_allreduce_rank, 2, start_method="fork")  # type: ignore[arg-type]


# ------------------------------------------------------------------ the benchmarks' "env" mode
def _env_rank(scale):
    """A benchmark-style rank: brings its group up from the torchrun-style environment."""
    from engine.distributed.env import current_launch, init_distributed, shutdown

    info = current_launch()
    env = init_distributed(timeout_s=60, backend="gloo", device="cpu")
    t = torch.tensor([float(env.rank) * scale])
    dist.all_reduce(t)
    shutdown()
    return info.launcher, info.rank, info.agent_store, t.item()


def _env_raise(_):
    from engine.distributed.env import current_launch

    if current_launch().rank == 1:
        raise ValueError("benchmark rank one broke")
    return 0


def test_env_mode_ranks_rendezvous_on_the_parents_store():
    from engine.distributed.spawn import spawn

    out = spawn(_env_rank, 2, (2.0,), rendezvous="env", timeout=scaled(120))
    assert out == [("torchrun", r, True, 2.0) for r in range(2)]
    with pytest.raises(RankFailure, match="rank 1 failed:(.|\n)*benchmark rank one broke"):
        spawn(_env_raise, 2, (None,), rendezvous="env", timeout=scaled(60))
