"""init_distributed end to end on real processes with a torchrun-style environment, the
dead-rank behaviour (bounded by the collective timeout, the culprit named), and clean
shutdown (every rank exits 0, no gloo thread outlives shutdown()).

Ranks are started with subprocess (not the harness) because the point is the real
launch path: environment parsing, the rendezvous store rank 0 hosts, interpreter exit.
"""

import json
import os
import subprocess
import sys
import time

import pytest
from harness import scaled

from engine.distributed.env import LaunchError, init_distributed
from engine.distributed.spawn import free_port

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bringup_worker.py")



def _launch(scenario, world, timeout=60.0, kill_after=None, **extra):
    """Start ``world`` ranks like torchrun would; return [(returncode, json or None, stderr)].

    ``kill_after``: rank whose process is killed once every other rank has finished
    (the hung victim). Every process is killed in ``finally``.
    """
    port = free_port()
    procs = []
    try:
        for r in range(world):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                       LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", TORCHELASTIC_RUN_ID="test",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                       **{k: str(v) for k, v in extra.items()})
            if world == 1 and scenario == "single":
                env = {k: v for k, v in env.items()
                       if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                    "GROUP_RANK", "TORCHELASTIC_RUN_ID", "MASTER_ADDR",
                                    "MASTER_PORT")}
            procs.append(subprocess.Popen([sys.executable, WORKER, scenario], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
        deadline = time.monotonic() + scaled(timeout)
        results = [None] * world
        for r, p in enumerate(procs):
            if r == kill_after:
                continue
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            line = out.strip().splitlines()[-1] if out.strip() else None
            results[r] = (p.returncode, json.loads(line) if line else None, err)
        if kill_after is not None:
            procs[kill_after].kill()
            out, err = procs[kill_after].communicate(timeout=scaled(30))
            results[kill_after] = (procs[kill_after].returncode, None, err)
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=scaled(30))


def test_bringup_collectives_groups_and_clean_shutdown():
    world = 4
    results = _launch("ok", world, TIMEOUT_S=scaled(30))
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exited with {rc}:\n{err[-3000:]}"
        assert "terminate called" not in err
        assert out["launcher"] == "torchrun" and out["rank"] == rank
        assert (out["world"], out["local_rank"]) == (world, rank)
        assert (out["device"], out["backend"]) == ("cpu", "gloo")  # CPU-only torch here
        assert out["dist"] == [rank, world, "gloo"]
        assert out["sum"] == sum(range(world))
        tp = [rank - rank % 2, rank - rank % 2 + 1]
        assert out["tp_ranks"] == tp and out["tp_sum"] == sum(tp)
        assert out["initialized_after"] is False
        assert out["gloo_threads_after"] == 0, "a gloo worker thread outlived shutdown()"


def test_single_process_without_launcher():
    ((rc, out, err),) = _launch("single", 1, TIMEOUT_S=scaled(30))
    assert rc == 0, err[-3000:]
    assert (out["launcher"], out["world"], out["sum"], out["gloo_threads_after"]) == \
        ("single", 1, 0.0, 0)


def test_shutdown_releases_a_default_group_pinned_by_torch():
    """torch.distributed.nn.functional binds group.WORLD as a default argument when first
    imported (by torch._dynamo, by the first optimizer); shutdown() must still free the group."""
    results = _launch("user_init", 2, TIMEOUT_S=scaled(30))
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exited with {rc}:\n{err[-3000:]}"
        assert out == {"sum": 2.0, "gloo_threads_after": 0}, out


def _check_named(results, victim, what, max_elapsed):
    for rank, (rc, out, err) in enumerate(results):
        if rank == victim:
            continue
        assert rc == 0 and out is not None, f"rank {rank} exited with {rc}:\n{err[-3000:]}"
        assert out["error"] is not None, f"rank {rank} did not notice the failure"
        assert what in out["error"], out["error"]
        assert out["elapsed"] < max_elapsed, (rank, out["elapsed"], out["error"])


def test_dead_rank_is_named_quickly():
    # the victim's sockets close, so survivors fail fast (well before the 20 s timeout)
    # and each finds the victim's process gone on this host
    results = _launch("die", 3, VICTIM=1, TIMEOUT_S=scaled(20), GRACE_S=scaled(5))
    assert results[1][0] == 3
    _check_named(results, 1, "rank 1 is no longer running (pid", max_elapsed=scaled(20 + 5))


def test_dead_store_host_is_named():
    # rank 0 hosts the rendezvous store (no torchrun agent here), so its death takes the
    # store with it; survivors say so instead of hanging on the store
    results = _launch("die", 3, VICTIM=0, TIMEOUT_S=scaled(20), GRACE_S=scaled(5))
    assert results[0][0] == 3
    _check_named(results, 0, "rendezvous store is unreachable: rank 0, which hosts it, is gone",
                 max_elapsed=scaled(25))


def test_raising_rank_is_named_with_its_error():
    results = _launch("raise", 3, VICTIM=2, TIMEOUT_S=scaled(20), GRACE_S=scaled(5))
    assert results[2][0] != 0 and "bad batch on the victim" in results[2][2]
    _check_named(results, 2, "rank 2 failed with ValueError: bad batch on the victim",
                 max_elapsed=scaled(25))


@pytest.mark.slow
def test_hung_rank_is_bounded_by_the_collective_timeout():
    timeout_s, grace_s = scaled(3.0), scaled(1.0)
    results = _launch("hang", 3, kill_after=0, VICTIM=0, TIMEOUT_S=timeout_s, GRACE_S=grace_s)
    # survivors give up after the collective timeout plus the grace period, not never;
    # rank 0 hosts the store and is alive (just hung), so it is named as still running
    _check_named(results, 0, f"rank 0 still running, not stopped within {grace_s:g}s",
                 max_elapsed=timeout_s + grace_s + scaled(15))
    for rank in (1, 2):
        assert "Timed out" in results[rank][1]["error"]
        assert results[rank][1]["elapsed"] >= timeout_s * 0.9


@pytest.mark.parametrize("kw,match", [
    (dict(backend="nccl", device="cpu"), "backend 'nccl' does not fit device cpu"),
    (dict(backend="gloo", device="tpu"), "unsupported device 'tpu'"),
    (dict(device="meta"), "unsupported device 'meta'"),
    (dict(timeout_s=0), "timeout_s must be positive"),
])
def test_init_argument_errors(kw, match):
    with pytest.raises((LaunchError, ValueError), match=match):
        init_distributed(environ={}, argv=["x"], **kw)


def test_cuda_requested_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the error path is for CPU-only builds")
    with pytest.raises(LaunchError, match="CUDA is not available"):
        init_distributed(environ={}, argv=["x"], device="cuda")


def test_environment_errors_surface_before_any_connection():
    with pytest.raises(LaunchError, match="'torchrun'.*MASTER_PORT"):
        init_distributed(environ={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                  "TORCHELASTIC_RUN_ID": "x", "MASTER_ADDR": "h"}, argv=["x"])
