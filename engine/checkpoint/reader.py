"""Reading a saved checkpoint without an engine: shard files checked before use
(:class:`ShardReader`) and whole parameters streamed one at a time
(:func:`iter_full_params`, what consolidation and the tests use)."""

from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

import torch

from engine.checkpoint.format import (
    CheckpointError,
    CheckpointMetadata,
    Fragment,
    load_metadata,
    sha256_file,
    tensor_key,
)
from engine.checkpoint.reshape import assemble_full

__all__ = ["ShardReader", "iter_full_params", "iter_frozen_params"]


class ShardReader:
    """Reads fragments from a checkpoint's shard files; each file is checked (present,
    recorded size, sha256 unless ``verify=False``) the first time it is opened."""

    def __init__(self, path: str, meta: CheckpointMetadata, verify: bool = True) -> None:
        self.path, self.meta, self.verify = path, meta, verify
        self._open: dict[str, Any] = {}

    def check_file(self, name: str) -> str:
        info = self.meta.files.get(name)
        full = os.path.join(self.path, name)
        if info is None:
            raise CheckpointError(f"{full} is referenced but not listed in {self.path}/metadata.json: the metadata "
                                  f"is inconsistent")
        if not os.path.isfile(full):
            raise CheckpointError(f"{full} is missing (written by rank {info.rank}): the checkpoint is incomplete")
        size = os.path.getsize(full)
        if size != info.bytes:
            raise CheckpointError(f"{full} has {size} bytes but {info.bytes} were written: the file is truncated "
                                  f"or was replaced")
        if self.verify:
            digest = sha256_file(full)
            if digest != info.sha256:
                raise CheckpointError(f"{full}: checksum mismatch (sha256 {digest}, metadata records "
                                      f"{info.sha256}): the file is corrupted")
        return full

    def _handle(self, name: str) -> Any:
        if name not in self._open:
            from safetensors import safe_open

            full = self.check_file(name)
            try:
                self._open[name] = safe_open(full, framework="pt", device="cpu")
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
                raise CheckpointError(f"{full} is not a readable safetensors file ({exc})") from None
        return self._open[name]

    def has(self, frag: Fragment, state: str) -> bool:
        """Whether the fragment's file stores ``state`` for the fragment's group."""
        return tensor_key(frag.group, state) in self._handle(frag.file).keys()

    def read(self, frag: Fragment, state: str) -> torch.Tensor:
        """The fragment's ``(numel,)`` values of ``state`` (``master`` or an optimizer state)."""
        h = self._handle(frag.file)
        key = tensor_key(frag.group, state)
        try:
            sl = h.get_slice(key)
        except Exception:  # noqa: BLE001
            raise CheckpointError(f"{os.path.join(self.path, frag.file)} has no tensor {key!r} (the metadata lists a "
                                  f"fragment there)") from None
        return sl[frag.offset:frag.offset + frag.numel]

    def read_whole(self, file: str, key: str) -> torch.Tensor:
        """The tensor ``key`` of shard file ``file`` (a frozen parameter)."""
        h = self._handle(file)
        if key not in h.keys():
            raise CheckpointError(f"{os.path.join(self.path, file)} has no tensor {key!r} (the metadata lists a "
                                  f"frozen parameter there)")
        return h.get_tensor(key)

    def close(self) -> None:
        self._open.clear()


def iter_full_params(path: str, states: Sequence[str] = ("master",), verify: bool = True
                     ) -> Iterator[tuple[str, tuple[int, ...], dict[str, torch.Tensor]]]:
    """``(name, full shape, {state: full tensor})`` for every parameter of the checkpoint in
    ``path`` (model order), one at a time: memory is bounded by the largest parameter.
    An optimizer state that a parameter's group does not have (Muon: matrices have a
    ``momentum_buffer``, the AdamW parameters ``exp_avg`` / ``exp_avg_sq``) is left out of
    that parameter's dict."""
    meta = load_metadata(path)
    missing = [s for s in states if s != "master" and s not in meta.optimizer.elementwise_state]
    if missing:
        raise CheckpointError(f"{path}: the checkpoint has no optimizer state {missing} (it has "
                              f"{meta.optimizer.elementwise_state})")
    reader = ShardReader(path, meta, verify)
    try:
        for name, entry in meta.params.items():
            shape = entry.shape
            frags = entry.fragments
            mine = list(states)
            if meta.optimizer.elementwise_by_group:
                mine = [s for s in states if s == "master" or all(reader.has(f, s) for f in frags)]
            full = assemble_full(name, shape, frags, mine, reader.read, None, f"{path}: ")
            yield name, shape, {s: t.view(shape) for s, t in full.items()}
    finally:
        reader.close()


def iter_frozen_params(path: str, verify: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, whole tensor)`` for every frozen parameter the checkpoint in ``path`` holds
    (``requires_grad=False``, in its saved dtype), one at a time; none in checkpoints saved
    before frozen parameters were written (see :class:`CheckpointMetadata`)."""
    meta = load_metadata(path)
    reader = ShardReader(path, meta, verify)
    try:
        for name, rec in meta.frozen.items():
            t = reader.read_whole(rec["file"], rec["key"])
            if list(t.shape) != list(rec["shape"]):
                raise CheckpointError(f"{path}: frozen parameter {name} has shape {list(t.shape)} in its file but "
                                      f"{rec['shape']} in the metadata")
            yield name, t
    finally:
        reader.close()
