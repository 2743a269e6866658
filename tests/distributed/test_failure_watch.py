"""The failure watch (engine/distributed/watch.py) on real processes: survivors of a rank that
failed but whose process (and sockets) stay up, as an NCCL rank's peers see it, stop
within seconds naming it, instead of waiting out the collective timeout; with the watch
off they are still blocked (the control); a normal run with the watch polling fast ends
normally. The NCCL path (abort, then failure_guard takes over) is in tests/unit/test_failure_watch.py.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from harness import scaled
from test_bringup import WORKER, _launch

from engine.distributed.spawn import free_port
from engine.distributed.watch import EXIT_PEER_FAILED

FAST = dict(ENGINE_FAILURE_WATCH_INTERVAL=0.3, ENGINE_FAILURE_WATCH_GRACE=scaled(2))


def _start(world: int, **extra) -> list[subprocess.Popen]:
    port = free_port()
    return [subprocess.Popen([sys.executable, WORKER, "linger"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                                                 LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0",
                                                 TORCHELASTIC_RUN_ID="test", MASTER_ADDR="127.0.0.1",
                                                 MASTER_PORT=str(port), OMP_NUM_THREADS="1", TIMEOUT_S="120",
                                                 VICTIM="1", GRACE_S=str(scaled(2)), **{k: str(v) for k, v in extra.items()}))
            for r in range(world)]


def _run_linger(watch_s: float, **extra) -> tuple[list, list[float], bool]:
    """3 ranks, rank 1 fails and lingers; wait up to ``watch_s`` after the survivors block
    for them to exit. Returns [(rc, stderr)], the survivors' seconds from blocking to exit
    (inf if still running), and whether the victim was still alive at the end."""
    procs = _start(3, **extra)
    try:
        blocked = {r: json.loads(procs[r].stdout.readline())["blocked_at"] for r in (0, 2)}  # start-up done
        deadline, ended = max(blocked.values()) + watch_s, {}
        while time.time() < deadline and len(ended) < 2:
            for r in (0, 2):
                if r not in ended and procs[r].poll() is not None:
                    ended[r] = time.time()
            time.sleep(0.05)
        victim_alive = procs[1].poll() is None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outs = [(p.wait(scaled(30)), p.communicate(timeout=scaled(30))[1]) for p in procs]
    took = [ended[r] - blocked[r] if r in ended else float("inf") for r in (0, 2)]
    return outs, took, victim_alive


@pytest.mark.slow
def test_survivors_of_a_failed_but_lingering_rank_stop_within_seconds():
    outs, took, victim_alive = _run_linger(scaled(20), **FAST)
    host = socket.gethostname()
    assert victim_alive, f"the failed rank's own watch stopped it:\n{outs[1][2][-2000:]}"
    for r, t in zip((0, 2), took):
        rc, err = outs[r]
        assert rc == EXIT_PEER_FAILED, f"rank {r} exited with {rc}:\n{err[-3000:]}"
        assert t < scaled(15), (r, t)
        assert f"rank {r}: gradient all-reduce stopped because a peer failed: rank 1 (pid " in err, err
        assert f" on {host}) failed with ValueError: bad batch on the victim" in err, err
        assert f"exiting with code {EXIT_PEER_FAILED}" in err and "Traceback" not in err, err


@pytest.mark.slow
def test_without_the_watch_the_survivors_stay_blocked():
    # the control: gloo sees nothing while the failed rank's sockets stay open
    outs, took, _ = _run_linger(5, ENGINE_FAILURE_WATCH=0)  # twice what the watch needs
    assert took == [float("inf"), float("inf")], (took, [e[-2000:] for _, e in outs])


def test_a_normal_run_with_a_fast_watch_ends_normally():
    results = _launch("ok", 2, timeout=150, SLEEP_S=1, ENGINE_FAILURE_WATCH_INTERVAL=0.05, TIMEOUT_S=scaled(30))
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 0 and out is not None, f"rank {rank} exited with {rc}:\n{err[-3000:]}"
        assert "stopped because a peer failed" not in err and "terminate called" not in err, err
        assert out["watching"] and out["gloo_threads_after"] == 0
