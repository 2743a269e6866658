"""Before a training job writes anything: claim its folders and check them.

:func:`prepare_locations` runs on every rank right after the process group exists, and
:func:`agree_on_problems` makes the first problem found on any rank the outcome of all
(the entry point then exits 2 on every rank, rank 0 printing the line):

- rank 0 locks the output and save directories (:class:`~engine.distributed.lock.DirLock`: one
  job per directory; a second job is refused with the holder's host, pid and run id) and
  keeps the locks for the whole run (an ``ExitStack`` the caller holds);
- every rank checks that each directory it may write exists (created if missing) and is
  writable, with a probe file (a save writes shards from every rank, a failure writes a
  per-rank log into the output directory);
- the load path is resolved (a save directory or one tag of it); nothing there is a
  problem unless ``load_if_exists``;
- a save directory that already holds checkpoints is refused unless the run resumes from
  that directory (a fresh or fine-tuning run would overwrite and prune its tags);
- :func:`warn_if_low_space` warns where the free space is below one checkpoint (the trainer
  calls it at start-up and again before every save).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile

import torch.distributed as dist

from engine.checkpoint.format import (
    LATEST_FILE,
    METADATA_FILE,
    CheckpointError,
    read_latest,
)
from engine.checkpoint.load import checkpoint_location
from engine.distributed.env import free_bytes_override
from engine.distributed.lock import DirLock, DirLockError

__all__ = [
    "agree_on_problems",
    "check_writable",
    "existing_checkpoints",
    "prepare_locations",
    "warn_if_low_space",
]

logger = logging.getLogger(__name__)

Location = tuple[str, str | None]  # (save directory, tag or None for the one 'latest' names)


def check_writable(path: str, what: str) -> str | None:
    """None when ``path`` is (or can be made) a directory this process can write into."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"cannot use {what} {path!r}: it is a file, not a directory"
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        return f"cannot write to {what} {path!r}: {exc.strerror or exc}"
    return None


def existing_checkpoints(save_dir: str) -> list[str]:
    """``latest`` and the tag directories (those with a metadata.json) in ``save_dir``."""
    if not os.path.isdir(save_dir):
        return []
    names = sorted(d for d in os.listdir(save_dir) if not d.startswith(".")
                   and os.path.isfile(os.path.join(save_dir, d, METADATA_FILE)))
    return ([LATEST_FILE] if os.path.isfile(os.path.join(save_dir, LATEST_FILE)) else []) + names


def _lock_dirs(dirs: list[tuple[str, str]], run_id: str, stack: contextlib.ExitStack) -> str | None:
    seen: set[str] = set()
    for path, what in dirs:
        real = os.path.realpath(path)
        if real in seen:  # --save == --output: one lock (a second flock on it would block)
            continue
        seen.add(real)
        try:
            stack.enter_context(DirLock(path, run_id, what=f"{what} {path!r}"))
        except DirLockError as exc:
            return str(exc)
        except OSError as exc:
            return f"cannot lock {what} {path!r}: {exc.strerror or exc}"
    return None


def _resolve_load(load: str, load_if_exists: bool) -> tuple[str | None, Location | None]:
    location = checkpoint_location(load)
    if location is not None:
        return None, location
    if os.path.exists(load) and not os.path.isdir(load):
        return f"--load {load!r} is not a directory", None
    if load_if_exists:
        return None, None
    return (f"--load {load!r} holds no checkpoint (neither a 'latest' file nor a {METADATA_FILE}): pass a save "
            f"directory or one of its tags (e.g. DIR/global_step8), or add --load-if-exists to start from step 0 "
            f"when there is nothing to resume"), None


def _check_save(save: str, location: Location | None, finetune: bool) -> str | None:
    """A save directory holding checkpoints is only written by a run that resumes from it."""
    existing = existing_checkpoints(save)
    if not existing:
        return None
    shown = ", ".join(existing[:4]) + (" ..." if len(existing) > 4 else "")
    loaded_from = None if location is None else os.path.realpath(location[0])
    if loaded_from != os.path.realpath(save):
        return (f"--save {save!r} already holds checkpoints ({shown}) that this run does not resume from: its "
                f"saves would replace them; resume with --load {save}, or choose an empty --save directory")
    if finetune:
        return (f"--finetune restarts at step 0, so its saves would replace the checkpoints ({shown}) in --save "
                f"{save!r} it loads from: choose another --save directory")
    return None


def prepare_locations(*, output: str, save: str | None, load: str | None, load_if_exists: bool,
                      finetune: bool, rank: int, run_id: str, stack: contextlib.ExitStack
                      ) -> tuple[str | None, Location | None]:
    """This rank's first problem with the job's folders (None: none) and the checkpoint to
    load (None: start fresh). Rank 0 takes the directory locks into ``stack``."""
    where = "" if rank == 0 else f"rank {rank} (host {socket.gethostname()}): "
    dirs = [(output, "--output")] + ([(save, "--save")] if save else [])
    problem = next((p for p in (check_writable(path, what) for path, what in dirs) if p is not None), None)
    if problem is None and rank == 0:
        problem = _lock_dirs(dirs, run_id, stack)
    location = None
    if problem is None and load is not None:
        problem, location = _resolve_load(load, load_if_exists)
    if problem is None and save is not None:
        problem = _check_save(save, location, finetune)
    if problem is None and rank == 0 and save is not None and location is not None and location[1] is not None \
            and os.path.realpath(location[0]) == os.path.realpath(save):
        _warn_if_older(save, location[1])
    return (None if problem is None else where + problem), location


def _warn_if_older(save: str, tag: str) -> None:
    try:
        latest = read_latest(save)
    except CheckpointError:
        return  # a corrupt 'latest' is the load's to report (it does not read it: a tag was given)
    if latest is not None and latest != tag:
        logger.warning("resuming from %s, not from the newest checkpoint in --save %s ('latest' names %s): saves "
                       "of this run replace the tags it reaches again", tag, save, latest)


def agree_on_problems(problem: str | None) -> str | None:
    """Collective: the first problem of any rank (rank order), or None on every rank."""
    everyone: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problem)
    return next((p for p in everyone if p is not None), None)


def free_bytes(path: str) -> int:
    """Free space of ``path``'s filesystem; ``ENGINE_TEST_FREE_BYTES`` (a test hook,
    docs/training.md) replaces the measurement."""
    fake = free_bytes_override()
    return fake if fake is not None else shutil.disk_usage(path).free


def warn_if_low_space(paths: list[tuple[str, str]], need_bytes: int, when: str = "") -> bool:
    """Warn for each directory whose filesystem has less free space than ``need_bytes``
    (one whole checkpoint: master weights and optimizer moments); True when one did."""
    low = False
    for path, what in paths:
        try:
            free = free_bytes(path)
        except OSError:
            continue
        if free < need_bytes:
            low = True
            logger.warning("%s%s %s: %.1f MiB free, less than one checkpoint (%.1f MiB, %d bytes): the save will "
                           "fail for lack of space; free some or point --save elsewhere", f"{when}: " if when else "",
                           what, path, free / 2**20, need_bytes / 2**20, need_bytes)
    return low
