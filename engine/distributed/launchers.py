"""Which launcher started this process, and what it says about the job (docs/launching.md).

Detection is a pure function of an ``environ`` mapping and an ``argv`` list, so every
launcher layout is testable without launching anything; :mod:`engine.distributed.env` passes
it the process's environment and re-exports everything here. Launchers, first match wins:
explicit RANK/WORLD_SIZE (``torchrun`` if TORCHELASTIC_RUN_ID / GROUP_RANK / LOCAL_WORLD_SIZE
is set, else ``deepspeed``, which also appends ``--local_rank=N``) > ``openmpi``
(OMPI_COMM_WORLD_*) > ``slurm`` (SLURM_PROCID) > ``single``. A launcher started inside an
allocation (torchrun under ``srun``) knows the per-process truth; the allocation's variables
describe the outer job. No torch here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

__all__ = ["LaunchError", "LaunchInfo", "detect_launch", "expand_hostlist", "DEFAULT_MASTER_ADDR",
           "DEFAULT_MASTER_PORT", "SLURM_PORT_BASE", "SLURM_PORT_SPAN"]

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
# Slurm without MASTER_PORT: a port derived from the job id, the same on every task, in
# [SLURM_PORT_BASE, SLURM_PORT_BASE + SLURM_PORT_SPAN): unprivileged and below Linux's
# ephemeral range (32768+) so it does not collide with outgoing connections.
SLURM_PORT_BASE = 10000
SLURM_PORT_SPAN = 20000

_TORCHRUN_MARKERS = ("TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_WORLD_SIZE")
_DEEPSPEED_MARKERS = ("LOCAL_SIZE", "CROSS_RANK")


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
