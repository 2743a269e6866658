"""Building blocks of the reference decoder: RMSNorm, rotary embeddings, causal
self-attention and the MLPs (SwiGLU), all tensor-parallel through engine.tensor_parallel.

A block's MLP is a choice: :data:`MLPS` maps a name (``model.mlp`` in the config) to an
:class:`MlpFactory`, and ``Block(..., mlp=...)`` takes a name or a factory.

Activation layout: (B, S, H) batch first; with sequence parallelism the residual stream
is (B, S/tp, H) and the TP regions (attention, MLP) see the full sequence.

Attention inputs (optional, per forward; see :func:`attention_inputs`): a boolean mask
``(B, 1, S, S)`` (True = query i may attend key j; it replaces the causal default, so it
must be causal itself) and position ids ``(B, S)`` for the rotary embedding. Packed
documents give both from their document ids: the document-causal mask and positions that
restart at 0 in each document, so each document is computed as if it were alone. On CUDA
the document mask is a flex-attention block mask, never the (B, 1, S, S) tensor
(engine.models.attention).

FP8 (``fp8_recipe``): the q/k/v, output, gate/up and down projections run their GEMMs in
FP8 (engine.precision.fp8); norms, attention itself, the embedding and the LM head do not.
"""

from __future__ import annotations

import math
from typing import Optional, Protocol, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.context_parallel.layout import CPLayout
from engine.data.packing import position_ids_from_doc_ids
from engine.distributed.groups import NO_TP, AxisGroup
from engine.distributed.strict import host_sync_allowed
from engine.errors import ConfigError
from engine.models.attention import AttnMask, ContextParallelMask, DocMaskKernel, attend, document_attention_mask
from engine.models.config import ModelConfig
from engine.moe.context import LOCAL_MOE, MoEContext
from engine.placement import REPLICATED, set_placement
from engine.precision.fp8 import Fp8Recipe
from engine.tensor_parallel.layers import ColumnParallelLinear, NormalInit, RowParallelLinear
from engine.tensor_parallel.mappings import copy_to_tp_region, tp_world_size

__all__ = ["RMSNorm", "RotaryEmbedding", "apply_rotary", "attention_inputs", "cp_attention_inputs", "forward_layers", "Attention",
           "SwiGLU", "MlpFactory", "MLPS", "mlp_factory", "moe_mlp", "Block"]

Device = Optional[Union[torch.device, str]]
Dtype = Optional[torch.dtype]


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * w``, computed in fp32 and cast back to x's dtype.

    The weight is TP-replicated. Under sequence parallelism each rank normalises only its
    own tokens, so the weight gradient is partial; the weight then passes through
    copy-to-region, whose backward all-reduces that gradient over TP so the replicas stay
    identical (no separate gradient hook the engine could forget to call)."""

    def __init__(self, dim: int, eps: float, tp_group: AxisGroup = NO_TP,
                 sequence_parallel: bool = False, device: Device = None, dtype: Dtype = None) -> None:
        super().__init__()
        self.eps = eps
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and tp_world_size(tp_group) > 1
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        set_placement(self.weight, REPLICATED)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = copy_to_tp_region(self.weight, self.tp_group) if self.sequence_parallel else self.weight
        xf = x.float()                                                   # (..., H) fp32
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (y * w.float()).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables (S, head_dim) for rotary position embeddings, as non-persistent fp32
    buffers (not parameters, not in the state dict), rebuilt if a longer sequence comes.
    One instance is shared by all blocks built together."""

    inv_freq: torch.Tensor  # buffers (register_buffer)
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, theta: float, max_seq_len: int, device: Device = None) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)      # (d/2,)
        self._build(max_seq_len)

    def _build(self, seq_len: int) -> None:
        t = torch.arange(seq_len, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq)                             # (S, d/2)
        emb = torch.cat([freqs, freqs], dim=-1)                           # (S, d)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, seq_len: int, position_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions ``0..seq_len-1`` (S, d), or of ``position_ids`` (B, S) as
        (B, 1, S, d) (broadcast over heads). Position ids must be < seq_len (document
        positions are), which keeps the table lookup free of a device sync."""
        if seq_len > self.cos.shape[0]:
            self._build(seq_len)
        if position_ids is None:
            return self.cos[:seq_len], self.sin[:seq_len]
        table_cos, table_sin = self.cos[:seq_len], self.sin[:seq_len]
        return table_cos[position_ids].unsqueeze(1), table_sin[position_ids].unsqueeze(1)  # (B, 1, S, d)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, heads, S, d) by position: pairs (i, i + d/2) rotate by angle
    ``pos * theta^(-2i/d)`` (the "rotate half" convention). Computed in fp32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def attention_inputs(seq_len: Optional[int], doc_ids: Optional[torch.Tensor] = None,
                     attn_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None, *,
                     doc_kernel: Optional[DocMaskKernel] = None) -> tuple[Optional[AttnMask], Optional[torch.Tensor]]:
    """Checked ``(mask or None, position_ids (B, S) int64 or None)``; the mask is the given
    ``attn_mask`` (B, 1, S, S) bool, or the document mask of ``doc_ids``.

    ``doc_ids`` (B, S), document ids of packed rows (``engine.data.Batch.input_doc_ids``),
    give the document-causal mask and per-document positions; they exclude ``attn_mask``
    and ``position_ids``. Built once per forward and shared by every block. The document
    mask's form follows ``doc_kernel`` (None: by device, flex block mask on CUDA, the bool
    (B, 1, S, S) tensor elsewhere; see engine.models.attention). ``seq_len``: the full
    sequence length S, or None to take it from the tensors given (a pipeline stage's hidden
    states may be (B, S/tp, H) and cannot tell).
    """
    if seq_len is None:
        given = doc_ids if doc_ids is not None else (position_ids if position_ids is not None else attn_mask)
        if given is None:
            return None, None
        seq_len = given.shape[-1]
    if doc_ids is not None:
        if attn_mask is not None or position_ids is not None:
            raise ValueError("pass either doc_ids or attn_mask/position_ids, not both (doc_ids imply the "
                             "document-causal mask and per-document positions)")
        if doc_ids.dim() != 2 or doc_ids.shape[1] != seq_len or doc_ids.is_floating_point():
            raise ValueError(f"doc_ids must be integer (batch, seq) = (B, {seq_len}) like the token ids, got "
                             f"{tuple(doc_ids.shape)} {doc_ids.dtype}")
        return document_attention_mask(doc_ids, doc_kernel), position_ids_from_doc_ids(doc_ids)
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool or attn_mask.dim() != 4 or attn_mask.shape[1] != 1 \
                or tuple(attn_mask.shape[2:]) != (seq_len, seq_len):
            raise ValueError(f"attn_mask must be a bool (B, 1, S, S) tensor with S = {seq_len} (True = may "
                             f"attend; one mask for all heads), got {tuple(attn_mask.shape)} {attn_mask.dtype}")
    if position_ids is not None:
        if position_ids.dim() != 2 or position_ids.shape[1] != seq_len or position_ids.is_floating_point():
            raise ValueError(f"position_ids must be integer (B, {seq_len}), got {tuple(position_ids.shape)} "
                             f"{position_ids.dtype}")
        if position_ids.device.type == "cpu" and position_ids.numel():
            with host_sync_allowed():  # CPU only: no device sync
                in_range = 0 <= int(position_ids.min()) <= int(position_ids.max()) < seq_len
        if position_ids.device.type == "cpu" and position_ids.numel() and not in_range:
            raise ValueError(f"position_ids must lie in [0, {seq_len}) (checked on CPU only)")
    return attn_mask, position_ids


def cp_attention_inputs(layout: CPLayout, positions: Optional[torch.Tensor], doc_ids: Optional[torch.Tensor] = None,
                        position_ids: Optional[torch.Tensor] = None) -> tuple[ContextParallelMask, torch.Tensor]:
    """The attention inputs of a context-parallel forward: ``(mask, rotary positions (B, S/C))``.

    ``positions`` (B, S/C): the global positions of this rank's tokens (the causal mask);
    ``doc_ids`` (B, S/C): their document ids (document masking), which need
    ``position_ids`` (B, S/C), the per-document positions of the same tokens (computed on the
    whole row where data enters: a document may start on another rank). Without document
    masking rotary uses the global positions."""
    if positions is None:
        raise ValueError("context parallelism is on (context_parallel.size > 1) but this forward got no positions: "
                         "micro-batches must enter through the engine (train_batch / eval_batch), which shards "
                         "them along the sequence (engine.context_parallel.data.shard_microbatch)")
    if doc_ids is not None and position_ids is None:
        raise ValueError("context parallel document masking needs position_ids (B, S/C), the per-document "
                         "positions of the local tokens (shard_microbatch computes them)")
    rotary = position_ids if position_ids is not None else positions
    return ContextParallelMask(layout, positions, doc_ids), rotary


def forward_layers(layers: Union[Sequence[nn.Module], nn.ModuleList], x: torch.Tensor, attn_mask: Optional[AttnMask] = None,
                   position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Run ``layers`` in order; blocks (``takes_attention_inputs``) also get the mask and
    positions, other layers (embedding, head) only the activation."""
    for layer in layers:
        if getattr(layer, "takes_attention_inputs", False):
            x = layer(x, attn_mask=attn_mask, position_ids=position_ids)
        else:
            x = layer(x)
    return x


class Attention(nn.Module):
    """Causal self-attention with heads split over TP ranks: fused column-parallel q/k/v
    (rank r holds heads ``[r*nh/tp, (r+1)*nh/tp)`` and the matching kv heads), SDPA, and a
    row-parallel output projection. Grouped-query attention when num_kv_heads < num_heads.
    Input/output (B, S, H), or (B, S/tp, H) with sequence parallelism. Optional
    ``attn_mask`` / ``position_ids`` (module docstring) cover the full sequence S."""

    def __init__(self, cfg: ModelConfig, layer: int, tp_group: AxisGroup, sequence_parallel: bool,
                 seed: int, rotary: RotaryEmbedding, device: Device = None, dtype: Dtype = None, *,
                 fp8_recipe: Optional[Fp8Recipe] = None) -> None:
        super().__init__()
        world = tp_world_size(tp_group)
        d = cfg.head_dim
        self.head_dim = d
        self.local_heads = cfg.num_heads // world
        self.local_kv_heads = cfg.kv_heads // world
        std_out = cfg.init_std / math.sqrt(2 * cfg.num_layers)  # GPT-2/Megatron residual scaling
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size, [cfg.num_heads * d, cfg.kv_heads * d, cfg.kv_heads * d], tp_group,
            init=NormalInit(cfg.init_std, seed, f"blocks.{layer}.attn.qkv"),
            sequence_parallel=sequence_parallel, device=device, dtype=dtype, fp8_recipe=fp8_recipe)
        self.proj = RowParallelLinear(
            cfg.num_heads * d, cfg.hidden_size, tp_group,
            init=NormalInit(std_out, seed, f"blocks.{layer}.attn.proj"),
            sequence_parallel=sequence_parallel, device=device, dtype=dtype, fp8_recipe=fp8_recipe)
        self.rotary = rotary

    def forward(self, x: torch.Tensor, attn_mask: Optional[AttnMask] = None,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        qkv = self.qkv(x)                                                 # (B, S, (nh + 2 nkv) d / tp)
        b, s, _ = qkv.shape
        d, nh, nkv = self.head_dim, self.local_heads, self.local_kv_heads
        q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
        q = q.view(b, s, nh, d).transpose(1, 2)                           # (B, nh/tp, S, d)
        k = k.view(b, s, nkv, d).transpose(1, 2)                          # (B, nkv/tp, S, d)
        v = v.view(b, s, nkv, d).transpose(1, 2)
        # under context parallelism s is this rank's S/C tokens; positions index the whole S
        full = s * attn_mask.layout.size if isinstance(attn_mask, ContextParallelMask) else s
        cos, sin = self.rotary(full, position_ids)                        # (S, d) or (B, 1, S, d)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = attend(q, k, v, attn_mask)                                    # (B, nh/tp, S, d); GQA without K/V copies
        o = o.transpose(1, 2).reshape(b, s, nh * d)                       # (B, S, nh d / tp)
        return self.proj(o)                                               # (B, S, H) or (B, S/tp, H)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: gate/up fused column-parallel (F/tp each per rank),
    down row-parallel."""

    def __init__(self, cfg: ModelConfig, layer: int, tp_group: AxisGroup, sequence_parallel: bool,
                 seed: int, device: Device = None, dtype: Dtype = None, *,
                 fp8_recipe: Optional[Fp8Recipe] = None) -> None:
        super().__init__()
        f = cfg.ffn_size
        std_out = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.gate_up = ColumnParallelLinear(
            cfg.hidden_size, [f, f], tp_group, init=NormalInit(cfg.init_std, seed, f"blocks.{layer}.mlp.gate_up"),
            sequence_parallel=sequence_parallel, device=device, dtype=dtype, fp8_recipe=fp8_recipe)
        self.down = RowParallelLinear(
            f, cfg.hidden_size, tp_group, init=NormalInit(std_out, seed, f"blocks.{layer}.mlp.down"),
            sequence_parallel=sequence_parallel, device=device, dtype=dtype, fp8_recipe=fp8_recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)                       # (B, S, F/tp) each
        return self.down(F.silu(gate) * up)


class MlpFactory(Protocol):
    """Builds block ``layer``'s MLP, hidden (B, S, H) -> (B, S, H) (or (B, S/tp, H) under
    sequence parallelism). Its parameters' names and init keys (``blocks.{layer}.mlp.…``) are
    the checkpoint's names; sharded init must equal the slice of the unsharded init."""

    def __call__(self, cfg: ModelConfig, layer: int, tp_group: AxisGroup, sequence_parallel: bool,
                 seed: int, device: Device = None, dtype: Dtype = None, *,
                 fp8_recipe: Optional[Fp8Recipe] = None) -> nn.Module: ...


# name (engine.models.config.MLP_KINDS) -> factory; the expert-parallel issue adds "moe"
MLPS: dict[str, MlpFactory] = {"swiglu": SwiGLU}


def mlp_factory(mlp: Union[str, MlpFactory]) -> MlpFactory:
    """The factory ``mlp`` names (or ``mlp`` itself when it is one)."""
    if not isinstance(mlp, str):
        return mlp
    if mlp not in MLPS:
        raise ConfigError(f"model.mlp = {mlp!r}: must be one of {sorted(MLPS)}")
    return MLPS[mlp]


def moe_mlp(ctx: MoEContext) -> MlpFactory:
    """The factory of ``model.moe``'s MLP (engine.moe.layer.MoELayer) with the groups of ``ctx``
    (engine.moe.context; the block's TP group and sequence parallelism are added to it)."""

    def build(cfg: ModelConfig, layer: int, tp_group: AxisGroup, sequence_parallel: bool, seed: int,
              device: Device = None, dtype: Dtype = None, *, fp8_recipe: Optional[Fp8Recipe] = None) -> nn.Module:
        if cfg.moe is None:
            raise ConfigError("the MoE MLP needs model.moe (num_experts, expert_hidden_size, ...)")
        if fp8_recipe is not None:
            raise ConfigError("fp8.enabled with model.moe: the MoE experts have no FP8 GEMMs yet; turn fp8 off or "
                              "remove model.moe")
        from engine.moe.layer import MoELayer  # the MoE layer builds its shared experts from SwiGLU here

        return MoELayer(cfg, cfg.moe, layer, seed, ctx.with_tp(tp_group, sequence_parallel), device, dtype)

    return build


class Block(nn.Module):
    """Pre-norm decoder block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; hidden -> hidden.
    Takes the optional attention inputs (module docstring) as keywords. ``mlp``: a name in
    :data:`MLPS` or a factory; None is the config's ``model.mlp``, or the MoE MLP with every
    expert local (:func:`moe_mlp`) when ``model.moe`` is set and ``layer`` is one of its layers
    (``layer % layer_freq == 0``)."""

    takes_attention_inputs = True  # forward_layers passes attn_mask / position_ids

    def __init__(self, cfg: ModelConfig, layer: int, tp_group: AxisGroup, sequence_parallel: bool,
                 seed: int, rotary: RotaryEmbedding, device: Device = None, dtype: Dtype = None, *,
                 fp8_recipe: Optional[Fp8Recipe] = None, mlp: Union[str, MlpFactory, None] = None) -> None:
        super().__init__()
        self.layer = layer
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, tp_group, sequence_parallel, device, dtype)
        self.attn = Attention(cfg, layer, tp_group, sequence_parallel, seed, rotary, device, dtype,
                              fp8_recipe=fp8_recipe)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, tp_group, sequence_parallel, device, dtype)
        if mlp is None and cfg.moe is not None and cfg.moe.is_moe_layer(layer):
            mlp = moe_mlp(LOCAL_MOE)  # every expert local; build_stage_layers passes the run's groups
        build_mlp = mlp_factory(cfg.mlp if mlp is None else mlp)
        self.mlp = build_mlp(cfg, layer, tp_group, sequence_parallel, seed, device, dtype, fp8_recipe=fp8_recipe)

    def forward(self, x: torch.Tensor, attn_mask: Optional[AttnMask] = None,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), attn_mask, position_ids)
        return x + self.mlp(self.mlp_norm(x))
