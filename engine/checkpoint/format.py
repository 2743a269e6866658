"""The on-disk format of a checkpoint, and the file-level helpers (no torch.distributed).

A checkpoint directory ``<save_dir>/<tag>/`` holds::

    metadata.json                          everything but the tensors (see below), sealed by a sha256
    shard_pp{P}_tp{T}_dp{D}.safetensors    one per rank that owns optimizer state: flat fp32 tensors
    client_state.pt                        optional: the caller's client_state (torch.save, loaded
                                           with weights_only=True)

and ``<save_dir>/latest`` names the newest complete tag (as in DeepSpeed).

The format is layout-independent at the parameter level. A shard file holds, for each
flat ZeRO group the rank owns, tensors ``g{group}.master`` (the fp32 master shard) and
``g{group}.{state}`` (each element-wise optimizer state, e.g. ``exp_avg``). The metadata's
``params`` table says, for every parameter of the unsharded model (named as in the single-
process reference ``GPT``: ``layers.{i}.{name}``), which *fragments* of it exist: a
fragment is ``numel`` elements at ``offset`` of group ``group`` in file ``file``, equal to
elements ``[start, start + numel)`` of the flattened TP-local tensor of shape
``local_shape``, which is the TP slice ``tp`` of the full tensor (see :class:`TPSlice`).
Loading into any layout maps those elements to full-tensor indices and back
(:mod:`engine.checkpoint.reshape`).

Every file is data (JSON, safetensors, or a weights-only torch file), and every file
carries a sha256 in the metadata.

``metadata.json`` is :class:`CheckpointMetadata` as JSON. Versions: 1 (the first format)
and 2 (adds ``fp8``: the FP8 scaling state by layer name; a version-1 checkpoint loads
with ``fp8 = None`` and FP8 layers keep their fresh state). Both are read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterable, Optional, Sequence

import torch

from engine.topology import Axis, Topology
from engine.training_state import decode_bytes, encode_bytes

__all__ = ["FORMAT", "FORMAT_VERSION", "READABLE_VERSIONS", "CheckpointMetadata", "SavedTopology", "OptimizerRecord",
           "ParamRecord", "FileRecord", "load_metadata", "METADATA_FILE", "LATEST_FILE", "CLIENT_STATE_FILE", "CheckpointError",
           "TPSlice", "Fragment", "shard_file_name", "tensor_key", "sha256_file", "fsync_dir", "seal_metadata",
           "write_metadata", "read_metadata", "read_latest", "write_latest", "tag_step", "check_tag",
           "resolve_checkpoint_dir", "SafetensorsWriter", "encode_bytes", "decode_bytes", "DTYPE_NAMES",
           "unpickling_error"]

logger = logging.getLogger(__name__)

FORMAT = "engine-checkpoint"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: no FP8 scaling state
METADATA_FILE = "metadata.json"
LATEST_FILE = "latest"
CLIENT_STATE_FILE = "client_state.pt"
TMP_PREFIX = ".tmp-"   # a save in progress (or one that crashed): never loaded
OLD_PREFIX = ".old-"   # a tag being overwritten, kept until its replacement is published

_TAG_STEP = re.compile(r"^global_step(\d+)$")

# safetensors dtype names
DTYPE_NAMES: dict[torch.dtype, str] = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                                       torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
                                       torch.uint8: "U8", torch.int8: "I8", torch.bool: "BOOL"}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file and what is wrong."""


# ---------------------------------------------------------------------------- layout records
@dataclass(frozen=True)
class TPSlice:
    """How a TP-local tensor is cut from the full one (the parameter's placement, see
    :mod:`engine.placement`): along ``dim``, rank ``rank`` of ``world`` holds
    ``[part0_r; part1_r; ...]`` of the full tensor padded along ``dim`` to
    ``local_size * world`` (``unpadded``: the true size, for a padded vocabulary; ``parts``:
    the full sizes of the parts of a fused weight such as q/k/v or gate/up)."""

    dim: int
    rank: int
    world: int
    parts: Optional[tuple[int, ...]] = None
    unpadded: Optional[int] = None

    def full_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = shape[self.dim] * self.world if self.unpadded is None else self.unpadded
        return tuple(shape)

    def to_json(self) -> list[Any]:
        return [self.dim, self.rank, self.world, list(self.parts) if self.parts else None, self.unpadded]

    @classmethod
    def from_json(cls, v: Optional[Sequence[Any]]) -> Optional["TPSlice"]:
        if v is None:
            return None
        dim, rank, world, parts, unpadded = v
        return cls(int(dim), int(rank), int(world), tuple(int(p) for p in parts) if parts else None,
                   None if unpadded is None else int(unpadded))


@dataclass(frozen=True)
class Fragment:
    """``numel`` elements at ``offset`` of group ``group``'s flat tensors in ``file``: elements
    ``[start, start + numel)`` of the flattened TP-local tensor (``local_shape``, slice ``tp``)."""

    file: str
    group: int
    offset: int
    numel: int
    start: int
    local_shape: tuple[int, ...]
    tp: Optional[TPSlice]

    def full_shape(self) -> tuple[int, ...]:
        return self.local_shape if self.tp is None else self.tp.full_shape(self.local_shape)

    def to_json(self) -> list[Any]:
        return [self.file, self.group, self.offset, self.numel, self.start, list(self.local_shape),
                None if self.tp is None else self.tp.to_json()]

    @classmethod
    def from_json(cls, v: Sequence[Any]) -> "Fragment":
        file, group, offset, numel, start, local_shape, tp = v
        return cls(str(file), int(group), int(offset), int(numel), int(start), tuple(int(s) for s in local_shape),
                   TPSlice.from_json(tp))


# ---------------------------------------------------------------------------- metadata
def _need(d: Any, key: str, where: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise CheckpointError(f"{where}: the metadata has no {key!r} entry: the file is not a complete checkpoint "
                              f"metadata (edited or written by another tool)")
    return d[key]


@dataclass(frozen=True)
class SavedTopology:
    """The layout a checkpoint was saved at."""

    dp: int
    tp: int
    pp: int
    world_size: int
    zero_stage: int
    virtual_stages: int = 1
    cp: int = 1  # absent in checkpoints written before context parallelism

    @classmethod
    def of(cls, topology: Topology, zero_stage: int, virtual_stages: int = 1) -> "SavedTopology":
        """The record of a run's topology (every mesh axis)."""
        sizes = {a.value: topology.size(a) for a in Axis}
        return cls(**sizes, world_size=topology.mesh.world_size, zero_stage=zero_stage,
                   virtual_stages=virtual_stages)

    def same_mesh(self, topology: Topology) -> bool:
        """Whether ``topology`` has this record's size on every mesh axis (rank r is the same rank)."""
        return all(getattr(self, a.value) == topology.size(a) for a in Axis)

    def describe(self) -> str:
        return " ".join(f"{a.value}={getattr(self, a.value)}" for a in Axis)

    def to_json(self) -> dict[str, int]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "world_size": self.world_size,
                "zero_stage": self.zero_stage, "virtual_stages": self.virtual_stages, "cp": self.cp}

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str) -> "SavedTopology":
        dp, tp, pp, world, zero = (int(_need(d, k, where)) for k in ("dp", "tp", "pp", "world_size", "zero_stage"))
        return cls(dp, tp, pp, world, zero, int(d.get("virtual_stages") or 1), int(d.get("cp") or 1))


@dataclass(frozen=True)
class FileRecord:
    """A file of the checkpoint: its sha256 and size, the rank that wrote it and (shard
    files) that rank's coordinates ``{"pp", "tp", "dp"}``."""

    sha256: str
    bytes: int
    rank: int
    coord: Optional[dict[str, int]] = None

    def to_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "bytes": self.bytes, "rank": self.rank, "coord": self.coord}

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str) -> "FileRecord":
        return cls(str(_need(d, "sha256", where)), int(_need(d, "bytes", where)), int(_need(d, "rank", where)),
                   d.get("coord"))


@dataclass(frozen=True)
class ParamRecord:
    """One parameter of the unsharded model: its full shape and the fragments that hold it."""

    shape: tuple[int, ...]
    fragments: tuple[Fragment, ...]

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "fragments": [f.to_json() for f in self.fragments]}

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str) -> "ParamRecord":
        return cls(tuple(int(x) for x in _need(d, "shape", where)),
                   tuple(Fragment.from_json(f) for f in _need(d, "fragments", where)))


@dataclass(frozen=True)
class OptimizerRecord:
    """The optimizer: its class, each user param group's hyper-parameters (by the group's
    index as a string), the element-wise states stored in the shard files (all, and per user
    param group when they differ: Muon), and each user param group's scalar states as
    ``{name: {"value": v, "dtype": torch dtype name or None for a Python number}}``."""

    cls: str
    param_groups: dict[str, dict[str, Any]]
    elementwise_state: list[str]
    scalar_state: dict[str, dict[str, dict[str, Any]]]
    elementwise_by_group: dict[str, list[str]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"class": self.cls, "param_groups": self.param_groups, "elementwise_state": self.elementwise_state,
                "scalar_state": self.scalar_state, "elementwise_by_group": self.elementwise_by_group}

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str) -> "OptimizerRecord":
        return cls(str(_need(d, "class", where)), dict(_need(d, "param_groups", where)),
                   list(_need(d, "elementwise_state", where)), dict(_need(d, "scalar_state", where)),
                   dict(d.get("elementwise_by_group") or {}))


@dataclass
class CheckpointMetadata:
    """Everything in a checkpoint but the tensors (``metadata.json``, see the module
    docstring). ``params``: in model order; ``aliases``: another name of a parameter ->
    its stored name; ``rng``: by global rank; ``training``: rank 0's training state
    (:class:`engine.training_state.TrainingState`: ``counters``, ``data_position``,
    ``lr_scheduler``, ``lr_scheduler_groups``, ``loss_scaler``), stored flat as before;
    ``fp8``: FP8 scaling state by layer name (version 2; None: no FP8 layers, or version 1);
    ``moe_bias``: the MoE layers' aux-free routing biases by name, each a list of floats by
    global expert index (None: no MoE layers, or written before they were saved);
    ``client_state``: the client-state file's name, if any; ``frozen``: the frozen parameters
    (``requires_grad=False``, outside the optimizer) by name: ``{"file", "key", "shape",
    "dtype"}`` of the whole tensor one replica wrote (DeepSpeed's ``frozen_param_*``), read by
    consolidation and zero_to_fp32 only (empty in checkpoints written before it existed)."""

    tag: str
    topology: SavedTopology
    config: dict[str, Any]
    training: dict[str, Any]
    optimizer: OptimizerRecord
    params: dict[str, ParamRecord]
    aliases: dict[str, str]
    files: dict[str, FileRecord]
    rng: dict[str, Any]
    fp8: Optional[dict[str, Any]] = None
    moe_bias: Optional[dict[str, list[float]]] = None
    client_state: Optional[str] = None
    frozen: dict[str, dict[str, Any]] = field(default_factory=dict)
    engine_version: str = ""
    torch_version: str = ""
    time: float = 0.0
    format_version: int = FORMAT_VERSION

    TRAINING_KEYS = ("counters", "data_position", "lr_scheduler", "lr_scheduler_groups", "loss_scaler")

    @property
    def global_steps(self) -> int:
        return int(self.training["counters"]["global_steps"])

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": FORMAT, "format_version": self.format_version, "engine_version": self.engine_version,
            "torch_version": self.torch_version, "tag": self.tag, "time": self.time,
            "topology": self.topology.to_json(), "config": self.config}
        out.update({k: self.training.get(k) for k in self.TRAINING_KEYS})
        out.update({"optimizer": self.optimizer.to_json(),
                    "params": {n: p.to_json() for n, p in self.params.items()}, "aliases": self.aliases,
                    "files": {n: f.to_json() for n, f in self.files.items()}, "rng": self.rng,
                    "client_state": self.client_state})
        if self.frozen:
            out["frozen"] = self.frozen
        if self.format_version >= 2:
            out["fp8"] = self.fp8
        if self.moe_bias is not None:
            out["moe_bias"] = self.moe_bias
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str = METADATA_FILE) -> "CheckpointMetadata":
        training = {k: d.get(k) for k in cls.TRAINING_KEYS}
        for k in ("counters", "loss_scaler"):
            _need(d, k, where)
        return cls(tag=str(_need(d, "tag", where)), topology=SavedTopology.from_json(_need(d, "topology", where), where),
                   config=dict(d.get("config") or {}), training=training,
                   optimizer=OptimizerRecord.from_json(_need(d, "optimizer", where), where),
                   params={n: ParamRecord.from_json(p, where) for n, p in _need(d, "params", where).items()},
                   aliases=dict(d.get("aliases") or {}),
                   files={n: FileRecord.from_json(f, where) for n, f in _need(d, "files", where).items()},
                   rng=dict(d.get("rng") or {}), fp8=d.get("fp8"), moe_bias=d.get("moe_bias"), client_state=d.get("client_state"),
                   frozen=dict(d.get("frozen") or {}),
                   engine_version=str(d.get("engine_version", "")), torch_version=str(d.get("torch_version", "")),
                   time=float(d.get("time", 0.0)), format_version=int(d["format_version"]))


def shard_file_name(pp: int, tp: int, dp: int) -> str:
    """The shard file of the rank at pipeline stage ``pp``, TP rank ``tp``, DP rank ``dp``."""
    return f"shard_pp{pp:03d}_tp{tp:03d}_dp{dp:04d}.safetensors"


def tensor_key(group: int, state: str) -> str:
    """Key of a group's flat tensor in a shard file (``state``: ``master`` or an optimizer state)."""
    return f"g{group}.{state}"




def unpickling_error(exc: BaseException) -> str:
    """The telling line of a ``torch.load(weights_only=True)`` refusal (torch's message is long)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for ln in lines:
        if "GLOBAL" in ln:
            return ln
    return lines[0] if lines else type(exc).__name__


# ---------------------------------------------------------------------------- files
def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def fsync_dir(path: str) -> None:
    """Make a rename/creation inside ``path`` durable (best effort where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (never half-written)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def _canonical(meta: dict[str, Any]) -> bytes:
    body = {k: v for k, v in meta.items() if k != "checksum"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")


def seal_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with ``checksum``: the sha256 of its canonical JSON (everything else)."""
    out = dict(meta)
    out["checksum"] = hashlib.sha256(_canonical(meta)).hexdigest()
    return out


def write_metadata(directory: str, meta: dict[str, Any]) -> None:
    text = json.dumps(seal_metadata(meta), separators=(",", ":")) + "\n"
    _write_text_atomic(os.path.join(directory, METADATA_FILE), text)


def read_metadata(directory: str) -> dict[str, Any]:
    """The metadata of the checkpoint in ``directory``, checked (format, version, checksum)."""
    path = os.path.join(directory, METADATA_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist: {directory} is not a complete checkpoint "
                              f"(a save that did not finish is never published)")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}): the metadata file is corrupted or "
                              f"truncated") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not the metadata of an {FORMAT} checkpoint (format field "
                              f"{meta.get('format') if isinstance(meta, dict) else None!r})")
    if meta.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{path}: format version {meta.get('format_version')!r} is not supported by this "
                              f"engine (it reads versions {list(READABLE_VERSIONS)})")
    want = meta.get("checksum")
    got = hashlib.sha256(_canonical(meta)).hexdigest()
    if want != got:
        raise CheckpointError(f"{path}: checksum mismatch (content sha256 {got}, recorded {want}): the metadata "
                              f"file was modified or corrupted")
    return meta


def load_metadata(directory: str) -> CheckpointMetadata:
    """:func:`read_metadata`, typed."""
    return CheckpointMetadata.from_json(read_metadata(directory), os.path.join(directory, METADATA_FILE))


# ---------------------------------------------------------------------------- tags
def check_tag(tag: Any) -> str:
    """A tag names a directory inside the save directory."""
    if not isinstance(tag, str) or not tag or tag in (".", "..") or "/" in tag or "\\" in tag \
            or tag.startswith(".") or tag == LATEST_FILE or "\n" in tag:
        raise ValueError(f"checkpoint tag {tag!r} is not usable as a directory name: use a non-empty name "
                         f"without path separators that does not start with '.' (e.g. 'global_step100')")
    return tag


def tag_step(tag: str) -> Optional[int]:
    """N for a tag ``global_stepN`` (DeepSpeed's naming), else None."""
    m = _TAG_STEP.match(tag)
    return int(m.group(1)) if m else None


def read_latest(save_dir: str) -> Optional[str]:
    """The tag ``<save_dir>/latest`` names, or None when there is no such file."""
    path = os.path.join(save_dir, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        tag = f.read().strip()
    try:
        return check_tag(tag)
    except ValueError:
        raise CheckpointError(f"{path} names {tag!r}, which is not a checkpoint tag: the file is corrupted") from None


def write_latest(save_dir: str, tag: str) -> None:
    _write_text_atomic(os.path.join(save_dir, LATEST_FILE), check_tag(tag) + "\n")


def resolve_checkpoint_dir(load_dir: str, tag: str) -> str:
    """``<load_dir>/<tag>``; if a crash interrupted the overwrite of that tag after the old
    directory was moved aside, the moved-aside copy (still complete) is used."""
    path = os.path.join(load_dir, tag)
    if os.path.isdir(path):
        return path
    prefix = f"{OLD_PREFIX}{tag}-"
    aside = sorted(d for d in (os.listdir(load_dir) if os.path.isdir(load_dir) else []) if d.startswith(prefix))
    for d in aside:
        cand = os.path.join(load_dir, d)
        if os.path.isfile(os.path.join(cand, METADATA_FILE)):
            logger.warning("checkpoint %s is missing (an overwrite was interrupted); using %s", path, cand)
            return cand
    tags = sorted(d for d in os.listdir(load_dir) if not d.startswith(".")) if os.path.isdir(load_dir) else []
    raise CheckpointError(f"checkpoint directory {path} does not exist (entries of {load_dir}: {tags})")


# ---------------------------------------------------------------------------- safetensors, streamed
class SafetensorsWriter:
    """Write a safetensors file tensor by tensor (memory: one tensor at a time), hashing as it goes.

    ``specs``: ``(key, dtype, shape)`` in file order; then :meth:`write` each tensor in that
    order. The header (8-byte little-endian length, JSON, space-padded to 8 bytes) comes
    first, then the raw little-endian bytes of each tensor, back to back, as the format
    specifies (https://github.com/huggingface/safetensors).
    """

    def __init__(self, path: str, specs: Iterable[tuple[str, torch.dtype, Sequence[int]]],
                 metadata: Optional[dict[str, str]] = None) -> None:
        self.path = path
        self._specs = [(k, d, tuple(int(s) for s in shape)) for k, d, shape in specs]
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        off = 0
        for key, dtype, shape in self._specs:
            if dtype not in DTYPE_NAMES:
                raise ValueError(f"safetensors cannot hold {dtype} ({key})")
            n = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            header[key] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self._sha = hashlib.sha256()
        self._f: Optional[BinaryIO] = open(path, "wb")
        self._next = 0
        self.bytes = 0
        self._emit(struct.pack("<Q", len(raw)) + raw)

    def _emit(self, b: Any) -> None:
        assert self._f is not None, f"{self.path}: written after close()"
        self._f.write(b)
        self._sha.update(b)
        self.bytes += len(b) if isinstance(b, (bytes, bytearray)) else memoryview(b).nbytes

    def write(self, tensor: torch.Tensor, chunk_numel: int = 1 << 24) -> None:
        key, dtype, shape = self._specs[self._next]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{self.path}: tensor {key} was declared {dtype} {list(shape)}, got "
                             f"{tensor.dtype} {list(tensor.shape)}")
        flat = tensor.detach().reshape(-1)
        for lo in range(0, flat.numel(), chunk_numel):   # bounded host copies for device tensors
            part = flat[lo:lo + chunk_numel].cpu().contiguous()
            self._emit(part.view(torch.uint8).numpy().data)  # ndarray.data: the array's memoryview
        self._next += 1

    def close(self) -> str:
        """Flush and fsync; returns the file's sha256."""
        if self._next != len(self._specs):
            raise ValueError(f"{self.path}: {len(self._specs) - self._next} declared tensors were not written")
        f = self._f
        assert f is not None, f"{self.path}: closed twice"
        f.flush()
        os.fsync(f.fileno())
        f.close()
        self._f = None
        return self._sha.hexdigest()

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
