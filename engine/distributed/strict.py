"""Strict NCCL-rules mode: enforce on gloo what NCCL requires and gloo forgives.

Off by default (production pays nothing). The distributed test suite turns it on
(``ENGINE_STRICT_COMM=1``, read by :func:`engine.distributed.env.strict_comm_from_env`; the test
harness and :func:`engine.distributed.env.init_distributed` call :func:`enable`). With it on,
every collective and point-to-point transfer that goes through :mod:`engine.distributed.comm`
is checked against the rules a real NCCL job lives by:

1. device: every tensor is on the job's device type (``cuda`` under NCCL). NCCL rejects
   a CPU tensor at the call, after every earlier step has run; gloo accepts both.
2. contiguity: NCCL reads raw memory; a non-contiguous view is an error there.
3. same collective, dtype and element count on every member of the group (equal sizes for
   all-gather / reduce-scatter, the same ``src`` for broadcast): a per-call header
   (a small all-gather of ``[op, dtype, numel, extra, sequence hash, call count]``) is
   compared on every rank, so every rank raises the same error before any can hang.
   NCCL would hang or silently read garbage.
4. send/receive: every transfer is preceded, in the same batch, by a header carrying the
   sender's dtype and shape; the receiver compares it with its buffer when the batch is
   waited for. NCCL would corrupt silently on a same-size mismatch and hang otherwise.
5. sequence: each group keeps a running hash of the collectives issued on it;
   :func:`check_sequence` (called at every optimizer-step boundary by the engine) compares
   it across members, and every per-call header carries it too.
6. no blocking host sync (``.item()``, ``.tolist()``, ``bool(t)``, ``float(t)``,
   ``.cpu()``, ``.numpy()``) inside :func:`no_host_sync` regions: the backward pass with
   the ZeRO gradient hooks, the pipeline executor's step and the ZeRO optimizer step up to
   the inner optimizer (reduction, norm, clipping; fp16's one skip read is exempt). On a GPU each one stalls the
   host until the device queue drains, which serialises compute and communication.

7. every direct ``torch.distributed`` call (code that bypasses :mod:`engine.distributed.comm`)
   is seen too: while the mode is on, the tensor collectives and transfers of
   ``torch.distributed`` are wrapped (:data:`GUARDED_COLLECTIVES`) and their tensors checked
   by rules 1 and 2, and the object collectives (:data:`OBJECT_COLLECTIVES`: pickling, a host
   round trip and a device sync each) are refused inside a step region.
8. all-to-all (Muon's exchange, expert dispatch): every member's send splits must match what
   its peers expect to receive (exchanged before the call, so every rank raises the same
   error): NCCL would hang or read past a buffer.

The step regions of rule 6 are the forward (``engine.forward`` and ``train_batch``'s), the
backward with the ZeRO gradient hooks, the gradient reduction, the pipeline executor's step
and the ZeRO optimizer step up to the inner optimizer.

Errors are :class:`NcclRuleError` and name the rule, the group's ranks and the fix.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["NcclRuleError", "enable", "disable", "enabled", "strict", "check_tensor", "check_collective",
           "check_sequence", "checked_batch_isend_irecv", "check_all_to_all", "no_host_sync", "host_sync_allowed",
           "HOST_SYNC_METHODS", "GUARDED_COLLECTIVES", "OBJECT_COLLECTIVES"]


class NcclRuleError(RuntimeError):
    """A collective or transfer that NCCL would reject, hang on or corrupt."""


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, getattr(torch, "float8_e4m3fn", torch.uint8),
           getattr(torch, "float8_e5m2", torch.uint8)]
_MAX_DIMS = 8
_HEADER_P2P = 0x5032
_SEQUENCE_CHECK = "sequence-check"
_HASH_MOD = (1 << 61) - 1
HOST_SYNC_METHODS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu",
                               "numpy"})
# torch.distributed functions wrapped while the mode is on (rule 7). isend/irecv stay as they
# are: P2POp accepts only those very functions (their tensors are checked in batch_isend_irecv).
GUARDED_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                       "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
                       "broadcast", "reduce", "gather", "scatter", "send", "recv", "batch_isend_irecv")
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list")


@dataclass
class _GroupLog:
    hash: int = 0
    count: int = 0
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=6))


@dataclass
class _State:
    device_type: str
    device_index: Optional[int] = None  # None: any device of the type (gloo: "cpu")
    logs: dict = field(default_factory=dict)  # group name -> _GroupLog
    checking: int = 0  # > 0 while the checker itself runs (its own .tolist() is not a violation)
    regions: list = field(default_factory=list)  # the step regions this rank is inside (rule 6)


_STATE: Optional[_State] = None
_ORIGINALS: dict[str, Callable[..., Any]] = {}  # name -> the torch.distributed function the guard wraps


def enable(device: Union[str, torch.device]) -> None:
    """Turn the strict mode on; ``device`` is the job's device (``"cpu"`` on gloo, the rank's
    ``cuda:i`` under NCCL: a tensor on another GPU is refused as NCCL would). Resets the
    sequence hashes and wraps ``torch.distributed``'s collectives (rule 7)."""
    global _STATE
    d = torch.device(device)
    _STATE = _State(device_type=d.type, device_index=d.index)
    _install_guards()


def disable() -> None:
    global _STATE
    _STATE = None
    _remove_guards()


def enabled() -> bool:
    return _STATE is not None


@contextlib.contextmanager
def strict(device_type: str) -> Iterator[None]:
    """Strict mode for the duration of a block (restores the previous state)."""
    global _STATE
    before = _STATE
    enable(device_type)
    try:
        yield
    finally:
        _STATE = before
        if before is None:
            _remove_guards()


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else 100 + zlib.crc32(str(dtype).encode()) % 1000


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]).replace("torch.", "") if 0 <= code < len(_DTYPES) else f"dtype#{code}"


def _ranks(group: dist.ProcessGroup) -> list[int]:
    return dist.get_process_group_ranks(group)


def _log(group: dist.ProcessGroup) -> _GroupLog:
    assert _STATE is not None
    g = group
    # keyed by name, never by the object: holding a ProcessGroup here would keep its gloo
    # threads alive past shutdown() (engine/distributed/teardown.py warns, and the interpreter can
    # abort at exit)
    return _STATE.logs.setdefault(str(getattr(g, "group_name", id(g))), _GroupLog())


def check_tensor(t: torch.Tensor, what: str) -> None:
    """Rules 1 and 2 for one tensor (local: no communication)."""
    if _STATE is None:
        return
    index = _STATE.device_index
    if t.device.type != _STATE.device_type or (index is not None and t.device.index != index):
        where = _STATE.device_type if index is None else f"{_STATE.device_type}:{index}"
        raise NcclRuleError(
            f"{what}: tensor is on {t.device} but this job communicates on {where} "
            f"(NCCL rejects tensors off the group's device): create it with device=<the engine's device>")
    if not t.is_contiguous():
        raise NcclRuleError(f"{what}: tensor of shape {tuple(t.shape)} is not contiguous (NCCL reads raw memory): "
                            f"pass t.contiguous()")


def _exchange(group: dist.ProcessGroup, row: list[int], device: torch.device) -> list[list[int]]:
    """All-gather one small int64 row from every member of ``group`` (the checker's own traffic)."""
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    return [r.tolist() for r in rows]


def check_collective(op: str, t: torch.Tensor, group: dist.ProcessGroup, extra: int = -1) -> None:
    """Rules 1-3 and 5 before collective ``op`` on ``t`` (the per-rank buffer whose size must
    agree: the input of all_reduce / all_gather / broadcast, the output of reduce_scatter).
    ``extra``: what else must agree (broadcast's source rank, the reduce op)."""
    if _STATE is None:
        return
    check_tensor(t, f"{op} on ranks {_ranks(group)}")
    _compare(op, group, t.device, _dtype_code(t.dtype), t.numel(), extra)


def check_sequence(groups: Sequence[dist.ProcessGroup], where: str, device: torch.device) -> None:
    """Rule 5 at a step boundary: every member of each group has issued the same sequence of
    collectives on it. Every rank must call it with the same groups in the same order."""
    if _STATE is None:
        return
    for g in groups:
        if dist.get_world_size(g) > 1:
            _compare(f"{_SEQUENCE_CHECK} ({where})", g, device, -1, 0, -1)


def _compare(op: str, group: dist.ProcessGroup, device: torch.device, dtype_code: int, numel: int,
             extra: int) -> None:
    assert _STATE is not None
    log = _log(group)
    op_code = zlib.crc32(op.split(" (")[0].encode())
    row = [op_code, dtype_code, numel, extra, log.hash, log.count]
    _STATE.checking += 1
    try:
        rows = _exchange(group, row, device)
    finally:
        _STATE.checking -= 1
    if any(r != rows[0] for r in rows):
        raise NcclRuleError(_mismatch_message(op, group, rows, log))
    desc = f"{op}:{_dtype_name(dtype_code)}:{numel}:{extra}"
    log.hash = (log.hash * 1_000_003 + zlib.crc32(desc.encode())) % _HASH_MOD
    log.count += 1
    log.recent.append(desc)


_OP_NAMES = {zlib.crc32(n.encode()): n for n in
             ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", _SEQUENCE_CHECK)}


def check_all_to_all(inp: torch.Tensor, out: torch.Tensor, in_splits: Sequence[int], out_splits: Sequence[int],
                     group: dist.ProcessGroup) -> None:
    """Rules 1-3, 5 and 8 before an all-to-all of rows (dim 0): tensors, dtype and row size
    agree (the header), and member s expects from member r exactly what r sends to s. The
    splits of every member are exchanged first, so every rank raises the same error."""
    if _STATE is None:
        return
    where = f"all_to_all on ranks {_ranks(group)}"
    check_tensor(inp, where + " input")
    check_tensor(out, where + " output")
    row = inp[0].numel() if inp.shape[0] else int(torch.Size(inp.shape[1:]).numel())
    _compare("all_to_all", group, inp.device, _dtype_code(inp.dtype), row, -1)
    world = dist.get_world_size(group)
    local_ok = int(len(in_splits) == len(out_splits) == world and sum(in_splits) == inp.shape[0]
                   and sum(out_splits) == out.shape[0])
    mine = (list(in_splits) + list(out_splits) + [0] * (2 * world))[:2 * world] + [local_ok]
    _STATE.checking += 1
    try:
        rows = _exchange(group, mine, inp.device)
    finally:
        _STATE.checking -= 1
    bad = [f"rank {_ranks(group)[r]}: splits do not add up to its tensors" for r in range(world) if not rows[r][-1]]
    bad += [f"rank {_ranks(group)[r]} sends {rows[r][s]} rows to rank {_ranks(group)[s]}, which expects "
            f"{rows[s][world + r]}" for r in range(world) for s in range(world) if rows[r][s] != rows[s][world + r]]
    if bad:
        raise NcclRuleError(f"NCCL rule violated at {where}: " + "; ".join(bad[:4])
                            + ". NCCL would hang or read past a buffer: exchange the counts first and size the "
                              "receive splits from them")


def _mismatch_message(op: str, group: dist.ProcessGroup, rows: list[list[int]], log: _GroupLog) -> str:
    ranks = _ranks(group)
    lines = []
    for r, (op_code, dt, numel, extra, h, count) in zip(ranks, rows):
        name = _OP_NAMES.get(op_code, f"op {op_code:#x}")
        lines.append(f"  rank {r}: call #{count} {name}, {_dtype_name(dt) if dt >= 0 else '-'}, numel {numel}, "
                     f"extra {extra}, sequence hash {h:#x}")
    if len({r[0] for r in rows}) > 1:
        what = ("the members are at different collectives (one rank issued a collective the others did not, "
                "or in another order)")
    elif len({r[4] for r in rows}) > 1 or len({r[5] for r in rows}) > 1:
        what = "the members issued different sequences of collectives before this point"
    else:
        what = "the members disagree on this collective (dtype, element count, reduce op or source)"
    return (f"NCCL rule violated at {op} on group ranks {ranks}: {what}. NCCL would hang or reduce garbage.\n"
            + "\n".join(lines)
            + f"\nthis rank's last collectives on the group: {list(log.recent)}"
            + "\nfix: every member must issue the same collectives, in the same order, with the same dtype and "
              "size (equal shards for all_gather/reduce_scatter)")


# ----------------------------------------------------------------------- point-to-point
def _p2p_header(t: torch.Tensor) -> list[int]:
    if t.dim() > _MAX_DIMS:
        raise NcclRuleError(f"p2p tensor has {t.dim()} dims; the strict header holds at most {_MAX_DIMS}")
    dims = list(t.shape) + [-1] * (_MAX_DIMS - t.dim())
    return [_HEADER_P2P, _dtype_code(t.dtype), t.dim(), *dims]


def _describe(h: list[int]) -> str:
    if h[0] != _HEADER_P2P:
        return f"no header (got {h[:3]}...: the peer did not post a matching transfer)"
    return f"{_dtype_name(h[1])} {tuple(h[3:3 + h[2]])}"


class _CheckedWork:
    """The works of one strict batch; ``wait()`` waits for all, then compares the headers."""

    def __init__(self, works: list, checks: list[tuple[torch.Tensor, list[int], int]]) -> None:
        self.works, self.checks = works, checks

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        for got, expected, peer in self.checks:
            g = got.tolist() if _STATE is None else _untracked_tolist(got)
            if g != expected:
                raise NcclRuleError(
                    f"p2p receive from rank {peer}: the sender sent {_describe(g)} but this rank's buffer is "
                    f"{_describe(expected)}. NCCL would corrupt silently or hang: make the stage boundary "
                    f"shapes and dtypes agree on both sides")
        self.works, self.checks = [], []
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _untracked_tolist(t: torch.Tensor) -> list:
    assert _STATE is not None
    _STATE.checking += 1
    try:
        return t.tolist()
    finally:
        _STATE.checking -= 1


def checked_batch_isend_irecv(ops: list[dist.P2POp]) -> list[Any]:
    """``dist.batch_isend_irecv(ops)`` with rule 4: each op is preceded, in the same batch, by
    a header transfer to/from the same peer (order-matched on both sides, like the data)."""
    # Each header goes right before its data op: the per-peer order of transfers then stays
    # the same on both sides however each side groups its transfers into batches.
    posted, checks = [], []
    for op in ops:
        check_tensor(op.tensor, f"p2p with rank {op.peer}")
        if op.op in (dist.isend, getattr(dist, "send", None)):
            head = torch.tensor(_p2p_header(op.tensor), dtype=torch.int64, device=op.tensor.device)
            posted.append(dist.P2POp(dist.isend, head, op.peer, op.group))
        else:
            buf = torch.full((3 + _MAX_DIMS,), -7, dtype=torch.int64, device=op.tensor.device)
            posted.append(dist.P2POp(dist.irecv, buf, op.peer, op.group))
            checks.append((buf, _p2p_header(op.tensor), op.peer))
        posted.append(op)
    works = dist.batch_isend_irecv(posted)
    return [_CheckedWork(list(works), checks)]


# ----------------------------------------------------------------------- host syncs
def _host_sync_error(what: str, where: str) -> NcclRuleError:
    return NcclRuleError(
        f"blocking host sync {what} inside {where}: on a GPU it stalls the host until the device queue "
        f"drains (no overlap of compute and communication). Keep the value on the device (torch.where, "
        f"in-place flags) and read it after the step")


class _NoHostSync(TorchFunctionMode):
    """Tensor methods that read values on the host (``tolist``, ``numpy`` never reach the
    dispatcher). Not active inside autograd's backward; :class:`_NoScalarRead` is."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_SYNC_METHODS and _STATE is not None and _STATE.checking == 0:
            raise _host_sync_error(f"Tensor.{name}()", self.where)
        return func(*args, **(kwargs or {}))


class _NoScalarRead(TorchDispatchMode):
    """``.item()``, ``float(t)``, ``int(t)``, ``bool(t)`` all end in
    ``aten._local_scalar_dense``; a dispatch mode also sees the ones in backward hooks
    (the ZeRO gradient hooks), where torch-function modes are not active."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "_local_scalar_dense" and _STATE is not None and _STATE.checking == 0:
            raise _host_sync_error("(a scalar read: .item(), float(t), int(t) or bool(t))", self.where)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_sync(where: str) -> Iterator[None]:
    """Rule 6 for a region (free when the strict mode is off); object collectives are
    refused inside it too (rule 7)."""
    state = _STATE
    if state is None:
        yield
        return
    state.regions.append(where)
    try:
        with _NoHostSync(where), _NoScalarRead(where):
            yield
    finally:
        state.regions.pop()


@contextlib.contextmanager
def host_sync_allowed() -> Iterator[None]:
    """Exempt from rule 6 a read that only happens on CPU tensors (a ``t.device.type == "cpu"``
    branch: input range checks that cost no device sync), or the one read a design needs and
    documents at the call (AutoTP's input broadcast: the source's shapes size the buffers)."""
    if _STATE is None:
        yield
        return
    _STATE.checking += 1
    try:
        yield
    finally:
        _STATE.checking -= 1


# ----------------------------------------------------------------------- direct torch.distributed calls
def _tensors_in(args: Sequence[Any], kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensors a torch.distributed call was given: tensors, lists of tensors, P2POps."""
    for a in list(args) + list(kwargs.values()):
        items = a if isinstance(a, (list, tuple)) else [a]
        for x in items:
            if isinstance(x, torch.Tensor):
                yield x
            elif isinstance(x, dist.P2POp):
                yield x.tensor


def _guard(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    objects = name in OBJECT_COLLECTIVES

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        state = _STATE
        if state is not None and state.checking == 0:
            if objects and state.regions:
                raise NcclRuleError(
                    f"torch.distributed.{name} inside {state.regions[-1]}: an object collective pickles, "
                    f"round-trips through the host and syncs the device on every call. Exchange tensors "
                    f"on the device (engine.distributed.comm) or move it out of the step")
            for t in _tensors_in(args, kwargs):
                check_tensor(t, f"torch.distributed.{name}")
        return fn(*args, **kwargs)

    guarded.__wrapped_by_strict__ = True  # type: ignore[attr-defined]
    return guarded


def _install_guards() -> None:
    for name in GUARDED_COLLECTIVES + OBJECT_COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "__wrapped_by_strict__", False):
            continue
        _ORIGINALS[name] = fn
        setattr(dist, name, _guard(name, fn))


def _remove_guards() -> None:
    for name, fn in list(_ORIGINALS.items()):
        if getattr(getattr(dist, name, None), "__wrapped_by_strict__", False):
            setattr(dist, name, fn)  # only our own wrapper: a later wrapper (a timer) stays
        del _ORIGINALS[name]
