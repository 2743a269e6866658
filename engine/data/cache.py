"""A build-once, crash-safe on-disk cache shared by concurrent processes.

Every rank of a job calls ``build_dataset`` at the same moment. ``cached_build`` makes
sure that exactly one process per machine runs the (slow) builder and that no process
ever sees a half-written entry:

- the builder writes into a fresh temporary directory next to the entry;
- the finished directory is moved into place with one ``os.rename`` (atomic on POSIX);
- an exclusive ``flock`` on ``<entry>.lock`` serialises builders, so the others wait and
  then find the entry complete. The kernel drops the lock when a process dies, so a
  crashed builder leaves no stale lock, only a temporary directory that is ignored.

On a shared filesystem whose ``flock`` does not work across machines, two machines may
both build; the rename still makes one of them win and the other discards its copy.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from typing import Any, Callable, Tuple

from engine.data.errors import DataError

__all__ = ["cache_key", "cached_build", "default_cache_dir"]

log = logging.getLogger(__name__)

# Written last inside a finished entry; an entry without it was not built by us.
_COMPLETE = "COMPLETE"


def default_cache_dir() -> str:
    """``~/.cache/engine/data`` (a path argument overrides it; no environment is read)."""
    return os.path.join(os.path.expanduser("~"), ".cache", "engine", "data")


def cache_key(spec: Any) -> str:
    """A short stable hash of a JSON-serialisable spec (dict keys sorted)."""
    blob = json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def _lock(lock_path: str, timeout_s: float):
    fh = open(lock_path, "a+")  # noqa: SIM115 - closed by the caller
    deadline = time.monotonic() + timeout_s
    waited = False
    while True:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fh
        except BlockingIOError:
            if not waited:
                log.info("waiting for another process that is building %s", lock_path[:-5])
                waited = True
            if time.monotonic() > deadline:
                fh.close()
                raise DataError(
                    f"waited {timeout_s:.0f} s for the cache lock {lock_path} held by another "
                    "process; if no other job is building this entry, delete the lock file and retry"
                ) from None
            time.sleep(0.05)


def cached_build(entry_dir: str, builder: Callable[[str], object],
                 lock_timeout_s: float = 3600.0) -> Tuple[str, bool]:
    """Return ``(entry_dir, built)``, running ``builder(tmp_dir)`` only if the entry is missing.

    ``builder`` fills the directory it is given; it becomes ``entry_dir`` once it returns.
    ``built`` says whether this call ran the builder.
    """
    if os.path.isfile(os.path.join(entry_dir, _COMPLETE)):
        return entry_dir, False
    parent = os.path.dirname(os.path.abspath(entry_dir))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the data cache directory {parent}: {e.strerror}; "
                        "set data.cache_dir to a writable directory") from None
    if not os.access(parent, os.W_OK):
        raise DataError(f"the data cache directory {parent} is not writable; "
                        "set data.cache_dir to a writable directory")
    fh = _lock(entry_dir + ".lock", lock_timeout_s)
    try:
        if os.path.isfile(os.path.join(entry_dir, _COMPLETE)):
            return entry_dir, False  # another process built it while we waited
        if os.path.exists(entry_dir):
            # Not ours (no marker): never build over a directory we did not make.
            raise DataError(f"{entry_dir} exists but is not a complete cache entry; "
                            "delete it and run again")
        tmp = tempfile.mkdtemp(prefix=os.path.basename(entry_dir) + ".tmp-", dir=parent)
        try:
            log.info("building data cache entry %s", entry_dir)
            builder(tmp)
            with open(os.path.join(tmp, _COMPLETE), "w") as f:
                f.write("ok\n")
            try:
                os.rename(tmp, entry_dir)
            except OSError:
                # Lost a cross-machine race (flock not shared): the winner's entry is as good.
                if not os.path.isfile(os.path.join(entry_dir, _COMPLETE)):
                    raise
                return entry_dir, False
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
        return entry_dir, True
    finally:
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
        fh.close()
