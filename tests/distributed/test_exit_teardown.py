"""What a script leaves behind when it ends without tearing anything down (DeepSpeed scripts
and HF's ``Trainer`` do), on 2 gloo ranks:

- a DeepSpeed engine the script dropped without ``destroy()`` is freed, with its process
  groups, by garbage collection: the ZeRO optimizer's gradient hooks live in torch's C++ hook
  storage, where a strong reference to the optimizer made an uncollectable cycle
  (engine/zero/weak_hook.py), and ``shutdown()`` then found a group still alive whose gloo
  threads outlived it (the exit-time abort of docs/launching.md, "Shutdown");
- a script run through ``python -m engine.compat.deepspeed`` that returns (or ``sys.exit(0)``s)
  without destroying its groups, with async work still pending, exits 0 on every rank: the
  runner drains and destroys the groups while the interpreter is alive. Without it, 11 of 12
  such two-rank runs aborted at exit ("terminate called without an active exception", -6).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn as nn
from harness import scaled

import engine.compat.deepspeed as deepspeed
from engine.distributed.env import arm_exit_teardown, exit_wait_from_env, gloo_worker_threads, shutdown
from engine.distributed.spawn import free_port, spawn
from engine.distributed.teardown import EXIT_WAIT_S

HERE = os.path.dirname(os.path.abspath(__file__))
_GENEROUS = str(scaled(60))  # the exit wait where both ranks do reach their exit: never the limit
REPRO = os.path.join(HERE, "_shutdown_repro.py")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.fc2(torch.tanh(self.fc1(x))), y)


def _train_and_drop(rank: int, world: int, stage: int) -> dict:
    """Build an engine over its own data-parallel group, train two steps, drop every reference
    (no ``destroy()``), then tear down as an entry point does."""
    model = _Net()
    cfg = {"train_micro_batch_size_per_gpu": 2, "data_parallel_size": world, "torch_autocast": {"enabled": False},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        loss = eng(torch.randn(2, 6, generator=g), torch.randn(2, 3, generator=g))
        eng.backward(loss)
        eng.step()
    zero_opt = weakref.ref(eng.optimizer)
    groups = [weakref.ref(a.handle) for a in eng.groups.all_groups() if a.handle is not None]
    del eng, loss, _, model  # the model too: a script's frame is gone when it returns
    shutdown()
    gc.collect()
    return {"optimizer_alive": zero_opt() is not None, "groups": len(groups),
            "groups_alive": sum(r() is not None for r in groups), "gloo_threads": gloo_worker_threads()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_dropped_engine_frees_its_groups(stage):
    for out in spawn(_train_and_drop, 2, args=(stage,), timeout=scaled(120)):
        assert out["groups"] > 0, out  # the engine had a group of its own to lose
        assert out == {"optimizer_alive": False, "groups": out["groups"], "groups_alive": 0, "gloo_threads": 0}


def _run(mode: str, alias: bool = True, exit_code: bool = False, **env_extra: str) -> list[subprocess.CompletedProcess]:
    """Both ranks of ``_shutdown_repro.py work --mode MODE`` (a script with no teardown of its
    own), started as torchrun would; ``alias``: through ``python -m engine.compat.deepspeed``;
    ``exit_code``: the script ends with ``sys.exit(0)`` instead of returning."""
    port, procs = free_port(), []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", **env_extra)
        cmd = [sys.executable, *(["-m", "engine.compat.deepspeed"] if alias else []), REPRO, "work", "--mode", mode]
        if exit_code:
            cmd += ["--sys-exit"]
        procs.append(subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=scaled(120))
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return done


def _clean(proc: subprocess.CompletedProcess, what: str) -> None:
    assert proc.returncode == 0 and "terminate called" not in proc.stderr, \
        f"{what} exited {proc.returncode}:\n{proc.stderr[-2000:]}"
    assert "outlive shutdown" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("exit_code", [False, True], ids=["returns", "sys_exit_0"])
def test_a_script_without_teardown_exits_cleanly_through_the_runner(exit_code):
    for run in range(2):  # an unprotected run aborted 11 times in 12
        for rank, proc in enumerate(_run("none", exit_code=exit_code)):
            _clean(proc, f"run {run} rank {rank}")


def test_a_peer_that_failed_does_not_hang_the_runners_teardown():
    """Rank 1 exits 3 after a collective; rank 0's script returns, its teardown's barrier
    fails on the departed peer, and rank 0 leaves (with a note) instead of waiting."""
    rank0, rank1 = _run("victim_exit3", ENGINE_EXIT_WAIT_S="0")  # the runner's teardown alone
    assert rank1.returncode != 0, rank1.stderr[-2000:]
    assert rank0.returncode == 0, rank0.stderr[-2000:]
    assert "draining the process groups failed" in rank0.stderr, rank0.stderr[-2000:]


def test_an_import_changed_script_is_torn_down_at_exit():
    """``import engine.compat.deepspeed as deepspeed``, ``deepspeed.init_distributed()``, async
    work left pending, no teardown: the engine's atexit hook drains and destroys the groups
    once both ranks have reached their exit (checked by a hook that runs after it). With
    ENGINE_EXIT_WAIT_S=0 (the hook off) 3 of 12 such runs aborted."""
    for rank, proc in enumerate(_run("ds_none", alias=False, ENGINE_EXIT_WAIT_S=_GENEROUS)):
        _clean(proc, f"rank {rank}")
        assert "initialized at exit: False" in proc.stdout, proc.stdout
    for proc in _run("ds_none", alias=False, ENGINE_EXIT_WAIT_S="0"):  # the switch turns it off
        assert "initialized at exit: True" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_a_rank_that_fails_while_its_peers_exit_is_torn_down_with_them():
    """Rank 1 exits 3 after a collective while rank 0 returns: both are exiting, so both
    drain and destroy; rank 1 keeps its exit code."""
    rank0, rank1 = _run("ds_victim_exit3", alias=False, ENGINE_EXIT_WAIT_S=_GENEROUS)
    assert (rank0.returncode, rank1.returncode) == (0, 3), rank0.stderr[-1500:] + rank1.stderr[-1500:]
    assert "initialized at exit: False" in rank0.stdout and "initialized at exit: False" in rank1.stdout


def test_the_exit_teardown_does_not_wait_for_a_peer_still_in_a_collective():
    """Rank 1 exits 3 while rank 0 waits for it in an all-reduce: rank 1 gives up after
    ENGINE_EXIT_WAIT_S and exits 3 without touching the groups (a barrier against rank 0's
    all-reduce could hang), and rank 0's all-reduce then fails (exit 1), not hangs."""
    rank0, rank1 = _run("ds_victim_exit3_blocked", alias=False, ENGINE_EXIT_WAIT_S="2")
    assert (rank0.returncode, rank1.returncode) == (1, 3), rank0.stderr[-1500:] + rank1.stderr[-1500:]
    assert "initialized at exit: True" in rank1.stdout, rank1.stdout


def test_a_rank_dying_of_an_exception_leaves_at_once():
    """Rank 1 raises (uncaught) while rank 0 waits for it in an all-reduce: rank 1 skips the
    exit teardown and leaves at once, so rank 0's all-reduce fails. Were rank 1 to wait for
    rank 0 at exit (here up to 600 s), both would still be running at the 120 s limit."""
    rank0, rank1 = _run("ds_victim_raise_blocked", alias=False, ENGINE_EXIT_WAIT_S="600")
    assert rank1.returncode == 1 and "bad batch on rank 1" in rank1.stderr, rank1.stderr[-1500:]
    assert rank0.returncode == 1, rank0.stderr[-1500:]
    assert "initialized at exit: True" in rank1.stdout, rank1.stdout


@pytest.mark.parametrize("raw", ["-1", "soon", "inf", "nan"])
def test_a_bad_exit_wait_is_refused_when_the_teardown_is_armed(raw):
    with pytest.raises(ValueError, match="ENGINE_EXIT_WAIT_S='.*' is not a non-negative number of seconds"):
        arm_exit_teardown({"ENGINE_EXIT_WAIT_S": raw})  # as init_distributed and initialize call it
    assert exit_wait_from_env({}) == EXIT_WAIT_S and exit_wait_from_env({"ENGINE_EXIT_WAIT_S": "0"}) == 0
