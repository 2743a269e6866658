"""engine/distributed/failures.py's records under the run's output: how survivors name the cause
once rank 0, which hosts the rendezvous store, is gone (issue 19)."""

from __future__ import annotations

from engine.distributed import failures as F
from engine.distributed.env import DistEnv, LaunchInfo


def _env(rank: int) -> DistEnv:
    info = LaunchInfo("slurm", rank, rank, 3, 3, "127.0.0.1", 1)  # port 1: no store listens there
    return DistEnv(launch=info, device=None, backend="gloo", timeout_s=1.0, store=None)


def test_causes_keep_only_failed_and_killed_ranks():
    diagnosis = ("rank 1 failed with ValueError: x; rank 2 is no longer running (pid 7 on h) and reported "
                 "nothing: killed or crashed; rank 3 stopped because of it; rank 4 still running, not stopped")
    assert F._causes(diagnosis) == ("rank 1 failed with ValueError: x; rank 2 is no longer running (pid 7 on h) "
                                    "and reported nothing: killed or crashed")


def test_store_gone_reads_failures_then_survivor_findings(tmp_path):
    d = str(tmp_path)
    assert F._store_gone(_env(2), None, 0.1).startswith("the rendezvous store is unreachable: rank 0")
    F._write_record(d, 0, "stopped", "rank 1 is no longer running (pid 7 on h) and reported nothing: killed")
    msg = F._store_gone(_env(2), d, 0.1)
    assert msg == ("rank 1 is no longer running (pid 7 on h) and reported nothing: killed (found by rank 0 while "
                   "the rendezvous store was up)")
    F._write_record(d, 0, "failed", "ValueError: boom")
    assert F._store_gone(_env(2), d, 0.1) == "rank 0 failed with ValueError: boom"
    assert not F._store_reachable(_env(2))
