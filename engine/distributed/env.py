"""Launch detection, process-group bring-up and teardown (see docs/launching.md).

The only module in ``engine`` that reads environment variables. Detection is a pure
function of an ``environ`` mapping and an ``argv`` list, so every launcher layout is
testable without launching anything. Launchers, first match wins: explicit
RANK/WORLD_SIZE (``torchrun`` if TORCHELASTIC_RUN_ID / GROUP_RANK / LOCAL_WORLD_SIZE is
set, else ``deepspeed``, which also appends ``--local_rank=N``) > ``openmpi``
(OMPI_COMM_WORLD_*) > ``slurm`` (SLURM_PROCID) > ``single``. A launcher started inside
an allocation (torchrun under ``srun``) knows the per-process truth; the allocation's
variables describe the outer job. torch is imported lazily: detection stays torch-free.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

from engine.distributed.failures import (
    PeerFailureError,
    RendezvousStore,
    failure_guard,
    record_failure,
    register_process,
)
from engine.distributed.teardown import (
    EXIT_WAIT_S,
    bind_world_defaults_early,
    gloo_worker_threads,
    install_exit_teardown,
    shutdown,
)
from engine.distributed.watch import FailureWatch, WatchSettings, abort_all_groups, poll_interval

__all__ = [
    "LaunchError", "LaunchInfo", "detect_launch", "current_launch", "expand_hostlist",
    "DistEnv", "init_distributed", "launched_by_torch_style_launcher", "launcher_local_rank", "shutdown", "gloo_worker_threads",
    "PeerFailureError", "failure_guard", "record_failure",
    "OpBuildSettings", "op_build_settings", "env_flag",
    "strict_comm_from_env", "failure_watch_from_env", "exit_wait_from_env", "arm_exit_teardown", "free_bytes_override", "nccl_env_defaults", "cuda_index_for", "device_for_initialised_group",
]

logger = logging.getLogger(__name__)

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
# Slurm without MASTER_PORT: a port derived from the job id, the same on every task, in
# [SLURM_PORT_BASE, SLURM_PORT_BASE + SLURM_PORT_SPAN): unprivileged and below Linux's
# ephemeral range (32768+) so it does not collide with outgoing connections.
SLURM_PORT_BASE = 10000
SLURM_PORT_SPAN = 20000

_TORCHRUN_MARKERS = ("TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_WORLD_SIZE")
_DEEPSPEED_MARKERS = ("LOCAL_SIZE", "CROSS_RANK")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class LaunchError(RuntimeError):
    """The launch environment is missing a variable or contradicts itself."""


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as the launcher described it.

    ``agent_store``: torchrun's agent already hosts the rendezvous store on
    MASTER_ADDR:MASTER_PORT, so every rank (rank 0 included) connects as a client.
    """

    launcher: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: Optional[int]
    master_addr: str
    master_port: int
    agent_store: bool = False


# ----------------------------------------------------------------------- parsing helpers
def _fail(launcher: str, msg: str) -> LaunchError:
    return LaunchError(f"launcher {launcher!r} detected: {msg}")


def _int(environ: Mapping[str, str], name: str, launcher: str, minimum: int = 0) -> int:
    raw = environ.get(name)
    if raw is None:
        raise _fail(launcher, f"environment variable {name} is missing")
    if not re.fullmatch(r"\s*-?\d+\s*", raw):  # stricter than int(): no '1_0', no '+1'
        raise _fail(launcher, f"{name}={raw!r} is not an integer")
    value = int(raw)
    if value < minimum:
        raise _fail(launcher, f"{name}={value} must be >= {minimum}")
    return value


def _opt_int(environ: Mapping[str, str], name: str, launcher: str, minimum: int = 0) -> Optional[int]:
    return _int(environ, name, launcher, minimum) if name in environ else None


def _port(environ: Mapping[str, str], launcher: str) -> int:
    port = _int(environ, "MASTER_PORT", launcher, minimum=1)
    if port > 65535:
        raise _fail(launcher, f"MASTER_PORT={port} is not a TCP port (1..65535)")
    return port


def _addr(environ: Mapping[str, str], launcher: str, hint: str) -> str:
    addr = environ.get("MASTER_ADDR", "").strip()
    if not addr:
        raise _fail(launcher, f"environment variable MASTER_ADDR is missing or empty; {hint}")
    return addr


def _argv_local_rank(argv: Sequence[str]) -> Optional[int]:
    """``--local_rank=N`` / ``--local_rank N`` (also ``--local-rank``), as deepspeed appends."""
    for i, arg in enumerate(argv[1:], start=1):
        for flag in ("--local_rank", "--local-rank"):
            if arg == flag:
                raw = argv[i + 1] if i + 1 < len(argv) else ""
            elif arg.startswith(flag + "="):
                raw = arg[len(flag) + 1:]
            else:
                continue
            if not re.fullmatch(r"\d+", raw):
                raise LaunchError(f"launcher 'deepspeed' detected: command-line argument "
                                  f"{flag}={raw!r} is not a non-negative integer")
            return int(raw)
    return None


# ------------------------------------------------------------------------ Slurm hostlists
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _expand_brackets(expr: str, var: str) -> list[str]:
    """``gpu-[001-002]-x[1,3]`` -> cartesian product of every bracket group, in order."""
    out = [""]
    pos = 0
    while pos < len(expr):
        lb = expr.find("[", pos)
        if lb < 0:
            if "]" in expr[pos:]:
                raise LaunchError(f"{var}: unbalanced ']' in host expression {expr!r}")
            return [o + expr[pos:] for o in out]
        rb = expr.find("]", lb)
        if rb < 0 or "[" in expr[lb + 1:rb] or "]" in expr[pos:lb]:
            raise LaunchError(f"{var}: unbalanced '[' in host expression {expr!r}")
        values: list[str] = []
        for part in expr[lb + 1:rb].split(","):
            m = _RANGE.match(part.strip())
            if not m:
                raise LaunchError(f"{var}: bad range {part!r} in host expression {expr!r}")
            lo, hi = m.group(1), m.group(2) if m.group(2) is not None else m.group(1)
            if int(hi) < int(lo):
                raise LaunchError(f"{var}: descending range {part!r} in {expr!r}")
            # zero padding follows the written width of the lower bound: 08-10 -> 08,09,10
            width = len(lo) if lo.startswith("0") and len(lo) > 1 else 0
            values.extend(str(v).zfill(width) for v in range(int(lo), int(hi) + 1))
        out = [o + expr[pos:lb] + v for o in out for v in values]
        pos = rb + 1
    return out


def expand_hostlist(spec: str, var: str = "hostlist") -> list[str]:
    """Expand Slurm hostlist syntax: ``node[01-04,07]``, ``a[1-2],b3``, ``gpu-[001-002]-x``.

    Commas at bracket depth 0 separate host expressions; commas inside brackets separate
    ranges. ``var`` names the variable in error messages.
    """
    exprs, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise LaunchError(f"{var}: unbalanced or nested brackets in {spec!r}")
        if ch == "," and depth == 0:
            exprs.append(spec[start:i])
            start = i + 1
    if depth != 0:
        raise LaunchError(f"{var}: unbalanced '[' in {spec!r}")
    exprs.append(spec[start:])
    hosts: list[str] = []
    for expr in exprs:
        expr = expr.strip()
        if not expr:
            raise LaunchError(f"{var}: empty host name in {spec!r}")
        hosts.extend(_expand_brackets(expr, var))
    return hosts


def _tasks_on_node(spec: str, node_id: int, var: str) -> int:
    """SLURM_TASKS_PER_NODE ``2(x3),1`` -> tasks on node ``node_id``."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise LaunchError(f"launcher 'slurm' detected: {var}={spec!r} is not of the form '2(x3),1'")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    if node_id >= len(counts):
        raise LaunchError(f"launcher 'slurm' detected: SLURM_NODEID={node_id} but {var}={spec!r} "
                          f"lists only {len(counts)} nodes")
    return counts[node_id]


# ------------------------------------------------------------------------- launchers
def _detect_torch_style(environ: Mapping[str, str], argv_local: Optional[int]) -> LaunchInfo:
    marker = next((m for m in _TORCHRUN_MARKERS if m in environ), None)
    launcher = "torchrun" if marker else "deepspeed"
    for present, absent in (("WORLD_SIZE", "RANK"), ("RANK", "WORLD_SIZE")):
        if present in environ and absent not in environ:
            raise _fail(launcher, f"{present} is set but {absent} is missing: set both, or neither "
                                  "to let Slurm / Open MPI / single-process detection apply")
    if "RANK" not in environ:
        why = f"{marker} is set" if marker else "--local_rank was passed on the command line"
        raise _fail(launcher, f"{why} but RANK and WORLD_SIZE are missing")
    rank = _int(environ, "RANK", launcher)
    world = _int(environ, "WORLD_SIZE", launcher, minimum=1)
    env_local = _opt_int(environ, "LOCAL_RANK", launcher)
    if env_local is not None and argv_local is not None and env_local != argv_local:
        raise _fail(launcher, f"LOCAL_RANK={env_local} contradicts the command-line argument "
                              f"--local_rank={argv_local}")
    local_rank = env_local if env_local is not None else argv_local
    if local_rank is None:
        raise _fail(launcher, "environment variable LOCAL_RANK is missing (and no --local_rank "
                              "argument): export LOCAL_RANK, e.g. LOCAL_RANK=$SLURM_LOCALID")
    local_world = _opt_int(environ, "LOCAL_WORLD_SIZE" if launcher == "torchrun" else "LOCAL_SIZE",
                           launcher, minimum=1)
    hint = "the launcher should set it to the address of the rank-0 host"
    return LaunchInfo(launcher, rank, local_rank, world, local_world,
                      _addr(environ, launcher, hint), _port(environ, launcher),
                      agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def _detect_openmpi(environ: Mapping[str, str]) -> LaunchInfo:
    launcher = "openmpi"
    hint = ("mpirun does not provide a rendezvous address: pass "
            "-x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=<free port> to mpirun")
    if "MASTER_PORT" not in environ:
        raise _fail(launcher, f"environment variable MASTER_PORT is missing; {hint}")
    return LaunchInfo(
        launcher,
        rank=_int(environ, "OMPI_COMM_WORLD_RANK", launcher),
        local_rank=_int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", launcher),
        world_size=_int(environ, "OMPI_COMM_WORLD_SIZE", launcher, minimum=1),
        local_world_size=_opt_int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", launcher, minimum=1),
        master_addr=_addr(environ, launcher, hint),
        master_port=_port(environ, launcher),
    )


def _detect_slurm(environ: Mapping[str, str]) -> LaunchInfo:
    launcher = "slurm"
    world_var = "SLURM_NTASKS" if "SLURM_NTASKS" in environ else "SLURM_NPROCS"
    if world_var not in environ:
        raise _fail(launcher, "environment variable SLURM_NTASKS is missing (run under srun)")
    if environ.get("MASTER_ADDR", "").strip():
        addr = environ["MASTER_ADDR"].strip()
    else:
        # the step's node list first: rank 0 runs on its first node (block distribution)
        var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                    if environ.get(v, "").strip()), None)
        if var is None:
            raise _fail(launcher, "neither MASTER_ADDR nor SLURM_JOB_NODELIST/SLURM_NODELIST is set")
        try:
            addr = expand_hostlist(environ[var].strip(), var)[0]
        except LaunchError as exc:
            raise _fail(launcher, str(exc)) from None
    if "MASTER_PORT" in environ:
        port = _port(environ, launcher)
    else:
        job_id = _int(environ, "SLURM_JOB_ID", launcher) if "SLURM_JOB_ID" in environ else None
        if job_id is None:
            raise _fail(launcher, "neither MASTER_PORT nor SLURM_JOB_ID is set")
        port = SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN
    local_world = None
    per_node_var = next((v for v in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
                         if v in environ), None)
    if per_node_var is not None and "SLURM_NODEID" in environ:
        local_world = _tasks_on_node(environ[per_node_var], _int(environ, "SLURM_NODEID", launcher),
                                     per_node_var)
    return LaunchInfo(launcher, _int(environ, "SLURM_PROCID", launcher),
                      _int(environ, "SLURM_LOCALID", launcher),
                      _int(environ, world_var, launcher, minimum=1), local_world, addr, port)


def _single(environ: Mapping[str, str]) -> LaunchInfo:
    port = _port(environ, "single") if "MASTER_PORT" in environ else DEFAULT_MASTER_PORT
    addr = environ.get("MASTER_ADDR", "").strip() or DEFAULT_MASTER_ADDR
    return LaunchInfo("single", 0, 0, 1, 1, addr, port)


def _validate(info: LaunchInfo) -> LaunchInfo:
    names = {
        "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
        "deepspeed": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE"),
        "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE"),
        "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_TASKS_PER_NODE"),
    }.get(info.launcher, ("rank", "world size", "local rank", "local world size"))
    rank_v, world_v, local_v, lworld_v = names
    if info.rank >= info.world_size:
        raise _fail(info.launcher, f"{rank_v}={info.rank} must be < {world_v}={info.world_size}")
    if info.local_world_size is not None:
        if info.local_world_size > info.world_size:
            raise _fail(info.launcher, f"{lworld_v}={info.local_world_size} exceeds "
                                       f"{world_v}={info.world_size}")
        if info.local_rank >= info.local_world_size:
            raise _fail(info.launcher, f"{local_v}={info.local_rank} must be < "
                                       f"{lworld_v}={info.local_world_size}")
    elif info.local_rank > info.rank:
        raise _fail(info.launcher, f"{local_v}={info.local_rank} exceeds {rank_v}={info.rank}")
    return info


def detect_launch(environ: Mapping[str, str], argv: Sequence[str]) -> LaunchInfo:
    """Work out the launcher and this process's place in the job. Pure; raises LaunchError."""
    argv_local = _argv_local_rank(argv)
    torch_style = ("RANK" in environ or "WORLD_SIZE" in environ or argv_local is not None
                   or any(m in environ for m in _TORCHRUN_MARKERS + _DEEPSPEED_MARKERS))
    if torch_style:
        info = _detect_torch_style(environ, argv_local)
    elif "OMPI_COMM_WORLD_RANK" in environ or "OMPI_COMM_WORLD_SIZE" in environ:
        info = _detect_openmpi(environ)
    elif "SLURM_PROCID" in environ:
        info = _detect_slurm(environ)
    else:
        info = _single(environ)
    return _validate(info)


# ------------------------------------------------------------------------- bring-up
if TYPE_CHECKING:  # torch is imported lazily at run time, so launch detection stays torch-free
    import torch


@dataclass(frozen=True)
class DistEnv:
    """The initialised distributed context: launch info, device, backend, rendezvous store."""

    launch: LaunchInfo
    device: torch.device  # torch imported lazily (TYPE_CHECKING above) so detection stays torch-free
    backend: str
    timeout_s: float
    store: RendezvousStore  # the c10d Store the default group rendezvoused through
    watch: Optional[FailureWatch] = None  # polls the store for a peer's failure (engine.distributed.watch)
    failure_grace_s: float = WatchSettings.grace_s  # ENGINE_FAILURE_GRACE_S: failure_guard's and the watch's grace

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def local_rank(self) -> int:
        return self.launch.local_rank


_BACKEND_FOR_DEVICE = {"cuda": "nccl", "cpu": "gloo"}


def cuda_index_for(local_rank: int, visible: int, launcher: str) -> int:
    """The CUDA device index of a process with ``local_rank`` that sees ``visible`` GPUs.

    One GPU per process, in local-rank order, when the process sees the whole node. A
    process that sees exactly one GPU has been bound to it (Slurm ``--gpus-per-task=1`` /
    ``--gpu-bind``, or a CUDA_VISIBLE_DEVICES per task): that one is index 0 whatever the
    local rank. Anything else cannot be mapped one-to-one and is an error.
    """
    if visible < 1:
        raise LaunchError(f"launcher {launcher!r}: no GPU is visible to this process (CUDA_VISIBLE_DEVICES empty?)")
    if local_rank < visible:
        return local_rank
    if visible == 1:
        return 0
    raise LaunchError(f"launcher {launcher!r}: local rank {local_rank} needs cuda:{local_rank} but only {visible} "
                      f"GPU(s) are visible: start at most {visible} processes per node, fix CUDA_VISIBLE_DEVICES, "
                      "or bind one GPU per task (srun --gpus-per-task=1)")


def _pick_device(device: Optional[str], info: LaunchInfo):
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in _BACKEND_FOR_DEVICE:
        raise LaunchError(f"unsupported device {device!r}: expected 'cpu', 'cuda' or 'cuda:N'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise LaunchError(f"device {device!r} requested but CUDA is not available "
                              "(CPU-only torch build or no visible GPU): use device='cpu'")
        count = torch.cuda.device_count()
        if dev.index is None:
            dev = torch.device("cuda", cuda_index_for(info.local_rank, count, info.launcher))
        elif dev.index >= count:
            raise LaunchError(f"launcher {info.launcher!r}: {dev} requested but only {count} GPU(s) are visible")
    return dev


def device_for_initialised_group(backend: str, bound_index: Optional[int], current_index: int, visible: int,
                                 environ: Optional[Mapping[str, str]] = None) -> tuple[str, Optional[int]]:
    """Device of a default group the user initialised (``engine.initialize`` without a DistEnv):
    ``(type, index)``. Pure apart from reading the launch variables.

    gloo -> cpu. NCCL: the device the group was bound to (``init_process_group(device_id=)``),
    else the current device if the user chose one (``set_device`` to a non-zero index), else the
    local rank's GPU from the launcher's variables - a group initialised without ``set_device``
    would otherwise put every rank on GPU 0 (NCCL: "Duplicate GPU detected", or all ranks
    sharing one GPU's memory).
    """
    if backend != "nccl":
        return "cpu", None
    if bound_index is not None:
        return "cuda", bound_index
    if current_index != 0:
        return "cuda", current_index
    info = detect_launch(os.environ if environ is None else environ, sys.argv)
    return "cuda", cuda_index_for(info.local_rank, visible, info.launcher)


def _pick_backend(backend: Optional[str], dev) -> str:
    expected = _BACKEND_FOR_DEVICE[dev.type]
    if backend is None:
        return expected
    if backend.lower() != expected:
        raise LaunchError(f"backend {backend!r} does not fit device {dev}: use backend="
                          f"{expected!r} for {dev.type} (or leave backend=None to choose it)")
    return expected


def _make_store(info: LaunchInfo, timeout: datetime.timedelta):
    import torch.distributed as dist

    if info.launcher == "single":
        return dist.HashStore()  # one process: no port, nothing to collide with
    return dist.TCPStore(info.master_addr, info.master_port, info.world_size,
                         is_master=info.rank == 0 and not info.agent_store,
                         timeout=timeout, multi_tenant=True)


# Flight recorder and dump on timeout: when a collective times out, NCCL's watchdog aborts
# the communicator; with these set every rank first writes the last collectives it issued
# (op, group, sizes, state) to TORCH_FR_DUMP_TEMP_FILE (older name
# TORCH_NCCL_DEBUG_INFO_TEMP_FILE) + rank, which names the rank that never arrived. The
# buffer size has two names (TORCH_FR_BUFFER_SIZE, the older TORCH_NCCL_TRACE_BUFFER_SIZE):
# both are set, and neither if the user set one. The user's own settings always win.
FLIGHT_RECORDER_ENTRIES = "2000"


def nccl_env_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """The NCCL variables to set before the group is created: the defaults the user has not set."""
    out = {}
    if "TORCH_FR_BUFFER_SIZE" not in environ and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in environ:
        out["TORCH_FR_BUFFER_SIZE"] = out["TORCH_NCCL_TRACE_BUFFER_SIZE"] = FLIGHT_RECORDER_ENTRIES
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in environ:
        out["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    return out


def strict_comm_from_env(environ: Optional[Mapping[str, str]] = None) -> bool:
    """``ENGINE_STRICT_COMM``: check every collective and transfer against NCCL's rules on any
    backend (engine.distributed.strict); on in the test suite, off by default (it adds one small
    all-gather per collective)."""
    return env_flag("ENGINE_STRICT_COMM", False, environ)


def _seconds(environ: Mapping[str, str], name: str, allow_zero: bool = False) -> Optional[float]:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value >= 0 if allow_zero else value > 0) or value == float("inf"):
        kind = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{name}={raw!r} is not a {kind} number of seconds")
    return value


def exit_wait_from_env(environ: Optional[Mapping[str, str]] = None) -> float:
    """``ENGINE_EXIT_WAIT_S``: seconds an exiting rank waits for every rank to reach its exit
    before the exit teardown (default 10; 0 turns the teardown off)."""
    wait_s = _seconds(os.environ if environ is None else environ, "ENGINE_EXIT_WAIT_S", allow_zero=True)
    return EXIT_WAIT_S if wait_s is None else wait_s


def arm_exit_teardown(environ: Optional[Mapping[str, str]] = None) -> None:
    """The ``atexit`` teardown for a script that ends without :func:`shutdown`
    (:func:`engine.distributed.teardown.install_exit_teardown`), with ``ENGINE_EXIT_WAIT_S``
    and this launch attempt (``TORCHELASTIC_RESTART_COUNT``). A bad value raises on every rank."""
    environ = os.environ if environ is None else environ
    install_exit_teardown(exit_wait_from_env(environ), environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def free_bytes_override(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """``ENGINE_TEST_FREE_BYTES``: a test hook (docs/training.md) that makes the trainer's
    low-disk-space check see this many free bytes instead of measuring; None when unset."""
    raw = (os.environ if environ is None else environ).get("ENGINE_TEST_FREE_BYTES", "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ValueError(f"ENGINE_TEST_FREE_BYTES={raw!r} is not a number of bytes")
    return int(raw)


def failure_watch_from_env(environ: Optional[Mapping[str, str]] = None) -> WatchSettings:
    """``ENGINE_FAILURE_WATCH`` (boolean, default on): watch the store for a peer's failure
    and stop within seconds whatever the backend (engine.distributed.watch);
    ``ENGINE_FAILURE_WATCH_INTERVAL`` seconds between polls (default max(1, world/1000));
    ``ENGINE_FAILURE_GRACE_S`` (older name ``ENGINE_FAILURE_WATCH_GRACE``) seconds for the
    blocked call to return after the abort before the process exits, and for
    ``failure_guard`` to hear from the other survivors (default 5; a loaded machine's
    tests raise it)."""
    environ = os.environ if environ is None else environ
    grace = _seconds(environ, "ENGINE_FAILURE_GRACE_S")
    if grace is None:
        grace = _seconds(environ, "ENGINE_FAILURE_WATCH_GRACE")
    return WatchSettings(enabled=env_flag("ENGINE_FAILURE_WATCH", True, environ),
                         interval_s=_seconds(environ, "ENGINE_FAILURE_WATCH_INTERVAL"),
                         grace_s=WatchSettings.grace_s if grace is None else grace)


def _start_watch(settings: WatchSettings, store, info: LaunchInfo, backend: str) -> Optional[FailureWatch]:
    if not settings.enabled or info.world_size == 1:
        return None
    # only NCCL's abort unblocks a collective; gloo's leaves it blocked even when the
    # peer's sockets close (engine.distributed.watch), so gloo relies on those and the exit
    abort = abort_all_groups if backend == "nccl" else None
    return FailureWatch(store, info.rank, info.world_size, poll_interval(info.world_size, settings.interval_s),
                        settings.grace_s, hosts_store=info.rank == 0 and not info.agent_store, abort=abort).start()


def init_distributed(timeout_s: float = 1800.0, backend: Optional[str] = None,
                     device: Optional[str] = None, environ: Optional[Mapping[str, str]] = None,
                     argv: Optional[Sequence[str]] = None) -> DistEnv:
    """Detect the launcher, choose device and backend, and initialise the default group.

    ``timeout_s`` bounds the rendezvous and every collective (pass the same value to
    :meth:`ParallelGroups.build` so subgroups honour it too). Call :func:`shutdown` at the
    end of the job (if a script does not, an ``atexit`` hook does it once every rank has
    reached its exit: :func:`arm_exit_teardown`).
    """
    import torch
    import torch.distributed as dist

    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    if dist.is_initialized():
        raise LaunchError("torch.distributed is already initialised: call shutdown() first")
    info = detect_launch(os.environ if environ is None else environ,
                         sys.argv if argv is None else argv)
    dev = _pick_device(device, info)
    be = _pick_backend(backend, dev)
    timeout = datetime.timedelta(seconds=timeout_s)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if be == "nccl":
        # read by ProcessGroupNCCL when it is constructed: set before init_process_group
        for name, value in nccl_env_defaults(os.environ).items():
            os.environ[name] = value
    watch_settings = failure_watch_from_env()  # a bad value is an error before any connection
    if strict_comm_from_env():
        from engine.distributed import strict

        strict.enable(dev.type)
    store = _make_store(info, timeout)
    extra = {"device_id": dev} if dev.type == "cuda" else {}
    bind_world_defaults_early()
    dist.init_process_group(be, store=store, rank=info.rank, world_size=info.world_size,
                            timeout=timeout, **extra)
    register_process(store, info.rank)
    arm_exit_teardown()  # for a script that ends without shutdown() (a DeepSpeed loop)
    logger.info("rank %d/%d (%s, local rank %d) on %s with %s, collective timeout %.0fs",
                info.rank, info.world_size, info.launcher, info.local_rank, dev, be, timeout_s)
    return DistEnv(launch=info, device=dev, backend=be, timeout_s=timeout_s, store=store,
                   watch=_start_watch(watch_settings, store, info, be), failure_grace_s=watch_settings.grace_s)


# ------------------------------------------------------------------ failure reporting
# Store keys (under the rendezvous store every rank already holds a connection to):
#   engine/proc/<r>     "<host> <pid>", written at init, so a survivor can tell whether a
#                       peer on its own host is still running
#   engine/failed/<r>   the exception a rank raised inside failure_guard
#   engine/checkin/<r>  written by a survivor whose collective failed
#   engine/first/failed the first rank that recorded a failure (before count/failed grows)
#   engine/count/seen   failure watches that have read it (engine.distributed.watch)


# ---------------------------------------------------------------------- op builder
def env_flag(name: str, default: bool = False, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Boolean environment flag: 1/true/yes/on or 0/false/no/off (case-insensitive)."""
    environ = os.environ if environ is None else environ
    raw = environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean: set it to 1/true/yes/on or 0/false/no/off")


@dataclass(frozen=True)
class OpBuildSettings:
    """How the op builder gets compiled extensions.

    build_ops: compile ahead of time (``ENGINE_BUILD_OPS``) instead of JIT-loading.
    extensions_dir: where built extensions live (``ENGINE_EXTENSIONS_DIR``); None = torch default.
    cuda_arch_list: ``TORCH_CUDA_ARCH_LIST`` passed through; None = let torch decide.
    """

    build_ops: bool = False
    extensions_dir: Optional[str] = None
    cuda_arch_list: Optional[str] = None


def op_build_settings(environ: Optional[Mapping[str, str]] = None) -> OpBuildSettings:
    environ = os.environ if environ is None else environ
    return OpBuildSettings(
        build_ops=env_flag("ENGINE_BUILD_OPS", False, environ),
        extensions_dir=environ.get("ENGINE_EXTENSIONS_DIR") or None,
        cuda_arch_list=environ.get("TORCH_CUDA_ARCH_LIST") or None,
    )


def launched_by_torch_style_launcher(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when RANK and WORLD_SIZE are set (torchrun, the deepspeed launcher, or a script
    that set them): the launcher made the ranks, so a benchmark must not spawn its own."""
    environ = os.environ if environ is None else environ
    return "RANK" in environ and "WORLD_SIZE" in environ


def current_launch() -> LaunchInfo:
    """This process's :class:`LaunchInfo` from the real environment and argv."""
    return detect_launch(os.environ, sys.argv)


def launcher_local_rank(world_size: int) -> Optional[int]:
    """The launcher's local rank of this process (``LOCAL_RANK``, ``--local_rank``, Open MPI's
    or Slurm's), or None when the environment does not describe a job of ``world_size``
    ranks (a process group made by hand, without a launcher)."""
    info = current_launch()
    return info.local_rank if info.world_size == world_size else None
