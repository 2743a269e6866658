"""What this rank holds: global parameter names (from the model) and, for every flat ZeRO
group, which fragment of which parameter sits where in the fp32 master shard (from
ZeRO's shard view, :mod:`engine.zero.shard_view`).

Names are those of the single-process reference model: with stage chunks (the reference
GPT or a layer list) a parameter of layer ``j`` of a chunk starting at layer ``s`` is
``layers.{s + j}.{name}`` (``engine.models.GPT`` indexing, whatever stage holds it);
otherwise the module's own ``named_parameters`` names. A parameter reachable under
several names (a tied embedding and head in one process) takes the first, and the others
are recorded as aliases; a pipeline copy of a tied weight (placement ``tied_copy``) is an alias
of the original on the first stage (matched by the ZeRO group's ``tied_index``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn

from engine.checkpoint.format import TPSlice
from engine.pipeline.names import parameter_names, stage_chunks
from engine.placement import placement_of
from engine.zero.shard_view import ShardView

__all__ = ["LocalPiece", "stage_chunks", "parameter_names", "tp_slice_of", "local_pieces", "tied_names",
           "module_names"]


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


def tp_slice_of(param: torch.Tensor, tp_rank: int, tp_world: int,
                local_shape: Optional[tuple[int, ...]] = None) -> Optional[TPSlice]:
    """How the rank-local tensor is cut from the full one (None for a whole, replicated one):
    the TP slice, or for an expert shard (``Placement.expert``: experts ``[first, first +
    count)`` of ``num_experts`` stacked along dim 0) the slice ``first / count`` of
    ``num_experts / count`` equal pieces along dim 0, so the checkpoint stores every expert at
    its GLOBAL index and any expert-parallel layout (or one process) reads it back.
    ``local_shape``: the rank-local tensor's shape (checked: an expert shard stacks ``count``
    experts along dim 0)."""
    placement = placement_of(param)
    shard, experts = placement.tp, placement.expert
    if experts is not None:
        if shard is not None:
            raise ValueError("a parameter both tensor-parallel and expert-sharded has no checkpoint layout yet: "
                             "the MoE experts are replicated over TP")
        if experts.first % experts.count or experts.num_experts % experts.count:
            raise ValueError(f"expert shard {experts}: not one of num_experts / count equal pieces")
        if local_shape is not None and tuple(local_shape)[:1] != (experts.count,):
            raise ValueError(f"an expert parameter of shape {tuple(local_shape)} does not stack its {experts.count} "
                             "experts along dim 0: checkpoints store experts by global index only for stacked expert "
                             "weights (the reference GPT's MoE layer); a module per expert (DeepSpeed's MoE layer) "
                             "is not supported at expert_parallel.size > 1")
        return TPSlice(0, experts.first // experts.count, experts.num_experts // experts.count)
    if shard is None:
        return None
    return TPSlice(shard.dim, int(tp_rank), int(tp_world), shard.fused_parts, shard.unpadded_size)


def local_pieces(view: ShardView, names: dict[int, str]) -> list[LocalPiece]:
    """Every parameter fragment in this rank's master shards (ZeRO's shard view), group by
    group, in flat order, with its global name and TP slice."""
    out = []
    for pc in view.pieces():
        if id(pc.param) not in names:
            raise ValueError(f"an optimized parameter of shape {pc.shape} is not a parameter of the engine's "
                             f"module, so it has no name to save it under")
        out.append(LocalPiece(pc.group, pc.offset, pc.numel, pc.start, pc.shape,
                              tp_slice_of(pc.param, view.tp_rank, view.tp_size, pc.shape), names[id(pc.param)],
                              pc.param))
    return out


def tied_names(view: ShardView, names: dict[int, str]) -> tuple[dict[int, str], dict[str, int]]:
    """``({tied_index: name of the original}, {name of a pipeline copy: tied_index})``."""
    originals: dict[int, str] = {}
    copies: dict[str, int] = {}
    for g in view.groups:
        if g.tied_index < 0:
            continue
        for b in g.buckets:
            for s in b.params:
                if placement_of(s.param).tied_copy:
                    copies[names[id(s.param)]] = g.tied_index
                else:
                    originals[g.tied_index] = names[id(s.param)]
    return originals, copies


def module_names(module: nn.Module) -> dict[int, str]:
    """``{id(submodule): name}``, named as :func:`parameter_names` names parameters
    (``layers.{i}.…`` with stage chunks), first name wins."""
    out: dict[int, str] = {}
    chunks = stage_chunks(module)
    if chunks is None:
        for n, m in module.named_modules():
            out.setdefault(id(m), n)
        return out
    for chunk in chunks:
        ch: Any = chunk  # a StageChunk: its first layer index ``start`` and its ``layers``
        for j, layer in enumerate(ch.layers):
            for n, m in layer.named_modules():
                out.setdefault(id(m), f"layers.{ch.start + j}" + (f".{n}" if n else ""))
    return out
