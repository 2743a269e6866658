"""One job per directory: an exclusive lock on ``<dir>/.lock``.

``DirLock(directory, run_id).acquire()`` takes ``flock(LOCK_EX | LOCK_NB)`` on
``<dir>/.lock`` and writes the holder (host, pid, run id, start time) into it. The kernel
releases a ``flock`` when its process exits, however it exits (SIGKILL included), so a
lock left behind by a dead job never blocks the next one on a local filesystem or on NFS
v4 (where flock is a lease the server drops when the client goes). A second job gets
:class:`DirLockError` naming the holder.

Where the filesystem has no working ``flock`` (ENOLCK / EOPNOTSUPP, e.g. some Lustre or
old NFS mounts) the lock falls back to the holder line alone: a line written by a process
that still runs on this host, or by another host, refuses the directory; a line written
by a process of this host that no longer runs is stale and taken over.

:func:`held_here` tells :mod:`engine.checkpoint.save` whether this process holds the lock
of a directory: then every ``.tmp-*`` leftover in it belongs to a job that is gone.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from dataclasses import dataclass

__all__ = ["LOCK_FILE", "DirLock", "DirLockError", "LockHolder", "held_here", "pid_running"]

LOCK_FILE = ".lock"
_HELD: dict[str, DirLock] = {}   # realpath -> the lock this process holds on it


class DirLockError(RuntimeError):
    """Another live job holds the directory's lock."""


def pid_running(pid: int) -> bool:
    """False for a process of this host that is gone or a zombie (exited, not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            pass
        return True


@dataclass(frozen=True)
class LockHolder:
    host: str
    pid: int
    run_id: str
    since: float

    @classmethod
    def parse(cls, text: str) -> LockHolder | None:
        parts = text.split()
        try:
            return cls(parts[0], int(parts[1]), parts[2], float(parts[3]))
        except (IndexError, ValueError):
            return None

    def line(self) -> str:
        return f"{self.host} {self.pid} {self.run_id} {self.since:.0f}\n"

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return f"pid {self.pid} on host {self.host} (run {self.run_id}, since {when})"

    def is_stale(self) -> bool:
        """Known dead: a process of this host that no longer runs (other hosts: unknown)."""
        return self.host == socket.gethostname() and not pid_running(self.pid)


class DirLock:
    """Exclusive lock of ``directory`` for this process (use as a context manager or
    ``acquire`` / ``release``). ``what`` names the directory in messages (``--save ck``)."""

    def __init__(self, directory: str, run_id: str, what: str | None = None) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK_FILE)
        self.run_id = run_id
        self.what = what or directory
        self._fd: int | None = None

    def _holder(self) -> LockHolder | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                return LockHolder.parse(f.read())
        except OSError:
            return None

    def _refuse(self, holder: LockHolder | None) -> DirLockError:
        who = holder.describe() if holder is not None else "a process that left no holder line"
        return DirLockError(f"{self.what} is in use by another job: {who}; one job per directory: wait for it "
                            f"to finish or stop it, or choose another directory")

    def acquire(self) -> DirLock:
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise self._refuse(self._holder()) from None
            except OSError as exc:
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                holder = self._holder()  # no flock here: the holder line is the lock
                if holder is not None and holder.pid != os.getpid() and not holder.is_stale():
                    raise self._refuse(holder) from None
            me = LockHolder(socket.gethostname(), os.getpid(), self.run_id, time.time())
            os.ftruncate(fd, 0)
            os.pwrite(fd, me.line().encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        _HELD[os.path.realpath(self.directory)] = self
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        _HELD.pop(os.path.realpath(self.directory), None)
        try:
            os.ftruncate(self._fd, 0)  # no holder line: the fallback mode sees it free
        except OSError:
            pass
        os.close(self._fd)  # closing the last descriptor drops the flock
        self._fd = None

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def held_here(directory: str) -> bool:
    """Whether this process holds ``directory``'s lock."""
    return os.path.realpath(directory) in _HELD
