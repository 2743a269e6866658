"""Consolidation: a sharded checkpoint -> one fp32 state dict and one safetensors file of
the model, streamed parameter by parameter (peak memory: a few copies of the largest
parameter, never the model).

Outputs in ``out_dir``:

- ``model.safetensors``: every parameter once, under the names of the single-process
  reference model (``layers.{i}.{name}``); a tied head is not repeated (safetensors stores
  no shared tensors) -- the header metadata ``tied`` maps each alias to its source, and
  ``safetensors.torch.load_model`` fills a tied model from it; the frozen parameters
  (``requires_grad=False``) the checkpoint holds follow the trained ones (``frozen=False``
  leaves them out);
- ``pytorch_model_fp32.pt``: a ``torch.load(weights_only=True)`` state dict with every
  name of the model's ``state_dict()`` (aliases share the storage of their source), so
  ``GPT.load_state_dict(..., strict=True)`` accepts it.

The torch file is written without holding the model: its skeleton (pickle and zip
records sized for every tensor) is produced by ``torch.save`` under
``torch.serialization.skip_data`` from fake tensors, then each tensor's bytes are written
in place as the parameter is assembled, and the zip CRC fields are patched so the file is
a valid zip archive.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import struct
import zipfile
import zlib
from typing import Any, Optional

import torch

from engine.checkpoint.format import (
    METADATA_FILE,
    CheckpointError,
    SafetensorsWriter,
    load_metadata,
    read_latest,
    resolve_checkpoint_dir,
)
from engine.checkpoint.reader import iter_frozen_params, iter_full_params

__all__ = ["consolidate", "resolve_checkpoint", "SAFETENSORS_FILE", "TORCH_FILE"]

logger = logging.getLogger(__name__)

SAFETENSORS_FILE = "model.safetensors"
TORCH_FILE = "pytorch_model_fp32.pt"


def resolve_checkpoint(path: str, tag: Optional[str] = None) -> str:
    """A checkpoint directory, given either itself or its save directory (with ``tag``, or
    the tag ``latest`` names)."""
    if tag is None and os.path.isfile(os.path.join(path, METADATA_FILE)):
        return path
    if tag is None:
        tag = read_latest(path)
        if tag is None:
            raise CheckpointError(f"{path} is neither a checkpoint (no {METADATA_FILE}) nor a save directory with a "
                                  f"'latest' file: pass the checkpoint directory or a tag")
    return resolve_checkpoint_dir(path, tag)


def consolidate(checkpoint: str, out_dir: str, *, tag: Optional[str] = None, verify: bool = True,
                write_torch: bool = True, write_safetensors: bool = True, frozen: bool = True) -> dict[str, str]:
    """Write the consolidated fp32 model of ``checkpoint`` into ``out_dir``; returns the paths.
    ``frozen``: with the frozen parameters the checkpoint holds (in fp32, after the trained ones)."""
    path = resolve_checkpoint(checkpoint, tag)
    meta = load_metadata(path)
    os.makedirs(out_dir, exist_ok=True)
    frozen_shapes = {n: tuple(r["shape"]) for n, r in meta.frozen.items()} if frozen else {}
    names = list(meta.params) + list(frozen_shapes)
    shapes = {**{n: meta.params[n].shape for n in meta.params}, **frozen_shapes}
    aliases = {a: s for a, s in meta.aliases.items() if s in shapes}
    out: dict[str, str] = {}
    st = tw = None
    try:
        if write_safetensors:
            out["safetensors"] = os.path.join(out_dir, SAFETENSORS_FILE)
            st = SafetensorsWriter(out["safetensors"] + ".tmp", [(n, torch.float32, shapes[n]) for n in names],
                                   metadata={"format": "pt", "tied": json.dumps(aliases),
                                             "source": os.path.abspath(path)})
        if write_torch:
            out["torch"] = os.path.join(out_dir, TORCH_FILE)
            tw = _TorchStreamWriter(out["torch"] + ".tmp", [(n, shapes[n]) for n in names], aliases)
        trained = ((name, full["master"]) for name, _, full in iter_full_params(path, ("master",), verify=verify))
        kept = iter_frozen_params(path, verify=verify) if frozen_shapes else iter(())
        for name, t in itertools.chain(trained, kept):  # the order of ``names``
            t = t.to(torch.float32)
            if st is not None:
                st.write(t)
            if tw is not None:
                tw.write(name, t)
        if st is not None:
            st.close()
            os.replace(out["safetensors"] + ".tmp", out["safetensors"])
        if tw is not None:
            tw.close()
            os.replace(out["torch"] + ".tmp", out["torch"])
    except BaseException:
        if st is not None:
            st.abort()
        for p in out.values():
            if os.path.exists(p + ".tmp"):
                os.remove(p + ".tmp")
        raise
    logger.info("consolidated %s (%d parameters) into %s", path, len(names), out_dir)
    return out


class _TorchStreamWriter:
    """A ``torch.save`` state dict written one tensor at a time (see the module docstring)."""

    def __init__(self, path: str, entries: list[tuple[str, tuple[int, ...]]], aliases: dict[str, str]) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.path = path
        with FakeTensorMode():
            fake = {n: torch.empty(shape, dtype=torch.float32) for n, shape in entries}
            skeleton = dict(fake)
            for alias, src in aliases.items():
                skeleton[alias] = fake[src]          # the same storage: one record, as torch.save shares it
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(skeleton, path)
        self._records = _storage_records(path, [n for n, _ in entries])
        self._f = open(path, "r+b")
        self._crc: dict[str, int] = {}

    def write(self, name: str, t: torch.Tensor) -> None:
        offset, nbytes, record = self._records[name]
        data = t.detach().contiguous().view(torch.uint8).numpy()
        if data.nbytes != nbytes:
            raise CheckpointError(f"{self.path}: {name} has {data.nbytes} bytes, its record holds {nbytes}")
        self._f.seek(offset)
        self._f.write(data.data)  # ndarray.data: the array's memoryview
        self._crc[record] = zlib.crc32(data.data)

    def close(self) -> None:
        missing = [n for n, (_, _, rec) in self._records.items() if rec not in self._crc]
        if missing:
            raise CheckpointError(f"{self.path}: tensors {missing[:5]} were never written")
        _patch_crcs(self._f, self.path, self._crc)
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


def _storage_records(path: str, names: list[str]) -> dict[str, tuple[int, int, str]]:
    """``{name: (data offset, bytes, record name)}`` of each tensor's storage record.

    Which record holds which tensor is read back rather than assumed: the skeleton is
    memory-mapped by ``torch.load(mmap=True)``, and records are laid out in increasing
    file offset, so ordering the tensors' storage addresses gives the record order.
    """
    loaded = torch.load(path, mmap=True, weights_only=True)
    ptrs = sorted({loaded[n].untyped_storage().data_ptr(): n for n in names}.items())
    with zipfile.ZipFile(path) as z:
        recs = sorted((i for i in z.infolist() if "/data/" in i.filename and not i.filename.endswith("/")
                       and i.filename.rsplit("/", 1)[-1].isdigit()), key=lambda i: i.header_offset)
        if len(recs) != len(ptrs):
            raise CheckpointError(f"{path}: {len(recs)} storage records for {len(ptrs)} tensors")
        out = {}
        with open(path, "rb") as f:
            for (_, name), info in zip(ptrs, recs):
                f.seek(info.header_offset)
                head = f.read(30)
                n_name, n_extra = struct.unpack("<HH", head[26:30])
                out[name] = (info.header_offset + 30 + n_name + n_extra, info.file_size, info.filename)
    del loaded
    return out


def _patch_crcs(f: Any, path: str, crcs: dict[str, int]) -> None:
    """Write each record's CRC-32 into its data descriptor and central-directory entry."""
    with zipfile.ZipFile(path) as z:
        infos = {i.filename: i for i in z.infolist()}
        cd_offset = z.start_dir
    for rec, crc in crcs.items():
        info = infos[rec]
        f.seek(info.header_offset + 6)
        flags = struct.unpack("<H", f.read(2))[0]
        f.seek(info.header_offset + 26)
        n_name, n_extra = struct.unpack("<HH", f.read(4))
        data_end = info.header_offset + 30 + n_name + n_extra + info.compress_size
        if flags & 0x8:  # a data descriptor follows the data (optionally signed)
            f.seek(data_end)
            sig = f.read(4)
            f.seek(data_end + (4 if sig == b"PK\x07\x08" else 0))
        else:
            f.seek(info.header_offset + 14)
        f.write(struct.pack("<I", crc))
    f.seek(cd_offset)
    while True:
        entry = f.tell()
        fixed = f.read(46)
        if len(fixed) < 46 or fixed[:4] != b"PK\x01\x02":
            break
        n_name, n_extra, n_comment = struct.unpack("<HHH", fixed[28:34])
        name = f.read(n_name).decode("utf-8")
        if name in crcs:
            f.seek(entry + 16)
            f.write(struct.pack("<I", crcs[name]))
        f.seek(entry + 46 + n_name + n_extra + n_comment)
