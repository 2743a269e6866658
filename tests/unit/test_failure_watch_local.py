"""engine/distributed/watch.py in one process, with a HashStore standing for the rendezvous store
and threads for the ranks: the NCCL path (the watch aborts the groups, the blocked call
raises, failure_guard names the peer and the exit fallback stays unused), the fallback
when nothing takes over, a rank's own failure, and the settings' parsing."""

from __future__ import annotations

import logging
import os
import socket
import threading

import pytest
import torch.distributed as dist

from engine.distributed.env import DistEnv, LaunchInfo, failure_guard, failure_watch_from_env, record_failure
from engine.distributed.failures import PeerFailureError, register_process
from engine.distributed.watch import EXIT_PEER_FAILED, FailureWatch, WatchSettings, poll_interval


def _env(store, rank: int, world: int = 2, watch: FailureWatch | None = None) -> DistEnv:
    # "single": the store is this HashStore (no TCP probe); agent_store: no rank hosts it
    info = LaunchInfo("single", rank, rank, world, world, "127.0.0.1", 1, agent_store=True)
    return DistEnv(launch=info, device=None, backend="nccl", timeout_s=1.0, store=store, watch=watch)


def _watch(store, rank: int, abort=None, grace_s: float = 5.0):
    exits: list[int] = []
    w = FailureWatch(store, rank, 2, interval_s=0.02, grace_s=grace_s, hosts_store=False, abort=abort,
                     exit=exits.append)
    return w, exits


def test_abort_unblocks_and_failure_guard_names_the_peer():
    store = dist.HashStore()
    for r in range(2):
        register_process(store, r)
    aborted = threading.Event()
    watch, exits = _watch(store, 1, abort=aborted.set)
    env1 = _env(store, 1, watch=watch.start())
    threading.Timer(0.2, lambda: record_failure(_env(store, 0), ValueError("bad batch"))).start()
    with pytest.raises(PeerFailureError) as info:
        with failure_guard(env1, "training", grace_s=1.0):
            assert aborted.wait(10), "the watch never aborted the groups"
            # what a collective on an aborted NCCL communicator raises: not a transport
            # error, so only the watch having fired makes it the peer's failure
            raise RuntimeError("NCCL communicator was aborted on rank 1")
    msg = str(info.value)
    assert msg.startswith("rank 1: training stopped because a peer failed: rank 0 failed with ValueError: bad batch")
    assert "(here: NCCL communicator was aborted on rank 1)" in msg
    assert not store.check(["engine/failed/1"])  # not recorded as rank 1's own failure
    watch._thread.join(10)
    assert exits == [] and store.add("engine/count/seen", 0) == 1


def test_unguarded_rank_logs_and_exits_when_nothing_unblocks(caplog):
    store = dist.HashStore()
    register_process(store, 0)
    watch, exits = _watch(store, 1, grace_s=0.2)
    with caplog.at_level(logging.ERROR, logger="engine.distributed.watch"):
        watch.start()
        record_failure(_env(store, 0), ValueError("bad batch"))
        watch._thread.join(10)
    assert exits == [EXIT_PEER_FAILED]
    assert (f"rank 1: distributed work stopped because a peer failed: rank 0 (pid {os.getpid()} on "
            f"{socket.gethostname()}) failed with ValueError: bad batch; stopping this rank") in caplog.text


def test_own_failure_and_normal_stop_never_fire():
    store = dist.HashStore()
    watch, exits = _watch(store, 0, grace_s=0.1)
    env0 = _env(store, 0, watch=watch.start())
    with pytest.raises(ValueError), failure_guard(env0, "training"):
        raise ValueError("mine")
    watch._thread.join(10)
    assert exits == [] and watch.fired is None and store.add("engine/count/failed", 0) == 1
    quiet, exits2 = _watch(dist.HashStore(), 1, grace_s=0.1)
    quiet.start()
    quiet.stop()  # shutdown(): joins at once, nothing recorded
    assert not quiet._thread.is_alive() and exits2 == [] and quiet.fired is None


def test_settings_from_the_environment():
    assert failure_watch_from_env({}) == WatchSettings(True, None, 5.0)
    assert failure_watch_from_env({"ENGINE_FAILURE_WATCH": "off"}).enabled is False
    s = failure_watch_from_env({"ENGINE_FAILURE_WATCH_INTERVAL": "0.5", "ENGINE_FAILURE_WATCH_GRACE": "3"})
    assert (s.interval_s, s.grace_s) == (0.5, 3.0)
    for bad in ("0", "-1", "x", "inf"):
        with pytest.raises(ValueError, match="ENGINE_FAILURE_WATCH_INTERVAL"):
            failure_watch_from_env({"ENGINE_FAILURE_WATCH_INTERVAL": bad})
    with pytest.raises(ValueError, match="ENGINE_FAILURE_WATCH="):
        failure_watch_from_env({"ENGINE_FAILURE_WATCH": "maybe"})
    # ~1000 store requests per second at most, whatever the world size
    assert poll_interval(8) == 1.0 and poll_interval(4096) == 4.096 and poll_interval(8, 0.3) == 0.3
