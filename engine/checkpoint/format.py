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
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterable, Optional, Sequence

import torch

__all__ = ["FORMAT", "FORMAT_VERSION", "METADATA_FILE", "LATEST_FILE", "CLIENT_STATE_FILE", "CheckpointError",
           "TPSlice", "Fragment", "shard_file_name", "tensor_key", "sha256_file", "fsync_dir", "seal_metadata",
           "write_metadata", "read_metadata", "read_latest", "write_latest", "tag_step", "check_tag",
           "resolve_checkpoint_dir", "SafetensorsWriter", "encode_bytes", "decode_bytes", "DTYPE_NAMES",
           "unpickling_error"]

logger = logging.getLogger(__name__)

FORMAT = "engine-checkpoint"
FORMAT_VERSION = 1
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
    """How a TP-local tensor is cut from the full one (the layers' tags, see
    :mod:`engine.tensor_parallel.layers`): along ``dim``, rank ``rank`` of ``world`` holds
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


def shard_file_name(pp: int, tp: int, dp: int) -> str:
    """The shard file of the rank at pipeline stage ``pp``, TP rank ``tp``, DP rank ``dp``."""
    return f"shard_pp{pp:03d}_tp{tp:03d}_dp{dp:04d}.safetensors"


def tensor_key(group: int, state: str) -> str:
    """Key of a group's flat tensor in a shard file (``state``: ``master`` or an optimizer state)."""
    return f"g{group}.{state}"


def encode_bytes(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def decode_bytes(s: str) -> bytes:
    return base64.b64decode(s.encode("ascii"))


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
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {meta.get('format_version')!r} is not supported by this "
                              f"engine (it reads version {FORMAT_VERSION})")
    want = meta.get("checksum")
    got = hashlib.sha256(_canonical(meta)).hexdigest()
    if want != got:
        raise CheckpointError(f"{path}: checksum mismatch (content sha256 {got}, recorded {want}): the metadata "
                              f"file was modified or corrupted")
    return meta


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
            self._emit(memoryview(part.view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> str:
        """Flush and fsync; returns the file's sha256."""
        if self._next != len(self._specs):
            raise ValueError(f"{self.path}: {len(self._specs) - self._next} declared tensors were not written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
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
