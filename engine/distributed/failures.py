"""Naming the rank that failed: when a collective breaks (a peer died, hung or raised),
:func:`failure_guard` turns the transport error into :class:`PeerFailureError` that says
which rank and why, using the rendezvous store (each rank registers its host and pid at
bring-up, records its own exception, and survivors check in). On NCCL a survivor's
collective does not fail when a peer dies: the failure watch (engine.distributed.watch) reads
the recorded exception, aborts the groups so the guard gets an error to handle, and ends
the process itself if nothing takes over.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import time
import traceback
from typing import TYPE_CHECKING, Iterator, Optional, Protocol

from engine.distributed.lock import pid_running
from engine.distributed.teardown import shutdown
from engine.distributed.watch import mark_first_failure

if TYPE_CHECKING:
    from engine.distributed.env import DistEnv

__all__ = ["PeerFailureError", "RendezvousStore", "failure_guard", "record_failure", "register_process"]

logger = logging.getLogger(__name__)

_KEY = "engine/{}/{}"


class RendezvousStore(Protocol):
    """The part of c10d's ``Store`` used here (named structurally: this module stays torch-free)."""

    def set(self, key: str, value: str, /) -> None: ...
    def get(self, key: str, /) -> bytes: ...
    def add(self, key: str, amount: int, /) -> int: ...
    def check(self, keys: list[str], /) -> bool: ...


class PeerFailureError(RuntimeError):
    """A collective failed because a peer died, hung or raised; the message names it."""


def register_process(store, rank: int) -> None:
    store.set(_KEY.format("proc", rank), f"{socket.gethostname()} {os.getpid()}")


def record_failure(env: DistEnv, exc: BaseException, record_dir: Optional[str] = None) -> None:
    """Leave ``exc`` in the rendezvous store (and as ``<record_dir>/rank<R>.failed``) so
    peers whose collectives fail can name us."""
    line = f"{type(exc).__name__}: {_first_line(exc, 500)}"
    if env.watch is not None:
        env.watch.own_failure()
    _write_record(record_dir, env.rank, "failed", line)
    try:
        env.store.set(_KEY.format("failed", env.rank), line)
        mark_first_failure(env.store, env.rank)  # before the counter the failure watches poll
        env.store.add(_KEY.format("count", "failed"), 1)
    except Exception:  # noqa: BLE001 - the store may be gone too; the local error still stands
        logger.debug("could not record the failure in the store", exc_info=True)


def _first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an error: torch's store and transport errors append C++ frames."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:limit]


def _on_this_host(store, world: int) -> dict[int, tuple[str, bool]]:
    """Ranks registered on this host: rank -> ('pid P on host H', whether it still runs)."""
    host, out = socket.gethostname(), {}
    for r in range(world):
        key = _KEY.format("proc", r)
        if store.check([key]):
            h, pid = store.get(key).decode().split()
            if h == host:
                out[r] = (f"pid {pid} on {h}", pid_running(int(pid)))
    return out


def _gone_silent(store, world: int) -> set[int]:
    """Ranks whose process on this host no longer runs and that neither checked in nor
    recorded a failure: the ranks no counter includes. (A rank that recorded its failure
    and then exited is in ``count/failed`` already; counting it again let the store's host
    stop waiting for a survivor still reading, which then saw only 'store unreachable'.)"""
    counted = lambda r: any(store.check([_KEY.format(kind, r)]) for kind in ("checkin", "failed"))  # noqa: E731
    return {r for r, (_, alive) in _on_this_host(store, world).items() if not alive and not counted(r)}


def _check_in(env: DistEnv) -> Optional[Exception]:
    """Tell the other survivors this rank is alive; returns the error if the store is gone."""
    try:
        env.store.set(_KEY.format("checkin", env.rank), "1")
        env.store.add(_KEY.format("count", "checkin"), 1)
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


def _describe(env: DistEnv, failed: dict[int, str], killed: dict[int, str], stopped: list[int],
              running: list[int], silent: list[int], grace_s: float, waited_s: float) -> str:
    """Causes first (ranks that raised, ranks that died), then the ranks that only stopped.
    The times are the real ones: 'within' the grace period when it was waited in full,
    'after' the time waited when the wait ended sooner (a count that was complete early)."""
    span = f"within {grace_s:g}s" if waited_s >= grace_s else f"after {waited_s:.1f}s"
    parts = [f"rank {r} failed with {msg}" for r, msg in sorted(failed.items())]
    parts += [f"rank {r} is no longer running ({why}) and reported nothing: killed or crashed"
              for r, why in sorted(killed.items())]
    if not parts:
        parts.append("no peer reported a failure")
    others = [r for r in stopped if r != env.rank]
    if others:
        parts.append(f"{_ranks(others)} stopped because of it")
    if running:
        parts.append(f"{_ranks(running)} still running, not stopped {span} (waiting in a collective "
                     "with a rank that stopped, or hung)")
    if silent:
        parts.append(f"{_ranks(silent)} not heard from {span} (on another host: still waiting in a "
                     "collective, hung, or dead)")
    return "; ".join(parts)


def _diagnose(env: DistEnv, grace_s: float) -> str:
    """Give the other survivors up to ``grace_s`` to check in, then name who failed, who
    died (its process is gone and it never checked in: the only ranks called killed) and
    who merely stopped (checked in, as this rank did)."""
    store, world = env.store, env.world_size
    count = lambda kind, inc=0: store.add(_KEY.format("count", kind), inc)  # noqa: E731
    try:
        gone = _gone_silent(store, world)
        started = time.monotonic()
        deadline = started + grace_s
        while (count("checkin") + count("failed") + len(gone) < world
               and time.monotonic() < deadline):
            time.sleep(0.05)
        waited = time.monotonic() - started  # the message says how long it really waited
        failed = {r: store.get(_KEY.format("failed", r)).decode(errors="replace")
                  for r in range(world) if store.check([_KEY.format("failed", r)])}
        stopped = [r for r in range(world) if r not in failed and store.check([_KEY.format("checkin", r)])]
        local = _on_this_host(store, world)
        killed = {r: why for r, (why, alive) in local.items() if not alive and r not in failed and r not in stopped}
        silent = [r for r in range(world) if r not in failed and r not in killed and r not in stopped]
        running = [r for r in silent if r in local]  # alive here: blocked in a collective, or hung
        silent = [r for r in silent if r not in local]
        count("done", 1)
        if _hosts_store(env):
            _wait_for_readers(env, grace_s)
    except Exception as exc:  # noqa: BLE001
        return f"the rendezvous store became unreachable: {_first_line(exc)}"
    return _describe(env, failed, killed, stopped, running, silent, grace_s, waited)


def _hosts_store(env: DistEnv) -> bool:
    """The rendezvous store lives in this process (rank 0, unless torchrun's agent hosts it)."""
    return env.rank == 0 and env.world_size > 1 and not env.launch.agent_store


def _wait_for_readers(env: DistEnv, grace_s: float) -> None:
    """Keep the store (this process) alive until every survivor has read it, or ``grace_s``:
    peers that have not finished reading would only see 'store unreachable'."""
    store, world = env.store, env.world_size
    count = lambda kind: store.add(_KEY.format("count", kind), 0)  # noqa: E731
    deadline, next_scan = time.monotonic() + grace_s, 0.0
    gone: set[int] = set()
    while time.monotonic() < deadline:
        if time.monotonic() >= next_scan:  # dead ranks never read: do not wait for them
            gone = _gone_silent(store, world)
            next_scan = time.monotonic() + 0.5
        if count("done") + count("failed") + len(gone) >= world:
            return
        time.sleep(0.05)


# gloo (torch 2.13) raises a plain RuntimeError from its transport; NCCL and the store
# raise torch.distributed.DistError subclasses
_TRANSPORT_ERRORS = ("gloo/transport", "Connection closed by peer", "Timed out waiting",
                     "Connection reset by peer", "Broken pipe")


def _is_comm_error(exc: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(exc, dist.DistError) or (
        isinstance(exc, RuntimeError) and any(m in str(exc) for m in _TRANSPORT_ERRORS))


def _store_reachable(env: DistEnv) -> bool:
    """Whether the TCP store still accepts connections: a plain connect, because a store
    call on a dead store logs a C++ stack trace (TCPStore.cpp) before it raises."""
    if env.launch.launcher == "single":
        return True  # an in-process HashStore
    try:
        with socket.create_connection((env.launch.master_addr, env.launch.master_port), timeout=2.0):
            return True
    except OSError:
        return False


def _transport_summary(exc: BaseException) -> str:
    """gloo's '[.../pair.cc:553] Connection closed by peer [addr]:port. This is typically
    ...' -> 'Connection closed by peer [addr]:port'."""
    line = re.sub(r"^\[[^\]]*\]\s*", "", _first_line(exc))
    return line.split(". ", 1)[0]


def _read_records(record_dir: Optional[str], kind: str = "failed") -> dict[int, str]:
    """Records ranks left in ``record_dir``: ``rank<R>.failed`` (its own exception) or
    ``rank<R>.stopped`` (the causes a survivor found)."""
    out: dict[int, str] = {}
    try:
        names = os.listdir(record_dir) if record_dir else []
    except OSError:
        return out
    for name in names:
        m = re.fullmatch(rf"rank(\d+)\.{kind}", name)
        if m and record_dir:
            try:
                with open(os.path.join(record_dir, name), encoding="utf-8", errors="replace") as f:
                    out[int(m.group(1))] = f.read().strip()
            except OSError:
                continue
    return out


def _write_record(record_dir: Optional[str], rank: int, kind: str, text: str) -> None:
    if record_dir is None:
        return
    try:
        os.makedirs(record_dir, exist_ok=True)
        with open(os.path.join(record_dir, f"rank{rank}.{kind}"), "w", encoding="utf-8") as f:
            f.write(text + "\n")
    except OSError:
        logger.debug("could not write a record in %s", record_dir, exc_info=True)


def _causes(diagnosis: str) -> str:
    """The parts of a diagnosis that name a cause (a rank that raised or died)."""
    return "; ".join(p for p in diagnosis.split("; ") if " failed with " in p or " is no longer running " in p)


def _store_gone(env: DistEnv, record_dir: Optional[str], grace_s: float) -> str:
    """The diagnosis when the store (rank 0's process, unless torchrun's agent hosts it) is
    gone: from the records of the ranks that failed, else from what another survivor found
    while the store was up (this rank noticed the failure only after the store host left)."""
    deadline = time.monotonic() + grace_s
    records = _read_records(record_dir)
    while not records and record_dir and time.monotonic() < deadline:  # rank 0 may still be writing
        time.sleep(0.1)
        records = _read_records(record_dir)
        if not records and _read_records(record_dir, "stopped"):
            break
    if records:
        return "; ".join(f"rank {r} failed with {msg}" for r, msg in sorted(records.items()))
    found = {r: c for r, c in _read_records(record_dir, "stopped").items() if c}
    if found:
        r = min(found)
        return f"{found[r]} (found by rank {r} while the rendezvous store was up)"
    host = "torchrun's agent" if env.launch.agent_store else "rank 0"
    return f"the rendezvous store is unreachable: {host}, which hosts it, is gone (killed or crashed)"


@contextlib.contextmanager
def failure_guard(env: DistEnv, what: str = "distributed work", grace_s: Optional[float] = None,
                  record_dir: Optional[str] = None) -> Iterator[None]:
    """Attribute a failure inside the block to the right rank.

    A communication error (a peer died and closed its sockets, or hung past the
    collective timeout) becomes :class:`PeerFailureError` saying that this rank stopped
    because of a peer and naming the ranks that recorded a failure, whose process is
    gone (the only ones called killed), that stopped for the same reason, or that were
    not heard from within ``grace_s`` (default: ``ENGINE_FAILURE_GRACE_S``, 5 s); it is fatal: the groups are torn down without
    draining (they are broken, and a live broken group aborts the process at exit).
    Any other exception is recorded for the peers and re-raised unchanged: in the store,
    and in ``record_dir`` (a directory every rank can read, e.g. the run's output) as
    ``rank<R>.failed``, which is where peers find it when the failing rank hosted the
    store and took it with it; a survivor also leaves the causes it found there
    (``rank<R>.stopped``) for peers that notice only after the store has gone. Wrap whole fatal regions (the training loop).
    """
    watch = env.watch
    if grace_s is None:  # ENGINE_FAILURE_GRACE_S (engine.distributed.env), default 5 s
        grace_s = env.failure_grace_s
    if watch is not None:
        watch.enter_guard(what)
    try:
        yield
    except Exception as exc:
        # the failure watch fired: a peer failed and this rank's groups were aborted, so
        # whatever the blocked call raised now is that peer's failure, not this rank's
        fired = watch.take_over() if watch is not None else None
        if fired is None and not _is_comm_error(exc):
            record_failure(env, exc, record_dir)
            if watch is not None and _hosts_store(env):
                watch.wait_until_seen()  # the peers read the failure before the store goes
            raise
        first = _transport_summary(exc)
        # rank 0 recorded a failure: it is leaving and takes the store with it (a store call
        # racing its exit would log a C++ stack trace), so the records are the source
        host_failed = not env.launch.agent_store and 0 in _read_records(record_dir)
        store_error = _check_in(env) if not host_failed and _store_reachable(env) else "gone"
        # Tear down before waiting for the others: closing our sockets makes peers that
        # are blocked on us fail now instead of at their timeout. The traceback's torch
        # frames hold the group and its Work; free them, or the group outlives shutdown
        # and its threads meet interpreter finalisation.
        traceback.clear_frames(exc.__traceback__)
        shutdown(drain=False)
        if store_error is None:
            diagnosis = _diagnose(env, grace_s)
            _write_record(record_dir, env.rank, "stopped", _causes(diagnosis))  # for ranks that come later
        elif fired is not None and not _read_records(record_dir):
            diagnosis = fired  # the watch read it while the store was up
        else:
            diagnosis = _store_gone(env, record_dir, grace_s)
        raise PeerFailureError(f"rank {env.rank}: {what} stopped because a peer failed: {diagnosis} "
                               f"(here: {first})") from None
    finally:
        if watch is not None:
            watch.exit_guard()
