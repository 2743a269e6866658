"""Sharded loading of a full (unsharded) Hugging Face state dict onto an AutoTP model.

Each rank reads, parameter by parameter, only *its* TP slice of each weight, straight from
the source: a safetensors file (or a directory of them, ``model.safetensors`` or the
shards an ``*.index.json`` lists) is opened per tensor and read through
``safe_open(...).get_slice`` -- rows of a column-parallel weight are read as a contiguous
range, so that full tensor is never materialised; a row-parallel weight's column range
is a strided read whose peak is at most that one weight. An in-memory state dict (an HF
checkpoint already loaded on CPU) is sliced the same way (its full tensors are the
caller's). Peak memory per rank: its shard plus one full weight (measured in
tests/distributed/test_autotp_ckpt.py). An expert shard (``Placement.expert``, expert
parallelism) reads only its experts' rows ``[first, first + count)`` along dim 0, so no rank
reads another rank's experts from a safetensors file.

The slice a parameter needs is read off its placement (its :class:`~engine.placement.TPShard`:
dim and fused parts; :mod:`engine.placement`), so the same
code serves column, row, fused and replicated parameters and ``nn.Linear`` or ``Conv1D``
layouts. Names are the model's ``named_parameters()`` names; a checkpoint saved from the
base model (keys without ``base_model_prefix``, e.g. GPT-2's ``h.0...``) is matched too,
and a tied weight is read once (under its first name).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Union

import torch
import torch.nn as nn

from engine.placement import placement_of

__all__ = ["WeightSource", "open_weights", "local_ranges", "read_local", "load_sharded_weights", "LoadReport"]

SourceArg = Union[str, "os.PathLike[str]", Mapping[str, torch.Tensor], "WeightSource"]


def local_ranges(full_size: int, rank: int, world: int, parts: Optional[tuple[int, ...]]) -> list[tuple[int, int]]:
    """``[(start, stop)]`` along the partition dim that rank ``rank`` holds, part by part
    (the same slices :func:`engine.tensor_parallel.layers.shard_tensor` takes)."""
    sizes = list(parts) if parts else [full_size]
    out, base = [], 0
    for size in sizes:
        if size % world:
            raise ValueError(f"size {size} is not divisible by the TP degree {world}")
        n = size // world
        out.append((base + rank * n, base + (rank + 1) * n))
        base += size
    return out


class WeightSource:
    """Names and per-name slice reads of a full state dict (safetensors files or a mapping)."""

    def __init__(self, tensors: Optional[Mapping[str, torch.Tensor]] = None,
                 files: Optional[dict[str, str]] = None) -> None:
        self._tensors, self._files = tensors, files or {}

    def names(self) -> set[str]:
        return set(self._tensors) if self._tensors is not None else set(self._files)

    def read(self, name: str, dim: Optional[int], ranges: list[tuple[int, int]]) -> torch.Tensor:
        """The concatenation along ``dim`` of ``ranges`` of tensor ``name`` (whole if ``dim`` is None)."""
        merged: list[tuple[int, int]] = []
        for a, b in ranges:  # adjacent ranges (fused parts at TP = 1) read as one
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        ranges = merged
        if self._tensors is not None:
            full = self._tensors[name]
            if dim is None or ranges == [(0, full.shape[dim])]:
                return full.detach().clone()
            return torch.cat([full.narrow(dim, a, b - a) for a, b in ranges], dim=dim).contiguous()
        from safetensors import safe_open

        # One open per tensor: the mapping (and the file pages it touched) is released at once.
        with safe_open(self._files[name], framework="pt") as f:
            sl = f.get_slice(name)
            if dim is None or ranges == [(0, sl.get_shape()[dim])]:  # the whole tensor: no slice + cat copies
                return f.get_tensor(name)
            idx = [slice(None)] * dim
            parts = [sl[tuple(idx + [slice(a, b)])] for a, b in ranges]
            return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)).contiguous()


def open_weights(source: SourceArg) -> WeightSource:
    """A state dict, a ``.safetensors`` file, or a directory with ``model.safetensors`` or
    ``model.safetensors.index.json`` (sharded HF checkpoints)."""
    if isinstance(source, WeightSource):
        return source
    if isinstance(source, Mapping):
        return WeightSource(tensors=source)
    path = os.fspath(source)
    files: list[str]
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as fh:
                wm = json.load(fh)["weight_map"]
            return WeightSource(files={k: os.path.join(path, v) for k, v in wm.items()})
        if not os.path.isfile(single):
            raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json: pass "
                                    f"a Hugging Face checkpoint directory, a .safetensors file or a state dict")
        files = [single]
    elif path.endswith(".safetensors") and os.path.isfile(path):
        files = [path]
    else:
        raise FileNotFoundError(f"{path} is not a .safetensors file or a checkpoint directory")
    from safetensors import safe_open

    mapping: dict[str, str] = {}
    for fp in files:
        with safe_open(fp, framework="pt") as f:
            mapping.update({k: fp for k in f.keys()})
    return WeightSource(files=mapping)


def _source_name(name: str, names: set[str], prefix: str) -> Optional[str]:
    if name in names:
        return name
    if prefix and name.startswith(prefix + ".") and name[len(prefix) + 1:] in names:
        return name[len(prefix) + 1:]
    return None


def read_local(src: WeightSource, key: str, param: torch.Tensor, tp_rank: int, tp_world: int,
               full_shape: tuple[int, ...]) -> torch.Tensor:
    """This rank's TP-local value of parameter ``param`` from source tensor ``key``; for an
    expert shard (``Placement.expert``) its experts' rows along dim 0 only."""
    experts = placement_of(param).expert
    if experts is not None:   # never also TP-sharded (engine.checkpoint.layout refuses it)
        return src.read(key, 0, [(experts.first, experts.first + experts.count)])
    shard = placement_of(param).tp
    if shard is None:
        return src.read(key, None, [])
    return src.read(key, shard.dim, local_ranges(full_shape[shard.dim], tp_rank, tp_world, shard.fused_parts))


@dataclass
class LoadReport:
    """``loaded``: parameter names read; ``missing``: model parameters the source lacks;
    ``max_read_bytes``: the largest tensor read at once (this rank's slice)."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    max_read_bytes: int = 0


def full_shape_of(param: torch.Tensor, tp_world: int, local_shape: Optional[tuple[int, ...]] = None) -> tuple[int, ...]:
    """The unsharded shape of ``param`` (``local_shape``: its TP-local shape when ``param``
    does not carry it, e.g. partitioned by ZeRO-3)."""
    shape = list(param.shape if local_shape is None else local_shape)
    experts = placement_of(param).expert
    if experts is not None:   # this rank's experts stacked along dim 0
        shape[0] = experts.num_experts
    shard = placement_of(param).tp
    if shard is not None:
        shape[shard.dim] *= tp_world
    return tuple(shape)


@torch.no_grad()
def load_sharded_weights(model: nn.Module, source: SourceArg, tp_rank: int, tp_world: int, *,
                         strict: bool = True,
                         sink: Optional[Callable[[str, nn.Parameter, torch.Tensor], None]] = None,
                         shape_of: Optional[Callable[[nn.Parameter], tuple[int, ...]]] = None) -> LoadReport:
    """Fill ``model``'s parameters (and persistent buffers found in the source) with this
    rank's slices of ``source``. ``sink(name, param, local_fp)``: where each local tensor
    goes instead of ``param.copy_`` (the engine writes its fp32 master shards).
    ``shape_of(param)``: its TP-local shape where ``param.shape`` is not (ZeRO-3 partitioned
    parameters). ``strict``: every parameter must be in the source. One source tensor (this
    rank's TP slice of it) is held at a time."""
    src = open_weights(source)
    names = src.names()
    prefix = getattr(model, "base_model_prefix", "") or ""
    report = LoadReport()
    for name, p in model.named_parameters():
        key = _source_name(name, names, prefix)
        if key is None:
            report.missing.append(name)
            continue
        shape = tuple(p.shape) if shape_of is None else tuple(shape_of(p))
        local = read_local(src, key, p, tp_rank, tp_world, full_shape_of(p, tp_world, shape))
        if tuple(local.shape) != shape:
            raise ValueError(f"{name}: the source tensor {key} gives a local slice of shape {tuple(local.shape)} "
                             f"where this rank's parameter is {shape}: the checkpoint is for another model")
        report.max_read_bytes = max(report.max_read_bytes, local.numel() * local.element_size())
        if sink is not None:
            sink(name, p, local)
        else:
            p.copy_(local)
        report.loaded.append(name)
        del local
    if strict and report.missing:
        raise KeyError(f"the weights lack {len(report.missing)} parameter(s) of the model, e.g. "
                       f"{report.missing[:3]}: the checkpoint is for another model (or pass strict=False)")
    for name, b in model.named_buffers():
        key = _source_name(name, names, prefix)
        if key is not None and b is not None:
            b.copy_(src.read(key, None, []))
    return report
