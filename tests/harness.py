"""Run a function on N ranks in subprocesses over gloo: the tests' face of the one launcher.

``run_ranks(fn, world_size, *args)`` is :func:`engine.distributed.spawn.spawn` in its ``"gloo"``
mode: ``world_size`` new rank processes join a gloo group through a ``TCPStore`` the parent
owns, each calls ``fn(rank, world_size, *args, **kwargs)``, and the per-rank return values
come back as a list (picklable; tensors are fine). Failures (see the module docstring of
engine/distributed/spawn.py): a raising rank gives :class:`RankFailure` with its traceback, a
silent death names the rank and its exit code, nothing finishing within ``timeout`` gives
:class:`RankTimeout` naming the missing ranks, and no process outlives the call.

Strict NCCL-rules mode (``engine.distributed.strict``) is on in every rank when
``ENGINE_STRICT_COMM`` is set (tests/conftest.py sets it for the whole suite).

``fn`` must be importable by the child (module level in a test file).

Start-up cost: the ranks are forked by a fork server that has imported torch, the engine's
training modules and pytest once per pytest process (spawn's ``"forkserver"`` start method and
``PRELOAD``; the test module is still imported fresh in every rank), instead of each rank
spending 3-4 s of CPU importing them.
``ENGINE_TEST_START_METHOD=spawn`` runs every rank as a fresh interpreter instead (slower; its
interpreter finalisation is where a leaked gloo group can abort a rank at exit).

Time under load: every wall-clock limit a test sets goes through :func:`scaled`, which
multiplies it by ``ENGINE_TEST_TIME_SCALE`` (default 1; CI or a busy machine sets e.g. 3).
``run_ranks`` scales its ``timeout`` and ``collective_timeout`` itself; subprocess timeouts in
the tests are written ``timeout=scaled(120)``. Waits poll for their condition
(:func:`wait_for`) instead of sleeping a fixed time. tests/conftest.py scales pytest-timeout's
per-test limit and the failure watch's grace periods the same way.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable, Optional

from engine.distributed.spawn import RankFailure, RankTimeout, spawn

__all__ = ["run_ranks", "script_env", "dense_adamw_run", "RankFailure", "RankTimeout", "time_scale", "scaled", "wait_for",
           "TIME_SCALE_ENV", "START_METHOD_ENV", "start_method"]

TIME_SCALE_ENV = "ENGINE_TEST_TIME_SCALE"
START_METHOD_ENV = "ENGINE_TEST_START_METHOD"


def start_method() -> Optional[str]:
    """``ENGINE_TEST_START_METHOD`` (``forkserver`` or ``spawn``), or None: spawn's default."""
    raw = os.environ.get(START_METHOD_ENV, "").strip()
    if raw and raw not in ("forkserver", "spawn"):
        raise ValueError(f"{START_METHOD_ENV}={raw!r}: give 'forkserver' (the default) or 'spawn'")
    return raw or None


def time_scale() -> float:
    """The factor every test timeout is multiplied by: ``ENGINE_TEST_TIME_SCALE`` (default 1)."""
    raw = os.environ.get(TIME_SCALE_ENV, "").strip()
    if not raw:
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{TIME_SCALE_ENV}={raw!r}: give a positive number (1 = as written; 3 on a loaded machine)")
    return value


def scaled(seconds: float) -> float:
    """``seconds`` times :func:`time_scale` (a wall-clock limit that a loaded machine may need more of)."""
    return seconds * time_scale()


def wait_for(condition: Callable[[], Any], timeout: float, what: str = "the condition",
             interval: float = 0.05) -> Any:
    """Poll ``condition`` until it returns something truthy (returned) or ``scaled(timeout)``
    seconds pass (AssertionError naming ``what``)."""
    deadline = time.monotonic() + scaled(timeout)
    while True:
        got = condition()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {scaled(timeout):g} s waiting for {what}")
        time.sleep(interval)


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0,
              collective_timeout: Optional[float] = None, env: Optional[dict] = None,
              **kwargs: Any) -> list[Any]:
    """``timeout`` and ``collective_timeout`` are as written for a quiet machine: both are scaled."""
    return spawn(fn, world_size, args, kwargs, rendezvous="gloo", timeout=scaled(timeout),
                 collective_timeout=None if collective_timeout is None else scaled(collective_timeout), env=env,
                 start_method=start_method())  # type: ignore[arg-type]


def dense_adamw_run(model: Any, batches: Callable[[int], list], steps: int, lr: float = 1e-2
                    ) -> tuple[list[float], list[float]]:
    """The dense single-process reference: ``steps`` AdamW steps of ``model`` on the mean loss
    of ``batches(step)`` (a list of ``(inputs, targets)``); returns each step's loss and
    global gradient norm (before the update)."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, norms = [], []
    for s in range(steps):
        loss = torch.stack([model(x, y) for x, y in batches(s)]).mean()
        loss.backward()
        norms.append(torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters())).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def watch_gathered_numel(opt: Any) -> list[int]:
    """Record the most elements a ZeRO-3 optimizer ever has gathered at once: a one-element
    list updated after each of its all-gathers (wraps ``opt._start_gather``)."""
    peak = [0]
    start = opt._start_gather

    def watched(b: Any) -> None:
        start(b)
        peak[0] = max(peak[0], opt._live_numel)

    opt._start_gather = watched
    return peak


def script_env(engine: bool) -> dict[str, str]:
    """The environment for a user's script launched in a subprocess (one thread per rank,
    unbuffered): with ``engine``, this checkout's engine on ``PYTHONPATH``; without, no
    ``PYTHONPATH`` at all, so the script runs against what is installed (real DeepSpeed)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    if engine:
        env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout
    return env
