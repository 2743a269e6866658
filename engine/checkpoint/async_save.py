"""Asynchronous checkpoints: training goes on while the checkpoint is written.

The protocol is :mod:`engine.checkpoint.save`'s, split in time:

1. At the call (main thread, collective): the ranks agree on the tag and a nonce, rank 0
   makes ``<save_dir>/.tmp-<tag>-<nonce>/`` (:func:`~engine.checkpoint.save.begin_save`);
   each rank copies the tensors it writes (fp32 master shards and element-wise optimizer
   state) into host buffers allocated once and reused, and the small description of its
   shard (fragments, RNG, FP8 and scalar state, the training state) is gathered to rank 0
   (:func:`~engine.checkpoint.save.take_snapshot`). Training then continues.
2. A background thread per rank serialises the host copies, writes the shard file and
   fsyncs it. It uses NO collectives: a second thread's collectives would interleave with
   the training loop's and deadlock or corrupt (NCCL, gloo alike).
3. At a later synchronisation point on the main thread (:meth:`AsyncSaver.poll` at a step
   boundary, :meth:`AsyncSaver.wait` before the next save and at the end) the ranks
   all-reduce "my writer is done" (MIN); once all are, each sends rank 0 its file record
   or its error, rank 0 writes ``metadata.json``, renames the directory and replaces
   ``latest`` exactly as a synchronous save does (:func:`~engine.checkpoint.save.commit_save`),
   and the outcome is raised on every rank.

So ``latest`` is only ever replaced by a complete checkpoint, at most one save is in
flight, and a failed write (disk full, permission) is a ``CheckpointError`` on every rank
at the next synchronisation point, with the previous checkpoint untouched.

Memory: one host copy of what this rank writes (its shard of masters and moments), kept
between saves. On CUDA the buffers are pinned and filled on a side stream; the compute
stream waits for that copy (a device-side wait) before it goes on, so the next optimizer
step cannot change the state under the copy, and the host does not wait.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from engine.checkpoint.save import SavePlan, Tensors, begin_save, commit_save, take_snapshot, write_shard
from engine.checkpoint.target import Checkpointable
from engine.distributed import comm
from engine.distributed.groups import AxisGroup

__all__ = ["AsyncSaver", "SaveOutcome", "HostBuffers"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveOutcome:
    """A committed save: its path and the seconds its background write took (from the end
    of the snapshot to the writer's fsync, on this rank)."""

    path: str
    write_s: float


class HostBuffers:
    """Host copies of the tensors a rank writes, by safetensors key, allocated at the first
    save and reused by the next ones (a tensor whose shape or dtype changed gets a new one)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

    def _buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._bufs.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            pin = self.device.type == "cuda"  # page-locked: the D2H copy runs asynchronously at full speed
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
            self._bufs[key] = buf
        return buf

    def copy(self, tensors: Tensors) -> Tensors:
        """``tensors`` copied into the buffers; on CUDA on a side stream, the current stream
        made to wait for it (device-side: the host goes on)."""
        out: Tensors = []
        if self.device.type == "cuda":
            main = torch.cuda.current_stream(self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(main)  # the state as of the call
            with torch.cuda.stream(side):
                for key, t in tensors:
                    buf = self._buffer(key, t)
                    buf.copy_(t.detach(), non_blocking=True)
                    out.append((key, buf))
            done = torch.cuda.Event()
            done.record(side)
            main.wait_event(done)  # the next step must not change the state under the copy
            done.synchronize()     # the writer reads the buffers: they must be complete
            return out
        for key, t in tensors:
            buf = self._buffer(key, t)
            buf.copy_(t.detach())
            out.append((key, buf))
        return out


class _Write:
    """One save's background write on this rank."""

    def __init__(self, plan: SavePlan, part: Any, tensors: Tensors) -> None:
        self.plan = plan
        self.result: Any = part if isinstance(part, str) else None  # a failed snapshot: nothing to write
        self.write_s = 0.0
        self.thread: Optional[threading.Thread] = None
        if self.result is None:
            self.thread = threading.Thread(target=self._run, args=(part, tensors), daemon=True,
                                           name=f"ckpt-write-{plan.tag}")
            self.thread.start()

    def _run(self, part: dict[str, Any], tensors: Tensors) -> None:
        t0 = time.perf_counter()
        try:
            self.result = write_shard(self.plan.tmp_dir, part, tensors)
        except BaseException as exc:  # noqa: BLE001 - reported to every rank at the commit
            self.result = f"rank {part['rank']}: {type(exc).__name__}: {exc}"
        self.write_s = time.perf_counter() - t0

    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()


class AsyncSaver:
    """Asynchronous saves of ``engine`` (see the module docstring). Every method is
    collective: every rank calls it in the same order (as the synchronous save)."""

    def __init__(self, engine: Checkpointable) -> None:
        self.engine = engine
        self.buffers = HostBuffers(engine.device)
        self._write: Optional[_Write] = None

    @property
    def pending(self) -> bool:
        """A save is started and not committed yet (the same on every rank)."""
        return self._write is not None

    def save(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict[str, Any]] = None, *,
             keep_last: Optional[int] = None, save_latest: bool = True) -> tuple[str, Optional[SaveOutcome]]:
        """Wait for (and commit) the save in flight, if any, then start this one: snapshot now,
        write in the background. Returns the path the checkpoint will have once committed and
        the previous save's outcome (None when none was in flight)."""
        previous = self.wait()
        plan = begin_save(self.engine, save_dir, tag, client_state, keep_last, save_latest)
        tensors, part = take_snapshot(self.engine, plan, client_state, self.buffers.copy)
        self._write = _Write(plan, part, tensors)
        return plan.path, previous

    def _commit(self) -> SaveOutcome:
        w = self._write
        assert w is not None  # callers check pending
        self._write = None  # committed or failed: never retried (rank 0 removed its directory)
        w.join()
        path = commit_save(self.engine.config, w.plan, w.result)
        logger.info("saved checkpoint %s (asynchronously: written in %.2fs)", path, w.write_s)
        return SaveOutcome(path, w.write_s)

    def poll(self) -> Optional[SaveOutcome]:
        """Commit the save in flight if every rank's writer has finished; None otherwise (or
        when none is in flight). One small all-reduce while a save is in flight."""
        if self._write is None:
            return None
        flag = torch.tensor([1 if self._write.done() else 0], dtype=torch.int32, device=self.engine.device)
        if dist.is_initialized():
            comm.all_reduce(flag, AxisGroup.world(), op=dist.ReduceOp.MIN)
        return self._commit() if bool(flag.item()) else None

    def wait(self) -> Optional[SaveOutcome]:
        """Wait for the save in flight and commit it (None when none was in flight)."""
        return self._commit() if self._write is not None else None

    def abandon(self) -> None:
        """Local, no collectives (an engine torn down with a save in flight): let the writer
        finish its file and forget the save; it is never published and the next save in that
        directory removes the leftover."""
        if self._write is not None:
            self._write.join()
            logger.warning("the asynchronous save %s was not committed (the run ended before the ranks agreed): "
                           "'latest' still names the previous checkpoint", self._write.plan.path)
            self._write = None
