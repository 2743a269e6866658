"""The one process launcher of the tests and the benchmarks (single host, no torchrun).

:func:`spawn` runs ``fn`` on ``nprocs`` fresh rank processes and returns the per-rank return
values (picklable; tensors are fine). The parent owns the
rendezvous ``TCPStore`` on a port the OS chose, so there is no free-port race, and every
rank connects to it as a client. Two ways to bring a rank up (``rendezvous``):

- ``"gloo"`` (the tests): the child joins a gloo group through that store, calls
  ``fn(rank, nprocs, *args, **kwargs)`` and tears the groups down with
  :func:`engine.distributed.env.shutdown` before it reports; a rank that reports and then exits
  non-zero (an abort at interpreter exit) is a failure.
- ``"env"`` (the benchmarks): the child gets the environment torchrun would give it
  (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT, and
  TORCHELASTIC_USE_AGENT_STORE so rank 0 connects instead of hosting the store) and calls
  ``fn(*args, **kwargs)``, which initialises its process group itself
  (:func:`engine.distributed.env.init_distributed`). Once its result has left, the child ends
  with ``os._exit(0)``: DeepSpeed's ZeRO-3 occasionally aborts in its own atexit teardown
  on CPU, which must not fail a measurement that has finished.

How a rank process starts (``start_method``):

- ``"forkserver"`` (the default in ``"gloo"`` mode, the tests): ``multiprocessing``'s fork server,
  started once per parent process with torch, torch.distributed, torch._dynamo and the engine's
  training modules imported (:data:`PRELOAD`, plus pytest when the parent has imported it; no
  process group, no thread pool, no engine state: importing them runs no engine code but
  definitions), forks each rank. A fresh interpreter spends 2-3 s of CPU importing torch (the
  first optimizer step imports torch._dynamo) and about 1 s more importing the engine and
  pytest, once per rank per call: most of a short test's time on two cores. The engine reads
  its environment variables when it runs, never at import, so a preloaded module behaves as a
  fresh one. Everything else is as in a spawned rank: ``fn``'s module is imported fresh in
  every rank, the rank gets the parent's environment and working directory as they are at the
  call, and its stdout/stderr are the parent's at the call (pytest's capture of the running
  test), not the fork server's. A forked rank ends with ``os._exit`` after its result has left
  (non-daemon threads joined, ``atexit`` handlers not run), so the interpreter-finalisation
  abort that :func:`engine.distributed.env.shutdown` prevents cannot show here; shutdown's
  warning about gloo threads that outlive it still does, and ``start_method="spawn"``
  (tests/harness.py: ``ENGINE_TEST_START_METHOD=spawn``) runs ranks as fresh interpreters
  that finalise normally.
- ``"spawn"`` (the default in ``"env"`` mode, the benchmarks, whose memory figures must not
  share pages with a fork server): a fresh interpreter per rank.

Failure behaviour (what a caller sees):

- a rank that raises: the others are killed at once and :class:`RankFailure` carries
  that rank's traceback; a peer that died silently just before is named first (its death
  is the root cause of the others' "connection reset");
- a rank that dies without a traceback (segfault, ``os._exit``): named by rank and exit code;
- nothing finishes within ``timeout`` seconds: every rank is killed and
  :class:`RankTimeout` names the ranks that had not reported;
- no process outlives the call (``finally`` kills survivors).

:func:`start_script` is the launcher of the entry point's tests: ``nprocs`` copies of a
command, each with the variables ``srun`` would set, as ``subprocess.Popen`` objects the
caller waits on (signals, exit codes and output are what those tests check).

Strict NCCL-rules mode (``engine.distributed.strict``) is on in a ``"gloo"`` rank when
``ENGINE_STRICT_COMM`` is set (tests/conftest.py sets it for the whole suite); an
``"env"`` rank gets it from ``init_distributed``. ``fn`` must be importable by the child
(module level).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Optional, Sequence

from engine.validate import check_int

__all__ = ["spawn", "start_script", "free_port", "SpawnError", "RankFailure", "RankTimeout", "Rendezvous",
           "StartMethod", "PRELOAD"]

Rendezvous = Literal["gloo", "env"]
StartMethod = Literal["forkserver", "spawn"]
_HOST = "127.0.0.1"
# What the fork server imports before it forks ranks: torch, and the engine's training modules
# (module-level definitions only; no engine module reads the environment at import).
# torch.distributed.nn.functional before any process group exists, as
# engine.distributed.teardown.bind_world_defaults_early wants it.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.nn.functional", "torch._dynamo",
           "engine.training.trainer", "engine.checkpoint", "engine.generate")


class SpawnError(RuntimeError):
    """A spawned rank failed or did not finish."""


class RankFailure(SpawnError):
    """A rank raised, died without a result, or exited non-zero after reporting."""


class RankTimeout(SpawnError):
    """Some ranks did not report within the timeout."""


def free_port() -> int:
    """A TCP port free on this host now (for launchers whose ranks host their own store)."""
    with socket.socket() as s:
        s.bind((_HOST, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class _Child:
    """What every child needs besides ``fn`` and its arguments."""

    rendezvous: Rendezvous
    nprocs: int
    port: int
    collective_timeout_s: float
    threads: Optional[int]
    env: Mapping[str, str] = field(default_factory=dict)
    # the parent's whole environment at the call (a forked rank has the fork server's); None: inherited
    parent_env: Optional[Mapping[str, str]] = None


def _adopt_stdio(out: Any, err: Any) -> bool:
    """In a forked rank: make fds 1 and 2 the parent's at the call (``out``/``err``: the
    fork server's handles of the descriptors the parent sent)."""
    import sys

    for stream, handle, fd in ((sys.stdout, out, 1), (sys.stderr, err, 2)):
        if stream is not None:
            stream.flush()
        received = handle.detach()
        os.dup2(received, fd)
        os.close(received)
    return True


class _ParentStdio:
    """Pickled while a forkserver rank starts: sends the parent's current fds 1 and 2 along,
    and on unpickling in the rank (the first of its arguments, before ``fn``'s module is
    imported) installs them as the rank's own."""

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction

        return (_adopt_stdio, (reduction.DupFd(1), reduction.DupFd(2)))


def _join_gloo(rank: int, c: _Child) -> None:
    import torch.distributed as dist

    from engine.distributed.env import strict_comm_from_env

    timeout = datetime.timedelta(seconds=c.collective_timeout_s)
    store = dist.TCPStore(_HOST, c.port, c.nprocs, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=c.nprocs, timeout=timeout)
    # NCCL's rules checked on gloo (engine.distributed.strict): on for the whole test suite
    # (env={"ENGINE_STRICT_COMM": "0"} opts out)
    if strict_comm_from_env():
        from engine.distributed import strict

        strict.enable("cpu")


def _child_main(stdio: Any, fn: Callable[..., Any], rank: int, results: Any, args: tuple, kwargs: dict,
                c: _Child) -> None:
    del stdio  # installed while unpickling (_ParentStdio); None for a spawned rank
    if c.parent_env is not None:
        os.environ.clear()
        os.environ.update(c.parent_env)
    os.environ.update(c.env)
    if c.rendezvous == "env":
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(c.nprocs), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(c.nprocs), MASTER_ADDR=_HOST, MASTER_PORT=str(c.port),
                          TORCHELASTIC_USE_AGENT_STORE="True")
    if c.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(c.threads)
    import torch

    if c.threads is not None:
        torch.set_num_threads(c.threads)
    try:
        if c.rendezvous == "gloo":
            _join_gloo(rank, c)
            out = fn(rank, c.nprocs, *args, **kwargs)
        else:
            out = fn(*args, **kwargs)
        # Plain pickle copies tensors into bytes (the queue's own pickler would pass them as
        # shared memory that vanishes when this process exits), and pickling now drops every
        # reference the result held before the groups are torn down.
        payload = pickle.dumps(out)
        del out
        if c.rendezvous == "gloo":
            # the engine's teardown, as every entry point uses it: drain every group in
            # creation order, destroy them, collect (a bare destroy leaves subgroups' gloo
            # threads to meet interpreter finalisation: exit -6 now and then, docs/launching.md)
            from engine.distributed.env import shutdown

            shutdown()
        results.put((rank, "ok", payload))
    except BaseException:  # noqa: BLE001 - we report every failure, SystemExit included
        results.put((rank, "error", traceback.format_exc()))
        return
    if c.rendezvous == "env":
        results.close()
        results.join_thread()  # the result has left this process
        os._exit(0)


def _explain_failure(procs: Sequence[Any], outputs: Mapping[int, Any], rank: int, payload: str) -> str:
    """Name the root cause: a rank that died silently makes its peers fail with
    'connection reset', so a silent death found within a short grace period comes first."""
    time.sleep(0.5)
    dead = [f"rank {r} exited with code {p.exitcode} without reporting a result"
            for r, p in enumerate(procs)
            if r != rank and r not in outputs and p.exitcode not in (None, 0)]
    msg = f"rank {rank} failed:\n{payload}"
    return "; ".join(dead) + "\nthen " + msg if dead else msg


def _collect(procs: Sequence[Any], results: Any, nprocs: int, timeout: float) -> dict[int, Any]:
    """Every rank's unpickled result, or the first failure / the timeout as an exception."""
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(outputs) < nprocs:
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
                    missing = [r for r in range(nprocs) if r not in outputs]
                    raise RankTimeout(f"ranks {missing} did not finish within {timeout:.0f}s") from None
                continue
        if status == "error":
            raise RankFailure(_explain_failure(procs, outputs, rank, payload))
        outputs[rank] = pickle.loads(payload)
    return outputs


def process_context(method: StartMethod = "forkserver") -> Any:
    """The ``multiprocessing`` context ranks start from: a ForkServerContext whose server has
    imported ``PRELOAD`` (and pytest, under pytest), or a SpawnContext. Also for tests that
    start a plain process to kill it (no rank, no result queue)."""
    ctx: Any = mp.get_context(method)
    if method == "forkserver":
        # takes effect when the server first starts; pytest too under pytest (test modules import it)
        ctx.set_forkserver_preload(list(PRELOAD) + (["pytest"] if "pytest" in sys.modules else []))
    return ctx


def spawn(fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), kwargs: Optional[Mapping[str, Any]] = None,
          *, rendezvous: Rendezvous = "gloo", timeout: float = 120.0, collective_timeout: Optional[float] = None,
          threads: Optional[int] = 1, env: Optional[Mapping[str, str]] = None,
          start_method: Optional[StartMethod] = None) -> list[Any]:
    """Run ``fn`` on ``nprocs`` new rank processes and return their results in rank order.

    ``timeout``: seconds for the whole run; ``collective_timeout`` (default ``timeout``):
    the store's and the gloo group's timeout in ``"gloo"`` mode; ``threads``: the ranks'
    ``OMP_NUM_THREADS`` and torch intra-op threads (``None``: inherited); ``env``: extra
    variables set in each rank before ``fn`` runs; ``start_method``: ``"forkserver"`` or
    ``"spawn"`` (default: ``"forkserver"`` in ``"gloo"`` mode, ``"spawn"`` in ``"env"`` mode;
    see the module docstring).
    """
    import torch.distributed as dist

    check_int("nprocs", nprocs, minimum=1, fix="spawn at least one rank", error=ValueError)
    if rendezvous not in ("gloo", "env"):
        raise ValueError(f"rendezvous must be 'gloo' or 'env', got {rendezvous!r}")
    method = start_method or ("forkserver" if rendezvous == "gloo" else "spawn")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    collective_timeout = collective_timeout if collective_timeout is not None else timeout
    # the parent hosts the store: its port is bound before any child starts (no race)
    store = dist.TCPStore(_HOST, 0, nprocs + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=collective_timeout))
    forked = method == "forkserver"
    child = _Child(rendezvous, nprocs, store.port, collective_timeout, threads, dict(env or {}),
                   dict(os.environ) if forked else None)
    ctx = process_context(method)
    results = ctx.Queue()
    procs = [ctx.Process(target=_child_main, name=f"rank{r}", daemon=True,
                         args=(_ParentStdio() if forked else None, fn, r, results, tuple(args),
                               dict(kwargs or {}), child))
             for r in range(nprocs)]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        outputs = _collect(procs, results, nprocs, timeout)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        for r, p in enumerate(procs):
            if p.exitcode not in (0, None):
                raise RankFailure(f"rank {r} reported success but exited with code {p.exitcode}")
        return [outputs[r] for r in range(nprocs)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        results.close()
        del store


def start_script(command: Sequence[str], nprocs: int, *, env: Mapping[str, str], cwd: str,
                 job_id: str = "1") -> list[subprocess.Popen]:
    """Start ``nprocs`` copies of ``command`` as ``srun`` would on one node (SLURM_PROCID,
    SLURM_LOCALID, SLURM_NTASKS, SLURM_JOB_ID, SLURM_JOB_NODELIST; MASTER_ADDR/PORT on a free
    port). One process gets ``env`` unchanged (no launcher variables). Text pipes for
    stdout and stderr; the caller waits, signals and kills."""
    check_int("nprocs", nprocs, minimum=1, fix="start at least one process", error=ValueError)
    port = free_port()
    procs = []
    for rank in range(nprocs):
        rank_env = dict(env)
        if nprocs > 1:
            rank_env.update(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS=str(nprocs),
                            SLURM_JOB_ID=job_id, SLURM_JOB_NODELIST="localhost", MASTER_ADDR=_HOST,
                            MASTER_PORT=str(port))
        procs.append(subprocess.Popen(list(command), cwd=cwd, env=rank_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs
