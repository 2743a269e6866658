"""engine/distributed/lock.py (one job per directory) and the ``.tmp-*`` clean-up rules of
engine/checkpoint/save.py: only this process's own leftovers, those of a writer that no
longer runs, or all of them under the directory's lock. Real processes hold the locks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from engine.checkpoint.save import OWNER_FILE, _clean_leftovers
from engine.distributed.lock import DirLock, DirLockError, LockHolder, held_here

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_HOLD = """
import sys, time
sys.path.insert(0, {root!r})
from engine.distributed.lock import DirLock
lock = DirLock({d!r}, "holder-run").acquire()
print("held", flush=True)
time.sleep(60)
"""


def _holder(d: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _HOLD.format(root=ROOT, d=d)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_second_lock_is_refused_with_the_holder_and_released_when_the_holder_dies(tmp_path):
    d = str(tmp_path / "out")
    p = _holder(d)
    try:
        with pytest.raises(DirLockError) as e:
            DirLock(d, "mine", what=f"--output {d!r}").acquire()
        msg = str(e.value)
        assert msg.startswith(f"--output {d!r} is in use by another job: pid {p.pid} on host {socket.gethostname()}")
        assert "run holder-run" in msg
    finally:
        p.kill()  # SIGKILL: the kernel drops the flock
        p.wait()
    with DirLock(d, "mine") as lock:
        assert held_here(d)
        holder = LockHolder.parse(open(lock.path).read())
        assert (holder.pid, holder.run_id) == (os.getpid(), "mine")
    assert not held_here(d)


def _tmp(save_dir, name: str, owner: str | None) -> str:
    path = os.path.join(save_dir, name)
    os.makedirs(path)
    if owner is not None:
        with open(os.path.join(path, OWNER_FILE), "w") as f:
            f.write(owner + "\n")
    return name


def test_leftover_clean_up_spares_a_live_jobs_save(tmp_path):
    save = str(tmp_path / "ck")
    os.makedirs(save)
    host = socket.gethostname()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        names = {
            "own": _tmp(save, ".tmp-global_step1-aaa", f"{host} {os.getpid()}"),
            "dead": _tmp(save, ".tmp-global_step2-bbb", f"{host} {dead.pid}"),
            "live": _tmp(save, ".tmp-global_step3-ccc", f"{host} {live.pid}"),
            "other_host": _tmp(save, ".tmp-global_step4-ddd", f"elsewhere {dead.pid}"),
            "no_owner": _tmp(save, ".tmp-global_step5-eee", None),
        }
        open(os.path.join(save, f"latest.tmp-{dead.pid}"), "w").close()
        open(os.path.join(save, f"latest.tmp-{live.pid}"), "w").close()
        _clean_leftovers(save)
        left = set(os.listdir(save))
        assert left == {names["live"], names["other_host"], names["no_owner"], f"latest.tmp-{live.pid}"}, left
        with DirLock(save, "run"):  # under the lock nobody else saves here: everything is stale
            _clean_leftovers(save)
        assert set(os.listdir(save)) == {".lock"}
    finally:
        live.kill()
        live.wait()


def test_stale_holder_line_without_flock_is_taken_over(tmp_path, monkeypatch):
    """Filesystems without flock: the holder line is the lock; a dead holder's line is stale."""
    import errno
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    d = str(tmp_path / "nfs")
    os.makedirs(d)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(fcntl, "flock", no_flock)
    try:
        with open(os.path.join(d, ".lock"), "w") as f:
            f.write(LockHolder(socket.gethostname(), live.pid, "other", time.time()).line())
        with pytest.raises(DirLockError, match=f"pid {live.pid}"):
            DirLock(d, "mine").acquire()
        with open(os.path.join(d, ".lock"), "w") as f:
            f.write(LockHolder(socket.gethostname(), dead.pid, "other", time.time()).line())
        DirLock(d, "mine").acquire().release()
    finally:
        live.kill()
        live.wait()
