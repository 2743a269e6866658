"""Shared pieces of the benchmarks: launching ranks, timing phases and collectives, the
measured CPU matmul peak, the machine description and the output formats.

Benchmarks are entry points, not library code: they may read the environment, print and
parse arguments. Everything here runs on CPU (gloo) and on CUDA (NCCL); the device and
backend come from :func:`engine.distributed.env.init_distributed`.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from engine.distributed.env import launched_by_torch_style_launcher  # noqa: E402
from engine.distributed.spawn import free_port, spawn  # noqa: E402

__all__ = ["ROOT", "launch", "launched_externally", "CommTimer", "PhaseTimer", "sync", "cpu_matmul_peak",
           "machine_description", "markdown_table", "median", "spread", "write_json", "free_port"]


# ------------------------------------------------------------------ launching ranks
def launched_externally() -> bool:
    """True under torchrun / the deepspeed launcher / srun (the launcher made the ranks)."""
    return launched_by_torch_style_launcher()


def launch(fn: Callable, nproc: int, *args: Any, threads: Optional[int] = 1, timeout: float = 3600.0) -> list:
    """Run ``fn(*args)`` on ``nproc`` fresh processes with a torchrun-style environment
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and return each rank's result: the
    ``"env"`` mode of the one launcher, :func:`engine.distributed.spawn.spawn`.

    Under an external launcher (torchrun, deepspeed, srun) ``fn`` runs in this process only
    and the list holds just this rank's result. ``fn`` must be importable (module level)
    and initialises the process group itself (``engine.distributed.env.init_distributed``).
    """
    if launched_externally():
        return [fn(*args)]
    return spawn(fn, nproc, args, rendezvous="env", timeout=timeout, threads=threads)


# ------------------------------------------------------------------ timing
def sync(device: Optional[torch.device]) -> None:
    """Wait for queued device work (CUDA); nothing on CPU."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


# isend/irecv stay unwrapped: dist.P2POp accepts only those very functions; the Works that
# batch_isend_irecv returns are timed at their wait().
_P2P = ("send", "recv", "batch_isend_irecv")
_COLLECTIVES = _P2P + ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "_all_gather_base",
                "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base",
                "broadcast", "reduce", "all_to_all_single", "all_reduce_coalesced", "barrier")


class _TimedWork:
    """An async ``Work`` whose ``wait()`` counts as communication time."""

    def __init__(self, work: Any, timer: "CommTimer", kind: str) -> None:
        self._work, self._timer, self._kind = work, timer, kind

    def wait(self, *a: Any, **k: Any) -> Any:
        with self._timer.region(self._kind):
            return self._work.wait(*a, **k)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CommTimer:
    """Exposed communication time of this process: time spent inside a collective or
    point-to-point call of ``torch.distributed`` plus time blocked in ``Work.wait()`` of an
    asynchronous one (time that overlapped with compute is not counted).

    CPU (gloo): wall time of the call. CUDA (NCCL): the call only enqueues, so a CUDA event
    pair is recorded around it on the current stream and resolved when ``by_kind`` /
    ``seconds`` is read (after the step): the time the compute stream waited for the
    collective. No device sync per collective, which would serialise the overlap of
    compute and communication being measured.

    ``install()`` wraps the module-level functions of ``torch.distributed``; call it before
    any library binds them (DeepSpeed keeps references from its ``init_distributed``).
    Nested calls (a deprecated API calling its replacement) count once.
    """

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.device = device
        self._seconds = 0.0
        self._by_kind = {"collective": 0.0, "p2p": 0.0}
        self._pending: list[tuple[str, Any, Any]] = []  # (kind, start event, end event), CUDA only
        self.calls = 0
        self._local = threading.local()
        self._originals: dict[str, Callable] = {}

    def _resolve(self) -> None:
        """Add the CUDA event pairs recorded so far (waits for the last of them only)."""
        if not self._pending:
            return
        self._pending[-1][2].synchronize()
        for kind, start, end in self._pending:
            dt = start.elapsed_time(end) / 1e3
            self._seconds += dt
            self._by_kind[kind] += dt
        self._pending.clear()

    @property
    def by_kind(self) -> dict[str, float]:
        self._resolve()
        return self._by_kind

    @property
    def seconds(self) -> float:
        self._resolve()
        return self._seconds

    @contextlib.contextmanager
    def region(self, kind: str = "collective"):
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        on_gpu = depth == 0 and self.device is not None and self.device.type == "cuda"
        if on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                self.calls += 1
                if on_gpu:
                    end.record()
                    self._pending.append((kind, start, end))
                else:
                    dt = time.perf_counter() - t0
                    self._seconds += dt
                    self._by_kind[kind] += dt

    def _wrap(self, name: str, fn: Callable) -> Callable:
        timer = self
        kind = "p2p" if name in _P2P else "collective"

        def timed(*a: Any, **k: Any) -> Any:
            with timer.region(kind):
                out = fn(*a, **k)
            if out is None or getattr(timer._local, "depth", 0):
                return out
            if isinstance(out, list):  # batch_isend_irecv
                return [_TimedWork(w, timer, kind) if hasattr(w, "wait") else w for w in out]
            return _TimedWork(out, timer, kind) if hasattr(out, "wait") else out

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        timed.__name__ = name
        return timed

    def install(self) -> "CommTimer":
        for name in _COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None and name not in self._originals:
                self._originals[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        return self

    def uninstall(self) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()


class PhaseTimer:
    """Accumulates wall time per phase and subtracts the communication that happened inside
    it, so ``forward + backward + optimizer + communication (+ other)`` adds up to the step."""

    def __init__(self, comm: CommTimer, device: Optional[torch.device]) -> None:
        self.comm, self.device = comm, device
        self.seconds: dict[str, float] = {}
        self.comm_inside: dict[str, float] = {}  # collective (not p2p) time inside each phase
        self._wrapped: list[tuple[Any, str]] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        sync(self.device)
        c0, t0 = self.comm.by_kind["collective"], time.perf_counter()
        try:
            yield
        finally:
            sync(self.device)
            dt, dc = time.perf_counter() - t0, self.comm.by_kind["collective"] - c0
            self.seconds[name] = self.seconds.get(name, 0.0) + dt
            self.comm_inside[name] = self.comm_inside.get(name, 0.0) + dc

    def wrap(self, obj: Any, method: str, name: str) -> None:
        """Time every call of ``obj.method`` as phase ``name`` (an instance attribute wraps
        the bound method; the object's class is untouched)."""
        orig = getattr(obj, method)

        def timed(*a: Any, **k: Any) -> Any:
            with self.phase(name):
                return orig(*a, **k)

        setattr(obj, method, timed)
        self._wrapped.append((obj, method))

    def unwrap(self) -> None:
        """Remove every wrapper :meth:`wrap` installed (each holds its object through the
        bound method; dropped, nothing keeps the engine's process groups alive)."""
        for obj, method in reversed(self._wrapped):
            delattr(obj, method)
        self._wrapped.clear()

    def compute(self, name: str) -> float:
        return self.seconds.get(name, 0.0) - self.comm_inside.get(name, 0.0)

    def reset(self) -> None:
        self.seconds.clear()
        self.comm_inside.clear()


def cpu_matmul_peak(dtype: torch.dtype = torch.float32, n: int = 1024, seconds: float = 1.0) -> float:
    """Sustained FLOP/s of back-to-back square ``n`` x ``n`` matmuls on this process's
    threads over about ``seconds`` (total FLOPs / total wall time): the CPU "peak" MFU is
    measured against. Sustained, not best-of: on a shared machine a single matmul fits in
    one scheduler slice and measures an unshared core, which the training steps never get."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # warm-up (thread pool, packing buffers)
    reps = 0
    t0 = time.perf_counter()
    while reps < 3 or time.perf_counter() - t0 < seconds:
        torch.mm(a, b)
        reps += 1
    return 2.0 * n ** 3 * reps / (time.perf_counter() - t0)


# ------------------------------------------------------------------ statistics and output
def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: Sequence[float]) -> dict[str, float]:
    """Median, min, max and interquartile range."""
    if not xs:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "iqr": float("nan")}
    s = sorted(xs)
    q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0]] * 3
    return {"median": statistics.median(s), "min": s[0], "max": s[-1], "iqr": q[2] - q[0]}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description() -> dict[str, Any]:
    """What the numbers were measured on."""
    d: dict[str, Any] = {
        "host": platform.node(), "os": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
        "load_average": [round(x, 1) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "cuda": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        d["gpu"] = torch.cuda.get_device_name(0)
        d["gpu_count"] = torch.cuda.device_count()
    # the version from the package metadata: importing deepspeed after init_process_group
    # pins the default group (its import binds it somewhere no destroy reaches), so its
    # gloo threads would outlive shutdown()
    from importlib import metadata

    try:
        d["deepspeed"] = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        d["deepspeed"] = None
    return d


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A GitHub markdown table of ``rows`` (dicts) with the given column keys."""
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            if v != v:
                return "nan"
            return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 1 else f"{v:.3g}"
        return str(v)

    out = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    out += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(out)


def write_json(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, default=str)
        f.write("\n")


# ------------------------------------------------------------------ kernel micro-benchmarks
def copy_probe(device: torch.device) -> tuple[Callable[[], Any], int]:
    """A large tensor copy, timed in the same round-robin as the kernels so it sees the
    same machine load; returns (step function, bytes moved = read + write)."""
    numel = 1 << 28 if device.type == "cuda" else 1 << 25
    src = torch.ones(numel, device=device)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * 4 * numel


def time_interleaved(variants: dict[str, Callable[[], Any]], device: torch.device, reps: int,
                     warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each variant, timed round-robin (machine load hits all
    alike) after ``warmup`` untimed calls each (first calls allocate state)."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bandwidth_table(med: dict[str, float], copy_bw: float, moved_bytes: Callable[[str], float],
                    baseline: Callable[[str], str], speedup_key: str, width: int = 30) -> dict[str, dict]:
    """Print, and return, one row per variant: ms, speed-up over ``baseline(name)``,
    effective bandwidth (``moved_bytes(name)`` / time) and its % of the copy bandwidth."""
    print(f"  {'variant':<{width}} {'ms':>9} {'speed-up':>9} {'GB/s':>8} {'% copy bw':>10}")
    rows = {}
    for name, t in med.items():
        speedup = med[baseline(name)] / t
        gbps = moved_bytes(name) / t / 1e9
        pct = 100 * gbps * 1e9 / copy_bw
        rows[name] = {"ms": t * 1e3, speedup_key: speedup, "GBps": gbps, "pct_copy_bw": pct}
        print(f"  {name:<{width}} {t * 1e3:9.3f} {speedup:8.2f}x {gbps:8.1f} {pct:9.0f}%")
    return rows
