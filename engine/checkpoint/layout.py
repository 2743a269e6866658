"""What this rank holds, read off an Engine: global parameter names and, for every flat
ZeRO group, which fragment of which parameter sits where in the fp32 master shard.

Names are those of the single-process reference model: with stage chunks (the reference
GPT or a layer list) a parameter of layer ``j`` of a chunk starting at layer ``s`` is
``layers.{s + j}.{name}`` (``engine.models.GPT`` indexing, whatever stage holds it);
otherwise the module's own ``named_parameters`` names. A parameter reachable under
several names (a tied embedding and head in one process) takes the first, and the others
are recorded as aliases; a pipeline copy of a tied weight (``is_tied_copy``) is an alias
of the original on the first stage (matched by the ZeRO group's ``tied_index``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn

from engine.checkpoint.format import TPSlice
from engine.pipeline.stages import ReferenceModel, StageChunk
from engine.tensor_parallel.attrs import is_tied_copy, is_tp_sharded, tp_partition_dim

__all__ = ["LocalPiece", "stage_chunks", "parameter_names", "tp_slice_of", "local_pieces", "owns_group",
           "tied_names"]


@dataclass(frozen=True)
class LocalPiece:
    """Elements ``[start, start + numel)`` of parameter ``name``'s flattened TP-local tensor
    live at ``[offset, offset + numel)`` of optimizer group ``group``'s master shard."""

    group: int
    offset: int
    numel: int
    start: int
    local_shape: tuple[int, ...]
    tp: Optional[TPSlice]
    name: str
    param: Any  # the nn.Parameter (identity only: under ZeRO-3 its data may be empty)


def stage_chunks(module: nn.Module) -> Optional[list[nn.Module]]:
    """The StageChunks behind an engine's module (pipeline list, ReferenceModel or one
    chunk), or None for a plain module."""
    if isinstance(module, StageChunk):
        return [module]
    if isinstance(module, ReferenceModel):
        return [module.chunk]
    if isinstance(module, nn.ModuleList) and len(module) and all(isinstance(m, StageChunk) for m in module):
        return list(module)
    return None


def parameter_names(module: nn.Module) -> tuple[dict[int, str], dict[str, str]]:
    """``({id(param): name}, {alias: name})`` for every parameter of ``module``."""
    names: dict[int, str] = {}
    aliases: dict[str, str] = {}

    def add(full: str, p: torch.Tensor) -> None:
        if id(p) in names:
            aliases[full] = names[id(p)]
        else:
            names[id(p)] = full

    chunks = stage_chunks(module)
    if chunks is None:
        for n, p in module.named_parameters(remove_duplicate=False):
            add(n, p)
    else:
        for ch in chunks:
            for j, layer in enumerate(ch.layers):
                for n, p in layer.named_parameters(remove_duplicate=False):
                    add(f"layers.{ch.start + j}.{n}", p)
    return names, aliases


def tp_slice_of(param: torch.Tensor, tp_rank: int, tp_world: int) -> Optional[TPSlice]:
    """The TP slice a parameter is (None for a TP-replicated one)."""
    if not is_tp_sharded(param):
        return None
    dim = tp_partition_dim(param)
    if dim is None:
        raise ValueError("a TP-sharded parameter has no tp_partition_dim tag")
    parts = getattr(param, "tp_fused_parts", None)
    unpadded = getattr(param, "tp_unpadded_size", None)
    return TPSlice(int(dim), int(tp_rank), int(tp_world), tuple(int(p) for p in parts) if parts else None,
                   None if unpadded is None else int(unpadded))


def local_pieces(optimizer: Any, names: dict[int, str], tp_rank: int, tp_world: int) -> list[LocalPiece]:
    """Every parameter fragment in this rank's master shards, group by group, in flat order."""
    out = []
    for gi, g in enumerate(optimizer.groups):
        base = 0
        for b in g.buckets:
            for piece in b.layout.pieces(b.shard_index):
                p = b.params[piece.param_index]
                if id(p) not in names:
                    raise ValueError(f"an optimized parameter of shape {tuple(b.shapes[piece.param_index])} is not a "
                                     f"parameter of the engine's module, so it has no name to save it under")
                out.append(LocalPiece(gi, base + piece.shard_start, piece.numel, piece.param_start,
                                      tuple(int(s) for s in b.shapes[piece.param_index]),
                                      tp_slice_of(p, tp_rank, tp_world), names[id(p)], p))
            base += b.layout.shard_numel
    return out


def owns_group(optimizer: Any, group: Any, dp_rank: int, tp_rank: int) -> bool:
    """Whether this rank writes the group: each element of the model is written once
    (ZeRO-0 replicas: DP rank 0; TP-replicated parameters: TP rank 0; a pipeline copy of
    a tied weight never, its original is written)."""
    if group.key.tied_copy:
        return False
    if not optimizer.shards_optimizer_state and dp_rank != 0:
        return False
    if not group.key.tp_sharded and tp_rank != 0:
        return False
    return True


def tied_names(optimizer: Any, names: dict[int, str]) -> tuple[dict[int, str], dict[str, int]]:
    """``({tied_index: name of the original}, {name of a pipeline copy: tied_index})``."""
    originals: dict[int, str] = {}
    copies: dict[str, int] = {}
    for g in optimizer.groups:
        if g.key.tied_index < 0:
            continue
        for b in g.buckets:
            for p in b.params:
                if is_tied_copy(p):
                    copies[names[id(p)]] = g.key.tied_index
                else:
                    originals[g.key.tied_index] = names[id(p)]
    return originals, copies
