"""``save_checkpoint(engine, save_dir, tag)``: every rank writes what it owns, atomically.

Protocol (collective over the default group; every rank calls it):

1. Every rank checks its master weights and optimizer state are finite (else nothing is
   written, on every rank: :mod:`engine.checkpoint.finite`); the ranks agree on the tag (a tag that differs across ranks is reported per
   ``checkpoint.tag_validation``: Fail raises, Warn logs; rank 0's tag is used) and on a
   nonce; rank 0 creates ``<save_dir>/.tmp-<tag>-<nonce>/`` with an ``.owner`` line (host,
   pid), removing leftovers of crashed saves: its own, those whose writer no longer runs,
   or all of them when this process holds the directory's lock (:mod:`engine.distributed.lock`);
   another live job's save in progress is never touched.
2. Each rank reads what it holds through ZeRO's shard view (pieces, ownership, master
   shards, element-wise and scalar optimizer state) and the engine's training state
   (:mod:`engine.checkpoint.target`); each rank that owns optimizer state writes its shard
   file (safetensors, hashed while written, fsynced) and sends rank 0 its fragment table,
   RNG states, FP8 scaling state and file digest.
3. Rank 0 writes ``metadata.json`` and the client state, checks every shard file is
   there with its recorded size, renames the directory to ``<save_dir>/<tag>`` (an
   existing tag is moved aside first and deleted after), then rewrites ``latest``
   (temporary file + rename) and prunes old ``global_step*`` tags (``keep_last``).
4. Rank 0 tells every rank the outcome; a failure anywhere is raised on every rank.

The steps are separate functions (:func:`begin_save`: 1; :func:`take_snapshot` and
:func:`write_shard`: 2; :func:`commit_save`: 3-4) so that :mod:`engine.checkpoint.async_save`
runs the write of step 2 in a background thread and 3-4 later, on the main thread; the
metadata is gathered at the call, the file records at the commit.

A crash or kill before the rename leaves only a ``.tmp-*`` directory that nothing reads;
after it, ``latest`` still names the previous tag until it is replaced in one rename.
So ``latest`` always names a complete checkpoint.
"""

from __future__ import annotations

import copy as copy_mod
import io
import logging
import os
import re
import shutil
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from engine.checkpoint.finite import check_finite_state
from engine.checkpoint.format import (
    CLIENT_STATE_FILE,
    FORMAT,
    LATEST_FILE,
    OLD_PREFIX,
    TMP_PREFIX,
    CheckpointError,
    CheckpointMetadata,
    FileRecord,
    Fragment,
    OptimizerRecord,
    ParamRecord,
    SafetensorsWriter,
    SavedTopology,
    check_tag,
    fsync_dir,
    read_latest,
    shard_file_name,
    tag_step,
    tensor_key,
    unpickling_error,
    write_latest,
    write_metadata,
)
from engine.checkpoint.layout import local_pieces, parameter_names, stage_chunks, tied_names
from engine.checkpoint.target import Checkpointable
from engine.config import Config
from engine.distributed.groups import ParallelGroups
from engine.distributed.lock import held_here, pid_running
from engine.topology import Axis, Role
from engine.training_state import capture_rng
from engine.version import __version__
from engine.zero.shard_view import Scalar, ShardView

__all__ = ["save_checkpoint", "capture_rng", "prune_tags", "agree_on_tag", "SavePlan", "begin_save", "take_snapshot",
           "write_shard", "commit_save", "snapshot_local", "client_state_bytes", "Tensors"]

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^layers\.(\d+)\.")


# ---------------------------------------------------------------------------- collectives
def _world() -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError("checkpoints are collective: torch.distributed must be initialised (the engine does it)")
    return dist.get_rank(), dist.get_world_size()


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree_on_tag(tag: str, policy: str, what: str) -> str:
    """All ranks' tags compared; returns rank 0's. ``policy``: Fail / Warn / Ignore."""
    rank, world = _world()
    tags: list[Any] = [None] * world
    dist.all_gather_object(tags, tag)
    if len(set(tags)) > 1:
        detail = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags) if t != tags[0])
        msg = (f"{what}: the checkpoint tag differs across ranks (rank 0: {tags[0]!r}; {detail}); every rank "
               f"must pass the same tag")
        if policy.lower() == "fail":
            raise CheckpointError(msg + " (checkpoint.tag_validation = Fail)")
        if policy.lower() == "warn" and rank == 0:
            logger.warning("%s; using rank 0's tag", msg)
    return tags[0]


# ---------------------------------------------------------------------------- local state
def _parallel_groups(engine: Checkpointable) -> ParallelGroups:
    if engine.groups is None:
        raise RuntimeError("the engine has no process groups (destroyed?): checkpoints need a built engine")
    return engine.groups


def _json_scalars(scalars: dict[str, Scalar]) -> dict[str, Any]:
    """Scalar optimizer state as JSON: ``{"value", "dtype"}`` (dtype None: a Python number)."""
    out: dict[str, Any] = {}
    for k, v in scalars.items():
        if isinstance(v, torch.Tensor):
            out[k] = {"value": v.item(), "dtype": str(v.dtype).replace("torch.", "")}
        else:
            out[k] = {"value": v, "dtype": None}
    return out


def _group_options(group: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in group.items():
        if isinstance(v, torch.Tensor):
            v = v.item()
        out[k] = list(v) if isinstance(v, tuple) else v
    return out


def _unsaved_tensors(module: torch.nn.Module, frozen_saved: bool) -> list[str]:
    """Module state outside the optimizer (persistent buffers; frozen parameters unless
    ``frozen_saved``): not in the checkpoint, which holds what the optimizer trains (and the
    FP8 scaling state, which the training state exports)."""
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    # the MoE layers' routing biases travel in the training state (engine.training_state)
    buffers = [k for k in module.state_dict(keep_vars=True) if k not in params and not k.endswith(".expert_bias")]
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad
              and (not frozen_saved or getattr(p, "ds_tensor", None) is not None)]  # zero.Init shards: not saved
    return sorted(buffers + frozen)


def _frozen_tensors(module: torch.nn.Module, names: dict[int, str], groups: ParallelGroups, fname: str
                    ) -> tuple[Tensors, dict[str, dict[str, Any]]]:
    """The frozen parameters (``requires_grad=False``: whole on every replica, outside ZeRO)
    written once, by the first rank of the grad role of each pipeline stage, into its shard
    file, for consolidation and zero_to_fp32 (DeepSpeed's checkpoints carry them too). Not
    under tensor parallelism (a frozen TP-sharded weight would need its TP pieces joined):
    there they stay unsaved, with the warning."""
    if groups.role(Role.GRAD).rank != 0 or groups.tp_size != 1:
        return [], {}
    tensors: Tensors = []
    records: dict[str, dict[str, Any]] = {}
    for p in module.parameters():
        if p.requires_grad or id(p) not in names or getattr(p, "ds_tensor", None) is not None:
            continue
        name = names[id(p)]
        key = f"frozen.{name}"
        tensors.append((key, p.detach()))
        records[name] = {"file": fname, "key": key, "shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", "")}
    return tensors, records


Tensors = list[tuple[str, torch.Tensor]]   # (safetensors key, tensor) in file order


def snapshot_local(engine: Checkpointable, view: ShardView) -> tuple[Tensors, dict[str, Any]]:
    """This rank's tensors to write (live views: copy them before training goes on) and the
    small description rank 0 needs for the metadata (``"file"`` is filled once written)."""
    groups = _parallel_groups(engine)
    unsaved = _unsaved_tensors(engine.module, frozen_saved=groups.tp_size == 1)
    if unsaved:
        logger.warning("rank %d: module state outside the optimizer is not saved (buffers or frozen parameters "
                       "are rebuilt from the config on load): %s", groups.rank, unsaved[:8])
    names, aliases = parameter_names(engine.module)
    originals, copies = tied_names(view, names)
    pieces = local_pieces(view, names)
    coord = groups.coord
    # the file's data index is the rank's place in the grad role (dp, or cp x dp under context
    # parallelism, whose ranks each own a ZeRO shard): equal to the dp rank without CP
    fname = shard_file_name(coord.pp, coord.tp, groups.role(Role.GRAD).rank)
    tensors, frozen = _frozen_tensors(engine.module, names, groups, fname)
    scalar_state: dict[str, dict[str, Any]] = {}
    param_groups: dict[str, dict[str, Any]] = {}
    elementwise_keys: list[str] = []
    by_group: dict[str, list[str]] = {}  # user param group -> its element-wise states (Muon: they differ)
    owned = set()
    for gi, g in enumerate(view.groups):
        pg = str(g.param_group)
        st = view.group_state(gi)
        param_groups.setdefault(pg, _group_options(st.options))
        if st.scalars:
            scalar_state.setdefault(pg, _json_scalars(st.scalars))
        if st.elementwise:
            by_group.setdefault(pg, list(st.elementwise))
        if not g.owner:
            continue
        owned.add(gi)
        tensors.append((tensor_key(gi, "master"), st.master))
        for k, v in st.elementwise.items():
            tensors.append((tensor_key(gi, k), v))
            if k not in elementwise_keys:
                elementwise_keys.append(k)
    order = {name: i for i, name in enumerate(names.values())}   # model order, not flat-group order
    fragments: dict[str, list[Fragment]] = {}
    shapes: dict[str, list[int]] = {}
    for pc in sorted(pieces, key=lambda pc: order[pc.name]):
        if pc.group not in owned:
            continue
        frag = Fragment(fname, pc.group, pc.offset, pc.numel, pc.start, pc.local_shape, pc.tp)
        fragments.setdefault(pc.name, []).append(frag)
        shapes[pc.name] = list(frag.full_shape())
    part = {"rank": groups.rank, "file": None, "file_name": fname, "coord": {a.value: getattr(coord, a.value) for a in Axis},
            "fragments": fragments, "shapes": shapes, "aliases": aliases,
            "tied_originals": originals, "tied_copies": copies, "scalar_state": scalar_state,
            "param_groups": param_groups, "elementwise_keys": elementwise_keys, "elementwise_by_group": by_group,
            "order": {name: order[name] for name in fragments}, "optimizer_class": view.optimizer_class,
            "frozen": frozen}
    return tensors, part


def write_shard(tmp_dir: str, part: dict[str, Any], tensors: Tensors) -> Optional[tuple[str, FileRecord]]:
    """Write this rank's shard file (hashed while written, fsynced); None when it owns
    nothing. No collectives: the asynchronous writer thread runs it."""
    if not tensors:
        return None
    fname = part["file_name"]
    writer = SafetensorsWriter(os.path.join(tmp_dir, fname), [(k, t.dtype, t.shape) for k, t in tensors],
                               metadata={"format": FORMAT, "rank": str(part["rank"])})
    try:
        for _, t in tensors:
            writer.write(t)
        digest = writer.close()
    except BaseException:
        writer.abort()
        raise
    return fname, FileRecord(digest, writer.bytes, part["rank"], dict(part["coord"]))


# ---------------------------------------------------------------------------- metadata (rank 0)
def _json_state(obj: Any, what: str) -> Any:
    import json

    try:
        json.dumps(obj)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"the {what} state cannot be stored as JSON ({exc})") from None
    return obj


def _layer_index(name: str) -> int:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else -1


def _merge(cfg: Config, training: dict[str, Any], tag: str, parts: list[dict[str, Any]]) -> CheckpointMetadata:
    """The metadata from every rank's part (rank order) and rank 0's training state."""
    params: dict[str, dict[str, Any]] = {}
    aliases: dict[str, str] = {}
    originals: dict[int, str] = {}
    files: dict[str, FileRecord] = {}
    elementwise: list[str] = []
    by_group: dict[str, list[str]] = {}
    scalar_state: dict[str, Any] = {}
    param_groups: dict[str, Any] = {}
    fp8: dict[str, Any] = {}
    moe_bias: dict[str, Any] = {}
    frozen: dict[str, dict[str, Any]] = {}
    for part in parts:  # rank order: pipeline stage 0 first, so names come in model order
        for name, frags in part["fragments"].items():
            entry = params.setdefault(name, {"shape": part["shapes"][name], "fragments": []})
            entry["fragments"].extend(frags)
        aliases.update(part["aliases"])
        originals.update({int(k): v for k, v in part["tied_originals"].items()})
        if part["file"] is not None:
            files[part["file"][0]] = part["file"][1]
        elementwise += [k for k in part["elementwise_keys"] if k not in elementwise]
        for pg, sc in part["scalar_state"].items():
            scalar_state.setdefault(pg, sc)
        for pg, keys in part["elementwise_by_group"].items():
            by_group.setdefault(pg, keys)
        for pg, opts in part["param_groups"].items():
            param_groups.setdefault(pg, opts)
        for name, st in (part["fp8"] or {}).items():  # TP and DP replicas hold the same (MAX-reduced) state
            fp8.setdefault(name, st)
        for name, b in (part.get("moe_bias") or {}).items():  # identical on every rank holding the layer
            moe_bias.setdefault(name, b)
        for name, rec in part.get("frozen", {}).items():  # one writer per pipeline stage
            frozen.setdefault(name, rec)
    # model order: by layer, then as the module lists them (any rank holding a layer agrees on that)
    position: dict[str, int] = {}
    for part in parts:
        for name, pos in part["order"].items():
            position.setdefault(name, pos)
    params = dict(sorted(params.items(), key=lambda kv: (_layer_index(kv[0]), position[kv[0]])))
    for part in parts:
        for copy_name, idx in part["tied_copies"].items():
            if int(idx) not in originals:
                raise CheckpointError(f"tied parameter {copy_name} has no original on any pipeline stage")
            aliases[copy_name] = originals[int(idx)]
    _json_state(training["lr_scheduler"], "LR scheduler")
    _json_state(training["loss_scaler"], "loss scaler")
    # per-group lists in the scheduler state follow rank 0's inner groups: their user param groups
    return CheckpointMetadata(
        tag=tag, engine_version=__version__, torch_version=torch.__version__, time=time.time(),
        topology=SavedTopology.of(cfg.topology, cfg.zero.stage, cfg.pipeline.virtual_stages),
        config=cfg.to_dict(), training={k: training[k] for k in CheckpointMetadata.TRAINING_KEYS},
        optimizer=OptimizerRecord(parts[0]["optimizer_class"], param_groups, elementwise, scalar_state, by_group),
        params={n: ParamRecord(tuple(e["shape"]), tuple(e["fragments"])) for n, e in params.items()},
        aliases=aliases, files=files, rng={str(p["rank"]): p["rng"] for p in parts}, fp8=fp8 or None,
        moe_bias=moe_bias or None, frozen=frozen)


def client_state_bytes(client_state: dict[str, Any]) -> bytes:
    """torch.save of the client state, refused unless it loads back with weights_only=True
    (checkpoints are data: a class instance in it would need code to load)."""
    buf = io.BytesIO()
    torch.save(client_state, buf)
    try:
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises UnpicklingError / RuntimeError variants
        raise CheckpointError("client_state must hold only tensors and plain Python values (dict, list, tuple, "
                              f"str, int, float, bool, None) so that it loads with torch.load(weights_only=True), "
                              f"without running code: {unpickling_error(exc)}") from None
    return buf.getvalue()


def _write_client_state(tmp_dir: str, data: bytes) -> FileRecord:
    path = os.path.join(tmp_dir, CLIENT_STATE_FILE)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    import hashlib

    return FileRecord(hashlib.sha256(data).hexdigest(), len(data), 0, None)


# ---------------------------------------------------------------------------- publish (rank 0)
def _check_files(tmp_dir: str, files: dict[str, FileRecord]) -> None:
    for name, info in files.items():
        path = os.path.join(tmp_dir, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} was not written (rank {info.rank}): the checkpoint is incomplete")
        size = os.path.getsize(path)
        if size != info.bytes:
            raise CheckpointError(f"{path} has {size} bytes, rank {info.rank} wrote {info.bytes}")


def _publish(save_dir: str, tmp_dir: str, tag: str, nonce: str, update_latest: bool) -> str:
    """Rename the finished directory to its tag (moving an existing one aside first), then
    point ``latest`` at it."""
    final = os.path.join(save_dir, tag)
    old = None
    if os.path.exists(final):
        old = os.path.join(save_dir, f"{OLD_PREFIX}{tag}-{nonce}")
        os.rename(final, old)
    os.rename(tmp_dir, final)
    fsync_dir(save_dir)
    if update_latest:
        write_latest(save_dir, tag)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def prune_tags(save_dir: str, keep_last: int, keep: str) -> list[str]:
    """Delete all but the newest ``keep_last`` ``global_stepN`` tags (by N), never ``keep``
    nor the tag ``latest`` names. Returns the deleted tags."""
    latest = read_latest(save_dir)
    tags = sorted((t for t in os.listdir(save_dir) if tag_step(t) is not None
                   and os.path.isdir(os.path.join(save_dir, t))), key=lambda t: tag_step(t) or 0)  # never None here
    doomed = [t for t in tags[:max(0, len(tags) - keep_last)] if t not in (keep, latest)]
    for t in doomed:
        shutil.rmtree(os.path.join(save_dir, t), ignore_errors=True)
    return doomed


OWNER_FILE = ".owner"   # in a .tmp-* directory: "<host> <pid>" of the rank 0 that is writing it


def _write_owner(tmp_dir: str) -> None:
    with open(os.path.join(tmp_dir, OWNER_FILE), "w", encoding="utf-8") as f:
        f.write(f"{socket.gethostname()} {os.getpid()}\n")


def _leftover_is_stale(path: str, locked: bool) -> bool:
    """A ``.tmp-*`` save directory may be removed: this process wrote it, its writer is a
    process of this host that no longer runs, or this process holds the directory's lock
    (then no other live job saves here). Another live job's save in progress is kept."""
    if locked:
        return True
    try:
        with open(os.path.join(path, OWNER_FILE), encoding="utf-8") as f:
            host, pid = f.read().split()[:2]
    except (OSError, ValueError):
        return False  # no owner line (yet): possibly another job's save that just started
    if host != socket.gethostname():
        return False
    return int(pid) == os.getpid() or not pid_running(int(pid))


def _clean_leftovers(save_dir: str) -> None:
    """Remove directories of saves that crashed (``.tmp-*`` whose writer is gone, see
    :func:`_leftover_is_stale`), temporary ``latest`` files of an interrupted update and
    moved-aside tags whose replacement was published (``.old-<tag>-*`` when ``<tag>``
    exists); without the directory's lock, only this process's own or known-dead ones."""
    locked = held_here(save_dir)
    for d in os.listdir(save_dir):
        path = os.path.join(save_dir, d)
        if d.startswith(f"{LATEST_FILE}.tmp-") and os.path.isfile(path):
            pid = d[len(LATEST_FILE) + 5:]  # written as latest.tmp-<pid> by the writer of latest
            if locked or (pid.isdigit() and (int(pid) == os.getpid() or not pid_running(int(pid)))):
                os.remove(path)
        elif d.startswith(TMP_PREFIX) and os.path.isdir(path):
            if _leftover_is_stale(path, locked):
                shutil.rmtree(path, ignore_errors=True)
        elif d.startswith(OLD_PREFIX) and os.path.isdir(path):
            tag = d[len(OLD_PREFIX):].rsplit("-", 1)[0]
            if os.path.isdir(os.path.join(save_dir, tag)):
                shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------- entry point
@dataclass
class SavePlan:
    """One save between its start (:func:`begin_save`) and its commit (:func:`commit_save`).
    ``training``, ``parts`` and ``client_bytes`` are rank 0's (None elsewhere): what it
    needs for the metadata, fixed at the call."""

    tag: str
    nonce: str
    save_dir: str
    tmp_dir: str
    keep_last: Optional[int]
    save_latest: bool
    started: float = field(default_factory=time.perf_counter)
    training: Optional[dict[str, Any]] = None
    parts: Optional[list[Any]] = None
    client_bytes: Optional[bytes] = None

    @property
    def path(self) -> str:
        return os.path.join(self.save_dir, self.tag)


def begin_save(engine: Checkpointable, save_dir: str, tag: Optional[str], client_state: Optional[dict[str, Any]],
               keep_last: Optional[int], save_latest: bool) -> SavePlan:
    """Steps 1 of the protocol (collective): refuse a non-finite state
    (:func:`~engine.checkpoint.finite.check_finite_state`), agree on the tag and a nonce,
    make the temporary directory."""
    rank, _ = _world()
    if stage_chunks(engine.module) is None and engine.config.pp > 1:
        raise CheckpointError("pipeline engines must hold StageChunks to be checkpointed")
    check_finite_state(engine)  # nothing is written for a diverged state: 'latest' keeps the last good one
    tag = check_tag(f"global_step{engine.global_steps}" if tag is None else tag)
    if client_state is not None and not isinstance(client_state, dict):
        raise TypeError(f"client_state must be a dict, got {type(client_state).__name__}")
    tag = agree_on_tag(tag, engine.config.checkpoint.tag_validation, "save_checkpoint")
    keep_last = engine.config.checkpoint.keep_last if keep_last is None else keep_last
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (or None to keep every checkpoint), got {keep_last}")
    nonce = _broadcast(uuid.uuid4().hex[:12] if rank == 0 else None)
    save_dir = os.path.abspath(save_dir)
    tmp_dir = os.path.join(save_dir, f"{TMP_PREFIX}{tag}-{nonce}")
    err = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            _clean_leftovers(save_dir)
            os.makedirs(tmp_dir)
            _write_owner(tmp_dir)
        except OSError as exc:
            err = f"cannot create {tmp_dir}: {exc}"
    err = _broadcast(err)
    if err is not None:
        raise CheckpointError(err)
    return SavePlan(tag, nonce, save_dir, tmp_dir, keep_last, save_latest)


def take_snapshot(engine: Checkpointable, plan: SavePlan, client_state: Optional[dict[str, Any]],
                  copy: Callable[[Tensors], Tensors]) -> tuple[Tensors, Any]:
    """Step 2's reading half (collective: one gather of the small descriptions to rank 0):
    this rank's tensors passed through ``copy`` (the asynchronous save copies them into its
    host buffers; identity for a synchronous one) and its part, or an error line."""
    rank, world = _world()
    tensors: Tensors = []
    training: dict[str, Any] = {}
    local: Any = None  # this rank's part, or its error line
    try:
        training = copy_mod.deepcopy(engine.training_state().state_dict())
        tensors, local = snapshot_local(engine, engine.optimizer.shard_view())
        tensors = copy(tensors)
        # FP8 scaling state is MAX-reduced over the amax role: one rank of it per stage sends it
        speaks = _parallel_groups(engine).speaks_for(Role.AMAX)
        local.update(rng=training["rng"], fp8=training["fp8"] if speaks else None,
                     moe_bias=training["moe_bias"] if speaks else None)
        if rank == 0 and client_state is not None:
            plan.client_bytes = client_state_bytes(client_state)
        local = copy_mod.deepcopy(local)  # rank 0's part is not pickled by the gather
    except Exception as exc:  # noqa: BLE001 - reported to every rank at the commit
        local = f"rank {rank}: {type(exc).__name__}: {exc}"
    parts: Optional[list[Any]] = [None] * world if rank == 0 else None
    dist.gather_object(local, parts, dst=0)
    if rank == 0:
        plan.training, plan.parts = training, parts
    return tensors, local


def commit_save(cfg: Config, plan: SavePlan, written: Any) -> str:
    """Steps 3-4 (collective): every rank sends rank 0 what its write gave (the file record,
    None, or an error line); rank 0 writes the metadata, publishes and prunes; the outcome
    is raised on every rank. Runs on the main thread only (it uses collectives)."""
    rank, world = _world()
    got: Optional[list[Any]] = [None] * world if rank == 0 else None
    dist.gather_object(written, got, dst=0)
    status = None
    if rank == 0:
        assert got is not None and plan.parts is not None and plan.training is not None  # rank 0 holds them
        parts = [p if isinstance(p, str) else (w if isinstance(w, str) else {**p, "file": w})
                 for p, w in zip(plan.parts, got)]
        status = _finish(cfg, plan.training, plan, parts)
    status = _broadcast(status)
    if status["error"] is not None:
        raise CheckpointError(f"save_checkpoint({plan.tag!r}) failed, nothing was published: {status['error']}")
    return status["path"]


def save_checkpoint(engine: Checkpointable, save_dir: str, tag: Optional[str] = None,
                    client_state: Optional[dict[str, Any]] = None, *, keep_last: Optional[int] = None,
                    save_latest: bool = True) -> str:
    """Save ``engine`` (model shards, fp32 master weights, optimizer state, LR schedule, loss
    scaler, counters, RNG states) under ``<save_dir>/<tag>`` and point ``latest`` at it.
    Synchronous: returns once published (the asynchronous form is
    :class:`engine.checkpoint.async_save.AsyncSaver`).

    Collective: every rank calls it with the same arguments. ``tag`` defaults to
    ``global_step{engine.global_steps}``; ``client_state``: a dict of tensors and plain
    values, returned by :func:`~engine.checkpoint.load_checkpoint` (rank 0's is stored);
    ``keep_last``: keep only the newest N ``global_step*`` tags (default:
    ``checkpoint.keep_last`` of the config; None keeps all). Returns the checkpoint path.
    """
    plan = begin_save(engine, save_dir, tag, client_state, keep_last, save_latest)
    tensors, local = take_snapshot(engine, plan, client_state, lambda ts: ts)  # written before training goes on
    written: Any = local if isinstance(local, str) else None
    if written is None:
        try:
            written = write_shard(plan.tmp_dir, local, tensors)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by the commit
            written = f"rank {local['rank']}: {type(exc).__name__}: {exc}"
    path = commit_save(engine.config, plan, written)
    logger.info("saved checkpoint %s in %.2fs", path, time.perf_counter() - plan.started)
    return path


def _finish(cfg: Config, training: dict[str, Any], plan: SavePlan, parts: list[Any]) -> dict[str, Any]:
    """Rank 0: metadata, checks, publish, prune. Returns ``{"path", "error"}``."""
    tag, tmp_dir = plan.tag, plan.tmp_dir
    failed = [p for p in parts if isinstance(p, str)]
    try:
        if failed:
            raise CheckpointError("; ".join(failed))
        meta = _merge(cfg, training, tag, parts)
        if plan.client_bytes is not None:
            meta.files[CLIENT_STATE_FILE] = _write_client_state(tmp_dir, plan.client_bytes)
            meta.client_state = CLIENT_STATE_FILE
        _check_files(tmp_dir, meta.files)
        write_metadata(tmp_dir, meta.to_json())
        os.remove(os.path.join(tmp_dir, OWNER_FILE))
        fsync_dir(tmp_dir)
        path = _publish(plan.save_dir, tmp_dir, tag, plan.nonce, plan.save_latest)
        if plan.keep_last is not None:
            deleted = prune_tags(plan.save_dir, plan.keep_last, tag)
            if deleted:
                logger.info("removed old checkpoints %s (keep_last=%d)", deleted, plan.keep_last)
        return {"path": path, "error": None}
    except Exception as exc:  # noqa: BLE001 - every rank raises it
        shutil.rmtree(tmp_dir, ignore_errors=True)
        return {"path": None, "error": f"{type(exc).__name__}: {exc}" if not isinstance(exc, CheckpointError)
                else str(exc)}
