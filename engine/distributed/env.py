"""Launch detection, process-group bring-up and teardown (see docs/launching.md).

The only module in ``engine`` that reads environment variables: launch detection
(:mod:`engine.distributed.launchers`, re-exported here) is a pure function of the
``environ`` mapping and ``argv`` list this module passes it, and every ``ENGINE_*`` setting
of the distributed layer is parsed here. torch is imported lazily: detection stays
torch-free.
"""

from __future__ import annotations

import datetime
import logging
import os
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
from engine.distributed.launchers import (
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    SLURM_PORT_BASE,
    SLURM_PORT_SPAN,
    LaunchError,
    LaunchInfo,
    detect_launch,
    expand_hostlist,
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
    "DEFAULT_MASTER_ADDR", "DEFAULT_MASTER_PORT", "SLURM_PORT_BASE", "SLURM_PORT_SPAN",
    "DistEnv", "init_distributed", "launched_by_torch_style_launcher", "launcher_local_rank", "shutdown", "gloo_worker_threads",
    "PeerFailureError", "failure_guard", "record_failure",
    "OpBuildSettings", "op_build_settings", "env_flag",
    "strict_comm_from_env", "failure_watch_from_env", "exit_wait_from_env", "arm_exit_teardown", "free_bytes_override", "nccl_env_defaults", "cuda_index_for", "device_for_initialised_group",
]

logger = logging.getLogger(__name__)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


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
