"""Reproducer for the gloo exit-time abort (``terminate called without an active exception``).

Not collected by pytest (leading underscore). Two roles:

    python tests/distributed/_shutdown_repro.py drive --runs 200 --world 8 --mode none
    python tests/distributed/_shutdown_repro.py work --mode none      # one rank; env from drive
    python tests/distributed/_shutdown_repro.py drive --alias ...     # workers as user scripts
                                                                      # under -m engine.compat.deepspeed

``drive`` launches ``world`` worker processes per run with a torchrun-style environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), waits for them, and counts
runs in which any rank aborted (negative exit code / ``terminate called`` on stderr) or
failed otherwise. Modes say how a worker ends:

    none      return from main without any teardown, async work still pending
    plain     every async op waited, then return without any teardown (many scripts)
    destroy   dist.destroy_process_group() straight away
    barrier   dist.barrier(); dist.destroy_process_group()   (the test harness's order)
    fix       engine.distributed.env.shutdown()
    victim_exit3  one all-reduce, then rank 1 exits 3 and rank 0 returns (a peer that failed)
    victim_exit3_blocked  the same, but rank 0 then waits in an all-reduce rank 1 never joins
    victim_raise_blocked  the same, rank 1 dying of an uncaught ValueError
    ds_*      the same, the group made by engine.compat.deepspeed.init_distributed (an
              import-changed DeepSpeed script: the engine's exit teardown applies)
    *_keep    the same, but the subgroups stay referenced from a module global
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time

from engine.distributed.spawn import free_port


def _work(mode: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    keep_groups = mode.endswith("_keep")
    mode = mode[:-len("_keep")] if keep_groups else mode
    if mode == "fix":
        from engine.distributed.env import init_distributed, shutdown
        init_distributed(timeout_s=60.0)
    elif mode.startswith("ds_"):  # a DeepSpeed script with its import changed to the engine's
        import atexit
        import datetime

        # registered before the engine's exit teardown, so it runs after it (atexit is LIFO)
        atexit.register(lambda: print(f"initialized at exit: {dist.is_initialized()}", flush=True))

        import engine.compat.deepspeed as deepspeed
        deepspeed.init_distributed("gloo", timeout=datetime.timedelta(seconds=60))
        mode = mode[len("ds_"):]
    else:
        import datetime
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    if mode.startswith("victim_"):  # rank 1 fails after the first collective; rank 0 returns
        dist.all_reduce(torch.ones(4))
        if dist.get_rank() == 1:
            if mode.startswith("victim_raise"):
                raise ValueError("bad batch on rank 1")
            raise SystemExit(3)
        if mode.endswith("_blocked"):  # ... or waits for rank 1 in a collective
            dist.all_reduce(torch.ones(4))
        return
    keep = _collectives(wait_all=mode == "plain")
    if keep_groups:  # groups outlive main(), as a module-level engine object would
        _KEPT.append(keep)
    del keep
    if mode in ("none", "plain"):
        return
    if mode == "destroy":
        dist.destroy_process_group()
    elif mode == "barrier":
        dist.barrier()
        dist.destroy_process_group()
    elif mode == "fix":
        from engine.distributed.env import gloo_worker_threads
        shutdown()
        if not _KEPT:
            assert gloo_worker_threads() == 0, f"{gloo_worker_threads()} gloo threads left"
    else:
        raise SystemExit(f"unknown mode {mode}")


_KEPT: list = []


def _harness_fn(rank: int, world_size: int) -> int:
    _collectives()
    return rank


def _harness(runs: int, world: int) -> int:
    """The same workload under tests/harness.py's run_ranks (which tears down itself)."""
    import resource
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from harness import RankFailure, run_ranks

    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    tally: collections.Counter = collections.Counter()
    start = time.monotonic()
    for i in range(runs):
        try:
            assert run_ranks(_harness_fn, world, timeout=300) == list(range(world))
            tally["ok"] += 1
        except RankFailure as exc:
            kind = "abort" if "code -6" in str(exc) else "error"
            tally[kind] += 1
            print(f"run {i}: {kind}: {str(exc)[:300]}", flush=True)
    print(f"harness world={world} runs={runs} {dict(tally)} ({time.monotonic() - start:.0f}s)")
    return 0


def _collectives(wait_all: bool = False) -> list:
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()

    # sync collectives on the default group
    t = torch.full((1024,), float(rank))
    dist.all_reduce(t)
    out = torch.empty(world * 16)
    dist.all_gather_into_tensor(out, torch.full((16,), float(rank)))
    dist.broadcast(t, src=0)

    # subgroups: every rank creates every group in the same order
    half = world // 2
    lo = dist.new_group(list(range(half)))
    hi = dist.new_group(list(range(half, world)))
    pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
    mine = lo if rank < half else hi
    s = torch.ones(256)
    dist.all_reduce(s, group=mine)
    dist.all_reduce(s, group=pairs[rank // 2])

    # p2p ring with batch_isend_irecv
    send = torch.full((512,), float(rank))
    recv = torch.empty(512)
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % world),
           dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert recv[0].item() == (rank - 1) % world

    # async work: some waited, the last ones left pending (as a careless loop would)
    works = [dist.all_reduce(torch.ones(4096), async_op=True) for _ in range(4)]
    works[0].wait()
    works.append(dist.all_reduce(torch.ones(64), group=mine, async_op=True))
    late = dist.all_reduce(torch.ones(64), group=pairs[rank // 2], async_op=True)  # never waited
    if wait_all:
        for w in works + [late]:
            w.wait()
    del late, works
    return [lo, hi, pairs]



def _drive(runs: int, world: int, mode: str, timeout: float, verbose: bool,
           gdb_dir: str = "", alias: bool = False) -> int:
    tally: collections.Counter = collections.Counter()
    samples: dict[str, str] = {}
    start = time.monotonic()
    for i in range(runs):
        port = free_port()
        procs = []
        for r in range(world):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                       LOCAL_WORLD_SIZE=str(world), TORCHELASTIC_RUN_ID="repro",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            cmd = [sys.executable, __file__, "work", "--mode", mode]
            if alias:  # the worker as a user's script started through the DeepSpeed-alias runner
                cmd[1:1] = ["-m", "engine.compat.deepspeed"]
            if gdb_dir:  # backtrace of every thread when a rank aborts (diagnosis only)
                cmd = ["gdb", "-q", "-batch", "-ex", "set pagination off", "-ex", "run",
                       "-ex", "thread apply all bt 25", "-ex", "kill",
                       "--args"] + cmd
                env["GDB_LOG"] = os.path.join(gdb_dir, f"run{i}_rank{r}.txt")
            procs.append(subprocess.Popen(cmd,
                                          env=env, text=True,
                                          stdout=subprocess.PIPE if gdb_dir else subprocess.DEVNULL,
                                          stderr=subprocess.STDOUT if gdb_dir else subprocess.PIPE))
        outcome = "ok"
        try:
            for r, p in enumerate(procs):
                try:
                    out, err = p.communicate(timeout=timeout)
                    err = out if gdb_dir else err
                    if gdb_dir and ("SIGABRT" in err or "terminate called" in err):
                        with open(os.path.join(gdb_dir, f"run{i}_rank{r}.txt"), "w") as f:
                            f.write(err)
                        err += "\nterminate called (under gdb)"
                        p.returncode = p.returncode or -6
                except subprocess.TimeoutExpired:
                    outcome = "hang"
                    samples.setdefault(outcome, f"rank {r} still running after {timeout}s")
                    break
                if p.returncode != 0:
                    kind = "abort" if ("terminate called" in err or p.returncode < 0) else "error"
                    if outcome == "ok" or kind == "abort":
                        outcome = kind
                    samples.setdefault(kind, f"rank {r} rc={p.returncode}\n{err[-1500:]}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        tally[outcome] += 1
        if verbose:
            print(f"run {i}: {outcome}", flush=True)
    el = time.monotonic() - start
    print(f"mode={mode} world={world} runs={runs} {dict(tally)} ({el:.0f}s)", flush=True)
    for kind, text in samples.items():
        print(f"--- first {kind}:\n{text}", flush=True)
    return 0


def _fork_drive(runs: int, world: int, mode: str, timeout: float, verbose: bool) -> int:
    """Like ``drive`` but the ranks are forked from this process, which imported torch once.

    Each child runs the workload and then leaves through SystemExit, i.e. through normal
    interpreter finalisation, which is where the abort happens; only the start-up cost
    (importing torch 8 times) is saved, so many more runs fit in the same time.
    """
    import signal
    import tempfile

    import torch  # noqa: F401 - imported before forking, once
    import torch.distributed  # noqa: F401

    import engine.distributed.env  # noqa: F401

    tally: collections.Counter = collections.Counter()
    start = time.monotonic()
    for i in range(runs):
        port = free_port()
        logs = [tempfile.TemporaryFile() for _ in range(world)]
        pids = []
        for r in range(world):
            pid = os.fork()
            if pid == 0:  # child: no try/finally of the parent may run here
                os.dup2(logs[r].fileno(), 2)
                os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                                  LOCAL_WORLD_SIZE=str(world), TORCHELASTIC_RUN_ID="repro",
                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                _work(mode)
                raise SystemExit(0)
            pids.append(pid)
        outcome, deadline = "ok", time.monotonic() + timeout
        for r, pid in enumerate(pids):
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            if not done:
                outcome = "hang"
                continue
            logs[r].seek(0)
            err = logs[r].read().decode(errors="replace")
            aborted = "terminate called" in err or (
                os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGABRT)
            if aborted:
                outcome = "abort"
            elif os.waitstatus_to_exitcode(status) != 0 and outcome == "ok":
                outcome = "error"
                if verbose:
                    print(err[-2000:], flush=True)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        tally[outcome] += 1
        if verbose:
            print(f"run {i}: {outcome}", flush=True)
    print(f"fork mode={mode} world={world} runs={runs} {dict(tally)} "
          f"({time.monotonic() - start:.0f}s)", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["drive", "fork", "work", "harness"])
    p.add_argument("--mode", default="none")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("-v", action="store_true")
    p.add_argument("--gdb-dir", default="", help="run ranks under gdb, keep abort backtraces here")
    p.add_argument("--sys-exit", action="store_true", help="work: end with sys.exit(0) instead of returning")
    p.add_argument("--alias", action="store_true",
                   help="drive: start each worker through python -m engine.compat.deepspeed")
    a = p.parse_args()
    if a.role == "fork":
        return _fork_drive(a.runs, a.world, a.mode, a.timeout, a.v)
    if a.role == "harness":
        return _harness(a.runs, a.world)
    if a.role == "work":
        _work(a.mode)
        if a.sys_exit:  # as `sys.exit(main())` ends many scripts
            sys.exit(0)
        return 0
    return _drive(a.runs, a.world, a.mode, a.timeout, a.v, a.gdb_dir, a.alias)


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    sys.exit(main())
