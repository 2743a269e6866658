"""Run a function on N ranks in subprocesses over gloo.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` fresh interpreters, brings up
a gloo process group in each (rendezvous through a ``TCPStore`` that the parent owns, so
there is no free-port race), calls ``fn(rank, world_size, *args)`` and returns the list
of per-rank return values (which must be picklable; tensors are fine).

Failure behaviour (what a test sees):
- a rank that raises: the others are killed at once and ``RankFailure`` carries that
  rank's traceback (the first failing rank is named);
- a rank that dies without a traceback (segfault, ``os._exit``): named by rank and exit code;
- nothing finishes within ``timeout`` seconds: every rank is killed and ``RankTimeout``
  names the ranks that had not reported;
- no process outlives the call (``finally`` kills survivors).

Strict NCCL-rules mode (``engine.dist.strict``) is on in every rank when
``ENGINE_STRICT_COMM`` is set (tests/conftest.py sets it for the whole suite).

``fn`` must be importable by the child (module level in a test file).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import time
import traceback
from typing import Any, Callable, Optional

__all__ = ["run_ranks", "RankFailure", "RankTimeout"]


class RankFailure(AssertionError):
    pass


class RankTimeout(AssertionError):
    pass


def _worker(fn: Callable, rank: int, world_size: int, port: int, results, args, kwargs,
            collective_timeout_s: float, env: dict) -> None:
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=collective_timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        # NCCL's rules checked on gloo (engine.dist.strict): on for the whole test suite
        # (tests/conftest.py sets ENGINE_STRICT_COMM=1; env={"ENGINE_STRICT_COMM": "0"} opts out)
        from engine.dist.env import strict_comm_from_env

        if strict_comm_from_env():
            from engine.dist import strict

            strict.enable("cpu")
        # Plain pickle copies tensors into bytes (the queue's own pickler would pass them as
        # shared memory that vanishes when this process exits), and pickling now drops every
        # reference the result held before the groups are torn down.
        out = pickle.dumps(fn(rank, world_size, *args, **kwargs))
        # The engine's teardown, as every entry point uses it: drain every group in creation
        # order, destroy them, collect. A bare barrier + destroy leaves subgroups' gloo
        # threads to meet interpreter finalisation, which aborts the process (exit -6) now
        # and then; see docs/launching.md.
        from engine.dist.env import shutdown

        shutdown()
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - we report every failure, SystemExit included
        results.put((rank, "error", traceback.format_exc()))


def _explain_failure(procs, outputs: dict, rank: int, payload: str) -> str:
    """Name the root cause: a rank that died silently makes its peers fail with
    'connection reset', so a silent death found within a short grace period comes first."""
    time.sleep(0.5)
    dead = [f"rank {r} exited with code {p.exitcode} without reporting a result"
            for r, p in enumerate(procs)
            if r != rank and r not in outputs and p.exitcode not in (None, 0)]
    msg = f"rank {rank} failed:\n{payload}"
    return "; ".join(dead) + "\nthen " + msg if dead else msg


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0,
              collective_timeout: Optional[float] = None, env: Optional[dict] = None,
              **kwargs: Any) -> list[Any]:
    import torch.distributed as dist

    collective_timeout = collective_timeout if collective_timeout is not None else timeout
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=collective_timeout))
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, name=f"rank{r}", daemon=True,
                    args=(fn, r, world_size, store.port, results, args, kwargs,
                          collective_timeout, dict(env or {})))
        for r in range(world_size)
    ]
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        while len(outputs) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.2)
            except queue_mod.Empty:
                for r, p in enumerate(procs):
                    if r not in outputs and p.exitcode is not None:
                        # give a racing traceback a moment to arrive before blaming the exit
                        try:
                            rank, status, payload = results.get(timeout=1.0)
                            break
                        except queue_mod.Empty:
                            raise RankFailure(f"rank {r} exited with code {p.exitcode} "
                                              f"without reporting a result") from None
                else:
                    if time.monotonic() > deadline:
                        missing = [r for r in range(world_size) if r not in outputs]
                        raise RankTimeout(f"ranks {missing} did not finish within {timeout:.0f}s")
                    continue
            if status == "error":
                raise RankFailure(_explain_failure(procs, outputs, rank, payload))
            outputs[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        for r, p in enumerate(procs):
            if p.exitcode not in (0, None):
                raise RankFailure(f"rank {r} reported success but exited with code {p.exitcode}")
        return [outputs[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        results.close()
        del store
