"""Process-group teardown that cannot abort the process at exit (see docs/launching.md).

:func:`shutdown` drains and destroys every group while the interpreter is fully alive;
:func:`bind_world_defaults_early` (called by ``init_distributed``) keeps torch from pinning
the default group in function defaults; :func:`install_exit_teardown` runs ``shutdown()`` at
interpreter exit for a script that never calls it, once every rank is exiting.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from typing import Any, Optional

__all__ = ["shutdown", "try_shutdown", "gloo_worker_threads", "bind_world_defaults_early", "install_exit_teardown",
           "every_rank_exiting", "EXIT_WAIT_S"]

logger = logging.getLogger(__name__)


def _groups_in_creation_order() -> list:
    """Every group this rank is a member of, default group first, in the order created.

    Every rank sees the same global order, so draining member groups in it cannot
    deadlock (each rank follows one total order restricted to its own groups).
    """
    import torch.distributed as dist

    names = dict(dist.distributed_c10d._world.pg_names)  # {group: "0", "1", ... or a hash}
    key = lambda name: (0, int(name), "") if name.isdigit() else (1, 0, name)  # noqa: E731
    return [g for g, n in sorted(names.items(), key=lambda gn: key(gn[1]))
            if g != dist.GroupMember.NON_GROUP_MEMBER]


def bind_world_defaults_early() -> None:
    """Import ``torch.distributed.nn.functional`` before the default group exists.

    Its functions bind ``group=group.WORLD`` as default arguments when the module is first
    imported; imported after ``init_process_group`` (torch._dynamo imports it, and the first
    ``torch.optim`` optimizer imports torch._dynamo), ten function defaults hold the default
    ProcessGroup for the life of the interpreter. ``destroy_process_group`` then cannot free
    it: its gloo worker threads outlive ``shutdown()`` and are joined only during interpreter
    finalisation, the window in which a gloo thread can abort the process at exit. Imported
    first, the defaults are None (which means the default group at call time anyway).
    """
    import torch.distributed.nn.functional  # noqa: F401 - imported for its side effect


def _release_world_defaults() -> None:
    """Drop ProcessGroups bound as function defaults in ``torch.distributed.nn.functional``
    (when a caller initialised the group before importing it; see
    :func:`bind_world_defaults_early`). None is the same default at call time."""
    import torch.distributed as dist

    mod = sys.modules.get("torch.distributed.nn.functional")
    for fn in vars(mod).values() if mod is not None else ():
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)


def gloo_worker_threads() -> int:
    """Live gloo worker threads in this process (Linux; -1 where /proc is unavailable)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return -1
    count = 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == "pt_gloo_runloop"
        except OSError:
            continue  # the thread exited while we looked
    return count


def _collect_until_settled(passes: int = 4) -> None:
    """``gc.collect()`` until no gloo worker thread is left or a pass frees nothing (at most
    ``passes``; a pass costs ~0.1 s with torch loaded, so it stops as soon as it can).

    One pass is not always enough: freeing a cycle can drop the last C++ reference (an
    autograd node, a tensor's hooks) that kept another cycle out of the collector's sight,
    and that one is collectable only on the next pass. Seen with HF's Trainer under ZeRO-3:
    after one pass the engine's data-parallel group was still alive, after two it was freed.
    """
    import gc

    for _ in range(passes):
        if gc.collect() == 0 or gloo_worker_threads() <= 0:
            return


def shutdown(drain: bool = True) -> None:
    """Tear down every process group so the process cannot abort at exit.

    Why (see docs/launching.md): a gloo worker thread that drops the last reference
    to a Python-owned tensor needs the GIL; once the interpreter is finalising, CPython
    makes such a thread exit through a forced unwind, which meets a noexcept C++
    destructor and calls std::terminate ("terminate called without an active
    exception"). So, while the interpreter is fully alive: (1) barrier every group
    this rank belongs to, in creation order, so every member has finished all work on
    it; (2) destroy the subgroups then the default group; (3) collect garbage so groups
    held only by reference cycles are destroyed now, their destructors joining the worker
    threads (again while threads remain and a pass frees something; once after a failure). Collective: every rank calls it. After a communication failure
    use ``drain=False`` (``failure_guard`` does): the barriers could only time out, and
    threads that outlive it are expected (the exception in flight holds the groups) and
    not reported, since a failure path leaves through ``os._exit``.
    """
    import gc
    import weakref

    import torch.distributed as dist

    from engine.distributed.watch import stop_all

    stop_all()  # before the barriers: no peer may leave (taking the store) while a watch polls
    if not dist.is_initialized():
        return
    c10d = dist.distributed_c10d
    # weak references, to name the groups that survive (none should)
    watch = [(weakref.ref(g), c10d._world.pg_names.get(g, "?"), sorted(c10d._world.pg_group_ranks.get(g, {})))
             for g in _groups_in_creation_order()]
    if drain:
        for group in _groups_in_creation_order():
            dist.barrier(group=group)
        group = None  # a local reference would keep the last group (and its threads) alive
    dist.destroy_process_group()
    _release_world_defaults()
    if drain:
        _collect_until_settled()
    else:  # a failure path: peers wait to read the store this rank's diagnosis races with
        gc.collect()
    alive = gloo_worker_threads()
    if alive > 0 and not drain:
        # a failure path: the exception being handled still references the broken groups,
        # and the process ends through os._exit (no interpreter finalisation to meet)
        logger.debug("%d gloo worker threads outlive shutdown(drain=False)", alive)
    elif alive > 0:
        held = [f"group {name} (global ranks {ranks})" for ref, name, ranks in watch if ref() is not None]
        logger.warning("%d gloo worker threads outlive shutdown(): a ProcessGroup is still "
                       "referenced: %s (e.g. by a ParallelGroups object, an optimizer or a Work); "
                       "drop it before the interpreter exits so its threads are joined while "
                       "Python is alive", alive, ", ".join(held) or "one this rank is not a member of")


# ------------------------------------------------------------------ at interpreter exit
EXIT_WAIT_S = 10.0  # how long an exiting rank waits for the others (ENGINE_EXIT_WAIT_S)
_GAVE_UP = 1 << 40  # added by a rank that stopped waiting: the count can never equal world again
_exit_hook: list[float] = []


def try_shutdown() -> Optional[Exception]:
    """:func:`shutdown`; if draining fails (a peer left before its barrier), destroy without
    draining. Returns the drain's error, or None."""
    try:
        shutdown()
    except Exception as exc:  # noqa: BLE001 - any collective failure of a peer that left
        shutdown(drain=False)
        return exc
    return None


def install_exit_teardown(wait_s: float = EXIT_WAIT_S, attempt: str = "0") -> None:
    """Register (once per process) an ``atexit`` teardown for scripts that end with their
    groups up: DeepSpeed loops and HF's Trainer never destroy them, and groups left to
    interpreter finalisation can abort a rank whose work is done (docs/launching.md).
    ``engine.distributed.env.arm_exit_teardown`` calls it with ``ENGINE_EXIT_WAIT_S`` and the
    launch attempt (an elastic restart reuses the agent's store, so the count is per attempt).

    ``shutdown()``'s barriers are collective, and at exit a rank cannot tell a peer that is
    exiting too from one still training (a rank that failed and called ``sys.exit(1)``):
    a barrier against a peer's all-reduce would hang or mismatch. So the hook first checks
    through the rendezvous store, which no collective uses, that every rank has reached its
    own exit (:func:`every_rank_exiting`); only then does it drain and destroy. Otherwise
    (a peer died, or is still busy after ``wait_s``) it leaves the groups as they are, as
    before. A rank that dies of an uncaught exception leaves at once: its sockets closing is
    what makes a peer's pending collective fail instead of waiting. A process that already
    called ``shutdown()`` (every entry point of this engine) finds nothing to do.
    ``wait_s`` 0: no hook.
    """
    if not _exit_hook and wait_s > 0:
        atexit.register(_teardown_at_exit, wait_s, f"engine/exiting/{attempt}")
        _exit_hook.append(wait_s)


def every_rank_exiting(store: Any, world_size: int, wait_s: float, key: str) -> bool:
    """Count this rank in at ``key`` and wait up to ``wait_s`` for all ``world_size`` ranks.

    True on every rank or on none: a rank that stops waiting adds :data:`_GAVE_UP`, so a rank
    arriving (or polling) after that sees more than ``world_size`` and gives up too, while a
    rank that saw exactly ``world_size`` saw it before anyone gave up.
    """
    count = store.add(key, 1)
    deadline, pause = time.monotonic() + wait_s, 0.01
    while count != world_size:
        if count > world_size or time.monotonic() > deadline:
            if count <= world_size:
                store.add(key, _GAVE_UP)
            return False
        pause = min(2 * pause, 0.5)  # ranks usually arrive together; a large job must not flood the store
        time.sleep(pause)
        count = store.add(key, 0)
    return True


def _teardown_at_exit(wait_s: float, key: str) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return  # shut down already (the engine's entry points), or never initialised
    if getattr(sys, "last_value", None) is not None:  # set for an uncaught exception (not SystemExit)
        return  # its peers may be mid-collective: leave at once, so theirs fail rather than wait
    try:
        ready = every_rank_exiting(dist.distributed_c10d._get_default_store(), dist.get_world_size(), wait_s, key)
    except Exception:  # noqa: BLE001 - the store left with its host rank: not every rank is here
        ready = False
    if not ready:
        logger.debug("exit teardown skipped: not every rank reached its exit within %.0f s", wait_s)
        return
    error = try_shutdown()  # a peer may leave between the count and the barriers
    if error is not None:
        logger.debug("exit teardown could not drain (%s); destroyed without it", error)
