"""Tensor-parallel layers: column/row-parallel linear, vocab-parallel embedding and LM head.

Partitions (weights in ``nn.Linear`` layout, ``Y = X A^T``, ``A`` of shape (out, in)):

- ColumnParallelLinear: ``A = [A_1; ...; A_p]`` split along the output dim (dim 0);
  rank r computes ``Y_r = X A_r^T`` (its slice of the output features).
- RowParallelLinear: ``A = [A_1, ..., A_p]`` split along the input dim (dim 1); rank r
  computes the partial sum ``X_r A_r^T`` and the ranks all-reduce (or reduce-scatter
  under sequence parallelism); the bias is added once, after the reduction.
- VocabParallelEmbedding: the table ``E`` (V, H) split along the vocabulary (dim 0); ids
  outside the local shard contribute zero and the ranks sum.

Initialisation is TP-invariant: the FULL weight is drawn on CPU from a generator seeded
by ``(seed, key)`` (``key`` a stable per-parameter name such as ``"blocks.3.attn.qkv"``)
and each rank keeps its slice, so the model is identical for every TP degree, pipeline
split and construction order.

Sequence parallelism (``sequence_parallel=True``): activations outside the TP regions are
``(B, S/tp, H)`` (this rank's contiguous slice of the sequence); column-parallel layers
all-gather the sequence on entry and row-parallel layers reduce-scatter it on exit.

Every parameter carries its :class:`~engine.placement.Placement`: sharded ones a
:class:`~engine.placement.TPShard` (the dim, the parts of a fused weight such as q, k, v --
each split separately, so rank r holds ``[q_r; k_r; v_r]`` -- and the true size of a padded
partition dim, the vocabulary), which :func:`gather_full_tensor` (and checkpoint
consolidation) need to rebuild the full tensor.

FP8 (``fp8_recipe=...``): the column/row-parallel layers run their local GEMM through
:func:`engine.precision.fp8.fp8_linear` (fp32/bf16 master weight, quantized per forward)
and keep their communication unchanged: column-parallel quantizes after copy-to-region /
the sequence gather; row-parallel multiplies without bias, reduces, then adds the bias.
Amaxes are MAX-reduced over the TP group, so every rank uses the dense layer's scales.
Each such layer holds its scaling state as ``fp8_state`` (found by ``fp8_states(model)``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.distributed.groups import AxisGroup
from engine.distributed.strict import host_sync_allowed
from engine.placement import REPLICATED, placement_of, set_placement, tp_shard
from engine.precision.fp8 import Fp8LinearState, Fp8Recipe, fp8_linear
from engine.tensor_parallel.mappings import (
    all_gather_along_dim,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
    tp_rank,
    tp_world_size,
)

__all__ = [
    "NormalInit",
    "param_seed",
    "pad_vocab_size",
    "shard_tensor",
    "unshard_tensors",
    "gather_full_tensor",
    "column_parallel_linear",
    "row_parallel_linear",
    "vocab_parallel_logits",
    "vocab_parallel_weight",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
]

Device = Optional[Union[torch.device, str]]
Dtype = Optional[torch.dtype]


# ---------------------------------------------------------------- deterministic init

def param_seed(seed: int, key: str) -> int:
    """A 63-bit generator seed from ``(seed, key)``; stable across processes and runs
    (Python's ``hash`` is salted per process, so it cannot be used)."""
    digest = hashlib.sha256(f"{int(seed)}/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class NormalInit:
    """``N(0, std^2)`` full weight from a generator seeded by ``(seed, key)``.

    This is the init hook: layers call ``init(full_shape)`` and slice their shard. It
    materialises the FULL tensor on CPU in every rank (the embedding of a 7B model is
    ~0.5 GB fp32, transiently), which is fine at the sizes we run; a meta-device or
    streamed init can later replace it by an object with the same call signature that
    only produces what the shard needs.
    """

    std: float
    seed: int
    key: str

    def __call__(self, shape: Sequence[int]) -> torch.Tensor:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(param_seed(self.seed, self.key))
        return torch.empty(tuple(shape), dtype=torch.float32).normal_(0.0, self.std, generator=gen)


def pad_vocab_size(vocab_size: int, tp: int) -> int:
    """Smallest multiple of ``tp`` that is >= ``vocab_size`` (padded rows are never looked
    up and their logits are -inf, so padding does not change any result)."""
    return -(-vocab_size // tp) * tp


# ---------------------------------------------------------------- shard layout

def shard_tensor(full: torch.Tensor, dim: int, rank: int, world: int,
                 parts: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` along ``dim``.

    ``parts`` (sizes along ``dim`` summing to ``full.shape[dim]``) describes a fused
    weight whose parts are split separately: the shard is ``[part0_r; part1_r; ...]``.
    """
    parts = list(parts) if parts else [full.shape[dim]]
    if sum(parts) != full.shape[dim]:
        raise ValueError(f"fused parts {parts} do not add up to dim {dim} of size {full.shape[dim]}")
    for p in parts:
        if p % world:
            raise ValueError(f"size {p} along dim {dim} is not divisible by the TP degree {world}")
    pieces = [chunk.chunk(world, dim=dim)[rank] for chunk in full.split(parts, dim=dim)]
    return torch.cat(pieces, dim=dim).contiguous()


def unshard_tensors(shards: Sequence[torch.Tensor], dim: int,
                    parts: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Inverse of :func:`shard_tensor`: the full tensor from every rank's shard, in rank order."""
    world = len(shards)
    if not parts:
        return torch.cat(list(shards), dim=dim)
    local = [p // world for p in parts]
    split = [s.split(local, dim=dim) for s in shards]       # [rank][part]
    return torch.cat([split[r][i] for i in range(len(parts)) for r in range(world)], dim=dim)


def gather_full_tensor(t: torch.Tensor, param: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """The unsharded value of ``t`` (``param`` itself, its ``.grad``, or any tensor laid out
    like it), gathered over the TP group and with vocabulary padding removed.
    Replicated parameters are returned as they are."""
    shard = placement_of(param).tp
    if shard is None:
        return t
    dim, world = shard.dim, tp_world_size(group)
    gathered = all_gather_along_dim(t.detach(), dim, group)
    full = unshard_tensors(gathered.chunk(world, dim=dim), dim, shard.fused_parts)
    return full.narrow(dim, 0, shard.unpadded_size) if shard.unpadded_size is not None else full


def _check_divisible(name: str, size: int, world: int) -> None:
    if size % world:
        raise ValueError(f"{name} = {size} is not divisible by the TP degree {world}: "
                         f"choose a TP degree that divides it")


def _place(t: torch.Tensor, device, dtype) -> nn.Parameter:
    return nn.Parameter(t.to(device=device, dtype=dtype if dtype is not None else t.dtype))


def _local_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group: AxisGroup,
                  fp8_state: Optional[Fp8LinearState], record_amax: bool) -> torch.Tensor:
    """This rank's GEMM ``x W^T + b``: plain, or FP8 with amaxes MAX-reduced over ``group``."""
    if fp8_state is None:
        return F.linear(x, weight, bias)
    return fp8_linear(x, weight, bias, fp8_state, tp_group=group, record_amax=record_amax)


class _Fp8Holder(nn.Module):
    """Mixin: an optional ``fp8_state`` that follows the module's device (``.to``/``.cuda``)."""

    fp8_state: Optional[Fp8LinearState]
    weight: nn.Parameter  # set by the linear layer that mixes this in

    def _init_fp8(self, recipe: Optional[Fp8Recipe]) -> None:
        self.fp8_state = Fp8LinearState(recipe, self.weight.device) if recipe is not None else None

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if getattr(self, "fp8_state", None) is not None:
            self.fp8_state.to(self.weight.device)
        return out


# ---------------------------------------------------------------- functional forms

def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           group: AxisGroup, *, sequence_parallel: bool = False,
                           gather_output: bool = False,
                           parts: Optional[Sequence[int]] = None,
                           fp8_state: Optional[Fp8LinearState] = None, record_amax: bool = True) -> torch.Tensor:
    """``x`` (B, S, in) -- or (B, S/tp, in) with sequence parallelism -- times this rank's
    weight shard (out/tp, in). Returns (B, S, out/tp), or (B, S, out) with ``gather_output``
    (``parts`` then restores the fused parts' order). ``fp8_state``: FP8 GEMM (module docstring)."""
    if sequence_parallel:
        x = gather_from_sequence_parallel_region(x, group)   # (B, S, in); bwd reduce-scatter
    else:
        x = copy_to_tp_region(x, group)                      # (B, S, in); bwd all-reduce
    y = _local_linear(x, weight, bias, group, fp8_state, record_amax)  # (B, S, out/tp)
    if gather_output and tp_world_size(group) > 1:
        y = gather_from_tp_region(y, group)                  # (B, S, out) in rank-major order
        if parts and len(parts) > 1:
            world = tp_world_size(group)
            y = unshard_tensors(y.chunk(world, dim=-1), -1, parts)
    return y


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        group: AxisGroup, *, sequence_parallel: bool = False,
                        input_is_parallel: bool = True, fp8_state: Optional[Fp8LinearState] = None,
                        record_amax: bool = True) -> torch.Tensor:
    """``x`` (B, S, in/tp) (or (B, S, in) with ``input_is_parallel=False``) times this rank's
    weight shard (out, in/tp), summed over ranks. Returns (B, S, out), or (B, S/tp, out)
    with sequence parallelism. The bias is added once, after the reduction.
    ``fp8_state``: the partial GEMM runs in FP8 (module docstring)."""
    if not input_is_parallel:
        if sequence_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel requires input_is_parallel=True "
                             "(the input must already be split along its last dim)")
        x = scatter_to_tp_region(x, group)                   # (B, S, in/tp)
    y = _local_linear(x, weight, None, group, fp8_state, record_amax)  # (B, S, out) partial sum
    if sequence_parallel:
        y = reduce_scatter_to_sequence_parallel_region(y, group)  # (B, S/tp, out)
    else:
        y = reduce_from_tp_region(y, group)                  # (B, S, out)
    if bias is not None:
        # Under sequence parallelism each rank adds the bias to its own tokens only, so the
        # bias gradient is partial: copy-to-region all-reduces it to keep the replicas equal.
        y = y + (copy_to_tp_region(bias, group) if sequence_parallel else bias)
    return y


def vocab_parallel_logits(x: torch.Tensor, weight: torch.Tensor, group: AxisGroup,
                          vocab_size: int, *, sequence_parallel: bool = False) -> torch.Tensor:
    """LM head: ``x`` (B, S, H) (or (B, S/tp, H)) times this rank's vocabulary shard
    (V_pad/tp, H). Returns logits (B, S, V_pad/tp); the columns of padded vocabulary
    entries (global index >= ``vocab_size``) are -inf so that softmax, cross-entropy and
    argmax ignore them exactly."""
    logits = column_parallel_linear(x, weight, None, group, sequence_parallel=sequence_parallel)
    local = weight.shape[0]
    start = tp_rank(group) * local
    if start + local > vocab_size:  # this shard holds padding
        pad = torch.arange(start, start + local, device=logits.device) >= vocab_size
        logits = logits.masked_fill(pad, float("-inf"))
    return logits


def vocab_parallel_weight(num_embeddings: int, embedding_dim: int, tp_group: AxisGroup, *,
                          init: NormalInit, device: Device = None, dtype: Dtype = None) -> nn.Parameter:
    """This rank's shard (V_pad/tp, H) of a vocabulary-sized weight (V, H) drawn by ``init``
    and zero-padded to ``V_pad``; tagged TP-sharded along dim 0. Shared by the embedding and
    an LM head so that a tied head's own copy is initialised identically."""
    world, rank = tp_world_size(tp_group), tp_rank(tp_group)
    padded = pad_vocab_size(num_embeddings, world)
    full = init((num_embeddings, embedding_dim))                        # (V, H), CPU fp32
    full = F.pad(full, (0, 0, 0, padded - num_embeddings))              # (V_pad, H)
    weight = _place(shard_tensor(full, 0, rank, world), device, dtype)  # (V_pad/tp, H)
    set_placement(weight, tp_shard(0, unpadded_size=num_embeddings))
    return weight


# ---------------------------------------------------------------- modules

class ColumnParallelLinear(_Fp8Holder):
    """``Y = X A^T + b`` with ``A = [A_1; ...; A_p]`` split along the output dim.

    Forward: input (B, S, in) (or (B, S/tp, in) with ``sequence_parallel``), output
    (B, S, out/tp), or (B, S, out) if ``gather_output``. ``out_features`` may be a list of
    part sizes for a fused weight (q/k/v, gate/up): each part is split separately so every
    rank gets a slice of each. Weight and bias are TP-sharded along dim 0.
    ``fp8_recipe``: run the local GEMM in FP8 (state in ``self.fp8_state``).
    """

    def __init__(self, in_features: int, out_features: Union[int, Sequence[int]], tp_group: AxisGroup,
                 *, init: NormalInit, bias: bool = False, gather_output: bool = False,
                 sequence_parallel: bool = False, device: Device = None, dtype: Dtype = None,
                 fp8_recipe: Optional[Fp8Recipe] = None) -> None:
        super().__init__()
        parts = [out_features] if isinstance(out_features, int) else list(out_features)
        world, rank = tp_world_size(tp_group), tp_rank(tp_group)
        for i, p in enumerate(parts):
            _check_divisible(f"ColumnParallelLinear output size (part {i})", p, world)
        self.tp_group, self.gather_output = tp_group, gather_output
        self.sequence_parallel = sequence_parallel and world > 1
        self.in_features, self.out_features = in_features, sum(parts)
        self.parts = tuple(parts) if len(parts) > 1 else None
        full = init((sum(parts), in_features))                       # (out, in), CPU fp32
        self.weight = _place(shard_tensor(full, 0, rank, world, self.parts), device, dtype)  # (out/tp, in)
        set_placement(self.weight, tp_shard(0, self.parts))
        if bias:
            self.bias = _place(torch.zeros(sum(parts) // world), device, dtype)
            set_placement(self.bias, tp_shard(0, self.parts))
        else:
            self.register_parameter("bias", None)
        self._init_fp8(fp8_recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(x, self.weight, self.bias, self.tp_group,
                                      sequence_parallel=self.sequence_parallel,
                                      gather_output=self.gather_output, parts=self.parts,
                                      fp8_state=self.fp8_state, record_amax=self.training)

    def extra_repr(self) -> str:
        local = self.weight.shape[0] if self.weight.dim() == 2 else "partitioned"  # ZeRO-3: empty between uses
        return (f"in={self.in_features}, out={self.out_features} (local {local}), "
                f"parts={self.parts}, gather_output={self.gather_output}, sp={self.sequence_parallel}, "
                f"fp8={self.fp8_state is not None}")


class RowParallelLinear(_Fp8Holder):
    """``Y = X A^T + b`` with ``A = [A_1, ..., A_p]`` split along the input dim.

    Forward: input (B, S, in/tp) if ``input_is_parallel`` else (B, S, in) (scattered here);
    output (B, S, out), or (B, S/tp, out) with ``sequence_parallel``. The weight is
    TP-sharded along dim 1; the bias is TP-replicated and added once after the reduction.
    ``fp8_recipe``: run the local partial GEMM in FP8 (state in ``self.fp8_state``).
    """

    def __init__(self, in_features: int, out_features: int, tp_group: AxisGroup, *,
                 init: NormalInit, bias: bool = False, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, device: Device = None, dtype: Dtype = None,
                 fp8_recipe: Optional[Fp8Recipe] = None) -> None:
        super().__init__()
        world, rank = tp_world_size(tp_group), tp_rank(tp_group)
        _check_divisible("RowParallelLinear input size", in_features, world)
        if sequence_parallel and not input_is_parallel and world > 1:
            raise ValueError("RowParallelLinear: sequence_parallel requires input_is_parallel=True")
        self.tp_group, self.input_is_parallel = tp_group, input_is_parallel
        self.sequence_parallel = sequence_parallel and world > 1
        self.in_features, self.out_features = in_features, out_features
        full = init((out_features, in_features))                     # (out, in), CPU fp32
        self.weight = _place(shard_tensor(full, 1, rank, world), device, dtype)  # (out, in/tp)
        set_placement(self.weight, tp_shard(1))
        if bias:
            self.bias = _place(torch.zeros(out_features), device, dtype)
            set_placement(self.bias, REPLICATED)
        else:
            self.register_parameter("bias", None)
        self._init_fp8(fp8_recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_parallel_linear(x, self.weight, self.bias, self.tp_group,
                                   sequence_parallel=self.sequence_parallel,
                                   input_is_parallel=self.input_is_parallel,
                                   fp8_state=self.fp8_state, record_amax=self.training)

    def extra_repr(self) -> str:
        local = self.weight.shape[1] if self.weight.dim() == 2 else "partitioned"  # ZeRO-3: empty between uses
        return (f"in={self.in_features} (local {local}), out={self.out_features}, "
                f"input_is_parallel={self.input_is_parallel}, sp={self.sequence_parallel}, "
                f"fp8={self.fp8_state is not None}")


class VocabParallelEmbedding(nn.Module):
    """Embedding table ``E`` (V, H) split along the vocabulary: rank r holds rows
    ``[r*V_pad/tp, (r+1)*V_pad/tp)`` where ``V_pad`` is ``V`` rounded up to a multiple of
    the TP degree (padding rows are zero and never looked up).

    Forward: ids (B, S) -> (B, S, H), or (B, S/tp, H) with ``sequence_parallel`` (the
    partial sums are reduce-scattered instead of all-reduced). Ids outside the local
    shard contribute zero. The weight is TP-sharded along dim 0.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group: AxisGroup, *,
                 init: NormalInit, sequence_parallel: bool = False, device: Device = None, dtype: Dtype = None) -> None:
        super().__init__()
        world, rank = tp_world_size(tp_group), tp_rank(tp_group)
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and world > 1
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padded_num_embeddings = pad_vocab_size(num_embeddings, world)
        self.shard_size = self.padded_num_embeddings // world
        self.vocab_start = rank * self.shard_size
        self.weight = vocab_parallel_weight(num_embeddings, embedding_dim, tp_group, init=init,
                                            device=device, dtype=dtype)  # (V_pad/tp, H)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"VocabParallelEmbedding expects integer token ids, got {ids.dtype}")
        if ids.device.type == "cpu" and ids.numel():
            with host_sync_allowed():  # checked on CPU only, where it costs no device sync
                lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.num_embeddings:
                raise ValueError(f"token ids must be in [0, {self.num_embeddings}), got range "
                                 f"[{lo}, {hi}]: check the tokenizer's vocab_size against model.vocab_size")
        if tp_world_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)                      # (B, S, H)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)            # (B, S)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, S, H) partial
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group)  # (B, S/tp, H)
        return reduce_from_tp_region(out, self.tp_group)                           # (B, S, H)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (padded {self.padded_num_embeddings}, local {self.shard_size}), "
                f"{self.embedding_dim}, sp={self.sequence_parallel}")

