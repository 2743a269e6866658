"""Fail fast when a peer fails, whatever the backend (docs/launching.md, "GPU clusters").

gloo raises in a survivor's collective as soon as a failed peer's sockets close, and
:func:`~engine.distributed.failures.failure_guard` names the culprit. NCCL does not notice: the
survivors sit in the collective until the watchdog timeout (30 minutes by default), then
the C++ watchdog tears the process down with no Python exception and no message. A failed
rank does leave its exception in the rendezvous store (``record_failure``), so each rank
runs a :class:`FailureWatch`, a daemon thread started by ``init_distributed``, that polls
the store's failure counter and, when another rank has failed:

1. reads which rank (its host and pid, its error) and acknowledges (``engine/count/seen``),
   so the failed rank, when it hosts the store, knows every peer has read it before its
   process (and the store) goes;
2. aborts the process groups where the backend can (NCCL: ``ncclCommAbort`` makes the
   blocked collective return an error, which ``failure_guard`` turns into its usual
   ``PeerFailureError``); gloo's abort does not unblock a collective (checked, torch 2.13)
   and would stop it from ever seeing the closed sockets, so on gloo nothing is aborted;
3. if no ``failure_guard`` took over within ``grace_s`` (or none is active), logs the
   diagnosis, flushes, and ends the process with :data:`EXIT_PEER_FAILED`.

A rank's own failure, a guard that is already handling an error, and a normal shutdown
(``shutdown()`` stops the watch before its barriers, so no rank can leave while a peer
still polls) never trigger it. If the store itself becomes unreachable (its host, rank 0,
is gone) the watch stops quietly: that is not distinguishable here from a job whose rank 0
finished early, and a TCPStore call on a dead store prints a C++ stack trace.

Store load: one ``add(key, 0)`` per rank every ``interval_s``; the default
``max(1 s, world_size / 1000 s)`` keeps the store host under ~1000 small requests per
second at any scale (1 s up to 1000 ranks, 4 s at 4096), and detection within one interval.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["EXIT_PEER_FAILED", "FailureWatch", "WatchSettings", "abort_all_groups", "mark_first_failure", "poll_interval",
           "stop_all"]

logger = logging.getLogger(__name__)

# sysexits' EX_TEMPFAIL: this rank is healthy, a peer failed; distinct from launch/train.py's
# 1 (failure), 2 (bad input) and 130 (interrupted)
EXIT_PEER_FAILED = 75

_KEY = "engine/{}/{}"  # the layout of engine.distributed.failures
FAILED_COUNT = _KEY.format("count", "failed")
SEEN_COUNT = _KEY.format("count", "seen")
FIRST_FAILED = _KEY.format("first", "failed")

_RUNNING: "set[FailureWatch]" = set()
_RUNNING_LOCK = threading.Lock()


@dataclass(frozen=True)
class WatchSettings:
    """``enabled``: run the watch (``ENGINE_FAILURE_WATCH``, default on); ``interval_s``:
    seconds between polls (``ENGINE_FAILURE_WATCH_INTERVAL``; None = :func:`poll_interval`);
    ``grace_s``: how long a guard may take to take over before the process exits
    (``ENGINE_FAILURE_GRACE_S``; older name ``ENGINE_FAILURE_WATCH_GRACE``)."""

    enabled: bool = True
    interval_s: Optional[float] = None
    grace_s: float = 5.0


def poll_interval(world_size: int, interval_s: Optional[float] = None) -> float:
    """The poll period: ``interval_s`` if given, else ``max(1, world_size / 1000)`` seconds
    (at most ~1000 store requests per second in total)."""
    return float(interval_s) if interval_s is not None else max(1.0, world_size / 1000.0)


def _default_exit(code: int) -> None:
    import os

    os._exit(code)


def _flush() -> None:
    for h in logging.getLogger().handlers + logger.handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001 - a broken handler must not stop the exit
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass


class FailureWatch:
    """One rank's watch over the failure counter of the rendezvous store (module doc).

    ``abort``: what unblocks this rank's collectives (None where nothing can, e.g. gloo);
    ``hosts_store``: this process hosts the store (it waits, bounded, for the peers to have
    read a failure before it exits); ``exit``: replaced in tests.
    """

    def __init__(self, store, rank: int, world_size: int, interval_s: float, grace_s: float,
                 hosts_store: bool, abort: Optional[Callable[[], None]] = None,
                 exit: Callable[[int], None] = _default_exit) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval_s, self.grace_s, self.hosts_store = interval_s, grace_s, hosts_store
        self._abort, self._exit = abort, exit
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._taken_over = threading.Event()
        self._guards: list[str] = []  # the `what` of each active failure_guard, innermost last
        self._quiet = False  # this rank failed itself, or a guard is handling an error
        self._exiting = False
        self.fired: Optional[str] = None  # the cause found, once the watch fired
        self._thread = threading.Thread(target=self._run, name="engine-failure-watch", daemon=True)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "FailureWatch":
        with _RUNNING_LOCK:
            _RUNNING.add(self)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling and wait for an in-flight store call (normal shutdown: before the
        barriers, so no peer leaves, taking the store, while this rank still polls). A watch
        that already fired keeps its exit deadline."""
        self._stop.set()
        with _RUNNING_LOCK:
            _RUNNING.discard(self)
        if self.fired is None and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10.0)

    # ------------------------------------------------------------- guard protocol
    def enter_guard(self, what: str) -> None:
        with self._lock:
            self._guards.append(what)

    def exit_guard(self) -> None:
        with self._lock:
            if self._guards:
                self._guards.pop()

    def take_over(self) -> Optional[str]:
        """A guard is handling an error on this rank: stand down for good (no exit from
        here). Returns the cause the watch found, if it fired."""
        with self._lock:
            self._quiet = True
            if not self._exiting:
                self._taken_over.set()
            return self.fired

    def own_failure(self) -> None:
        """This rank failed: its own error is on its way out, never a reason to abort it."""
        with self._lock:
            self._quiet = True

    def wait_until_seen(self, limit_s: Optional[float] = None) -> None:
        """On the store host after its own failure: keep the store up until every peer has
        acknowledged it (or failed itself), at most ``limit_s`` (two polls and 2 s)."""
        deadline = time.monotonic() + (2 * self.interval_s + 2.0 if limit_s is None else limit_s)
        try:
            while time.monotonic() < deadline:
                if self.store.add(SEEN_COUNT, 0) + self.store.add(FAILED_COUNT, 0) >= self.world_size:
                    return
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - nothing to wait for without a store
            logger.debug("store unavailable while waiting for peers", exc_info=True)

    # ------------------------------------------------------------------- the thread
    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._quiet:
                return
            try:
                cause = self._poll()
            except Exception:  # noqa: BLE001 - the store is gone (module doc): stop quietly
                logger.debug("failure watch stopped: store unreachable", exc_info=True)
                return
            if cause is not None:
                self._fire(cause)
                return

    def _poll(self) -> Optional[str]:
        """The cause, if another rank has recorded a failure: 'rank R (pid P on host H)
        failed with E'."""
        if self.store.add(FAILED_COUNT, 0) <= 0 or not self.store.check([FIRST_FAILED]):
            return None  # the first failed rank is written before the counter; re-read next poll
        r = int(self.store.get(FIRST_FAILED).decode())
        if r == self.rank:
            return None
        line = self.store.get(_KEY.format("failed", r)).decode(errors="replace")
        proc = _KEY.format("proc", r)
        where = ""
        if self.store.check([proc]):
            host, pid = self.store.get(proc).decode().split()
            where = f" (pid {pid} on {host})"
        return f"rank {r}{where} failed with {line}"

    def _message(self, cause: str, tail: str) -> str:
        what = self._guards[-1] if self._guards else "distributed work"
        return f"rank {self.rank}: {what} stopped because a peer failed: {cause}; {tail}"

    def _fire(self, cause: str) -> None:
        with self._lock:
            if self._quiet:
                return
            self.fired, guarded = cause, bool(self._guards)
        try:
            self.store.add(SEEN_COUNT, 1)
        except Exception:  # noqa: BLE001
            logger.debug("could not acknowledge the failure", exc_info=True)
        if not guarded:  # nobody else will report it: say it now, before anything can hang
            logger.error("%s", self._message(cause, f"stopping this rank (exit code {EXIT_PEER_FAILED} "
                                                    f"within {self.grace_s:g}s)"))
            _flush()
        if self._abort is not None:  # in its own thread: an abort can hang too
            threading.Thread(target=self._run_abort, name="engine-failure-abort", daemon=True).start()
        if self._taken_over.wait(self.grace_s):
            return  # failure_guard reports it and ends the process
        with self._lock:
            if self._taken_over.is_set():
                return
            self._exiting = True
        if guarded:
            logger.error("%s", self._message(cause, f"its collectives could not be interrupted within "
                                                    f"{self.grace_s:g}s: exiting with code {EXIT_PEER_FAILED}"))
        if self.hosts_store:
            self.wait_until_seen(self.grace_s)
        _flush()
        self._exit(EXIT_PEER_FAILED)

    def _run_abort(self) -> None:
        try:
            assert self._abort is not None
            self._abort()
        except Exception:  # noqa: BLE001 - the groups may be half torn down already
            logger.debug("aborting the process groups failed", exc_info=True)


def stop_all() -> None:
    """Stop every running watch of this process (``shutdown()`` calls it first)."""
    with _RUNNING_LOCK:
        watches = list(_RUNNING)
    for w in watches:
        w.stop()


def mark_first_failure(store, rank: int) -> None:
    """Name ``rank`` as the first to fail unless another rank already is (the rank whose
    ``engine/failed/<rank>`` the watches report). Call it before the failure counter grows."""
    store.compare_set(FIRST_FAILED, "", str(rank))


def abort_all_groups() -> None:
    """Abort every process group of this process (NCCL: ``ncclCommAbort`` on each
    communicator, which makes a collective blocked on a dead peer return an error)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.distributed_c10d._abort_process_group()


# a watch still polling at interpreter exit (no shutdown() called) must not be inside a
# store call when finalisation starts
atexit.register(stop_all)
