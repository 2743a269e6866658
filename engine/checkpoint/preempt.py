"""Preemption and periodic saving for a training loop.

SIGTERM / SIGUSR1 (what Slurm sends before it kills a job, with ``--signal``) become a
request to save and stop at the next step boundary.

A signal may reach only some ranks, or reach them during different steps, so the ranks
agree at every step boundary: :meth:`PreemptionHandler.stop_requested` is a collective
(one MAX all-reduce of a single integer) that is true on every rank as soon as any rank
has received a signal. The training loop then finishes nothing more, saves a checkpoint
on all ranks and exits 0::

    with PreemptionHandler() as preempt:
        for step in ...:
            engine.train_batch(...)
            if preempt.stop_requested(engine.device):
                engine.save_checkpoint(save_dir)
                break

:class:`Checkpointer` packages that with saving every N steps and at the end, as the
entry point uses it (``after_step`` from the loop's per-step hook).
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from engine.checkpoint.async_save import AsyncSaver, SaveOutcome
from engine.checkpoint.finite import NonFiniteStateError
from engine.checkpoint.target import Checkpointable
from engine.distributed import comm
from engine.distributed.groups import AxisGroup

__all__ = ["PreemptionHandler", "PREEMPTION_SIGNALS", "Checkpointer", "StopTraining"]

logger = logging.getLogger(__name__)

PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionHandler:
    """Records SIGTERM/SIGUSR1 instead of dying; install it in the main thread.

    The first signal is the request (:attr:`received`); any later one is only counted
    (:attr:`repeats`) and ignored: Slurm signals every task and the batch step, so a rank can
    get two, and one arriving during or after the save must not kill a process whose
    checkpoint is complete (issue 30). An entry point installs it before its start-up
    work and keeps it until the process exits (:class:`Checkpointer` takes it as ``preempt``)."""

    def __init__(self, signals: Sequence[int] = PREEMPTION_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.received: Optional[int] = None
        self.repeats = 0
        self._previous: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.received is None:
            self.received = signum
        else:
            self.repeats += 1
        # logging from a signal handler is not reentrant-safe; the loop logs when it acts

    def install(self) -> "PreemptionHandler":
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def ignore_until_exit(self) -> None:
        """For the process's last moments: SIG_IGN, which interpreter finalisation keeps (it
        resets a Python handler to the default action, which would kill the process)."""
        for s in self.signals:
            signal.signal(s, signal.SIG_IGN)

    def __enter__(self) -> "PreemptionHandler":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def stop_requested(self, device: torch.device) -> bool:
        """Collective over the world: whether any rank got a signal."""
        flag = torch.tensor([1 if self.received is not None else 0], dtype=torch.int32, device=device)
        if dist.is_initialized():
            comm.all_reduce(flag, AxisGroup.world(), op=dist.ReduceOp.MAX)
        stop = bool(flag.item())
        if stop:
            name = signal.Signals(self.received).name if self.received is not None else "a peer's signal"
            logger.warning("preemption requested (%s): saving a checkpoint and stopping", name)
        return stop


class StopTraining(Exception):
    """Raised from a training loop's per-step hook to end the loop (preemption)."""


class Checkpointer:
    """Saves ``engine`` into ``save_dir`` every ``interval`` steps (0: never), on
    preemption (then :meth:`after_step` returns True on every rank) and at the end
    (:meth:`finish`), never twice at one step. With ``save_dir=None`` it does nothing and
    installs no signal handler (a signal then ends the process as usual).
    Use as a context manager around the loop: it installs its own signal handlers, unless
    ``preempt`` gives one the caller installed (and keeps installed until the process
    exits, so that a signal after the final save is ignored too). ``before_save()`` runs
    before every save (the entry point's disk-space check).
    A save refused because the state is non-finite
    (:class:`~engine.checkpoint.finite.NonFiniteStateError`) is logged and skipped: nothing
    was written and the previous checkpoint stays the latest.

    ``saver``: an :class:`~engine.checkpoint.async_save.AsyncSaver` makes the saves
    asynchronous (``checkpoint.async_save``): a save snapshots and returns, the write is
    committed at a later step boundary (:meth:`after_step` polls), before the next save, on
    preemption (which waits for it, saves, and waits again) and in :meth:`finish`.
    After each :meth:`after_step`, :attr:`step_metrics` holds ``save_blocked_s`` (the seconds
    the loop was blocked by a save at that step: all of a synchronous save; the snapshot
    plus any wait for the previous save for an asynchronous one) and ``save_write_s`` (a
    save's write time, at the step it was committed), or nothing."""

    def __init__(self, engine: Checkpointable, save_dir: Optional[str], interval: int = 0,
                 keep_last: Optional[int] = None, saver: Optional[AsyncSaver] = None,
                 preempt: Optional[PreemptionHandler] = None,
                 before_save: Optional[Callable[[], None]] = None) -> None:
        if interval < 0:
            raise ValueError(f"the save interval must be >= 0 steps (0: only at the end), got {interval}")
        self.engine, self.save_dir, self.interval, self.keep_last = engine, save_dir, int(interval), keep_last
        self.saver, self.before_save = saver, before_save
        self._owns_handler = preempt is None
        self.preempt = (preempt or PreemptionHandler()) if save_dir is not None else None
        self.preempted = False
        self.saved_at: Optional[int] = None
        self.last_path: Optional[str] = None
        self.step_metrics: dict[str, float] = {}

    def __enter__(self) -> "Checkpointer":
        if self.preempt is not None and self._owns_handler:
            self.preempt.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.preempt is not None and self._owns_handler:
            self.preempt.uninstall()

    def _committed(self, outcome: Optional[SaveOutcome]) -> None:
        if outcome is not None:
            self.last_path = outcome.path
            self.step_metrics["save_write_s"] = outcome.write_s

    def save(self) -> Optional[str]:
        """Save now (asynchronous with a saver: returns the path it will have once committed);
        None when the state is non-finite (nothing written, logged on rank 0)."""
        from engine.checkpoint.save import save_checkpoint

        assert self.save_dir is not None, "Checkpointer.save needs a save_dir"
        if self.before_save is not None:
            self.before_save()
        t0 = time.perf_counter()
        self.saved_at = self.engine.global_steps  # tried at this step (a refused save is not retried)
        try:
            if self.saver is None:
                self.last_path = save_checkpoint(self.engine, self.save_dir, keep_last=self.keep_last)
                self.step_metrics["save_write_s"] = time.perf_counter() - t0
                path = self.last_path
            else:
                self._committed(self.saver.wait())  # the previous save's outcome, even if this one is refused
                path, _ = self.saver.save(self.save_dir, keep_last=self.keep_last)
        except NonFiniteStateError as exc:
            if not dist.is_initialized() or dist.get_rank() == 0:
                logger.warning("%s", exc)
            return None
        self.step_metrics["save_blocked_s"] = time.perf_counter() - t0
        return path

    def after_step(self, hold: bool = False) -> bool:
        """Collective, after every optimizer step: commit a finished asynchronous save, save
        if due (not a periodic save while ``hold``: the caller knows the state is not worth
        one, e.g. during a run of skipped steps; a preemption save is always taken); True
        when the loop must stop (then the save is complete)."""
        self.step_metrics = {}
        if self.save_dir is None:
            return False
        assert self.preempt is not None  # made whenever save_dir is given
        self.preempted = self.preempt.stop_requested(self.engine.device)
        if self.saver is not None:
            self._committed(self.saver.poll())  # a failed write raises here, on every rank
        step = self.engine.global_steps
        if self.preempted or (self.interval and step % self.interval == 0 and not hold):
            t0 = time.perf_counter()
            self.save()
            if self.preempted and self.saver is not None:  # the job is about to end: all of it blocks
                self._committed(self.saver.wait())
                self.step_metrics["save_blocked_s"] = time.perf_counter() - t0
        return self.preempted

    def finish(self, final_save: bool = True) -> Optional[str]:
        """Save the final state unless it was just saved (or not ``final_save``: a diverged
        run), and wait for any save in flight; returns the latest path."""
        if final_save and self.save_dir is not None and self.saved_at != self.engine.global_steps:
            self.save()
        if self.saver is not None:
            self._committed(self.saver.wait())
        return self.last_path
