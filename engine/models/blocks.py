"""Building blocks of the reference decoder: RMSNorm, rotary embeddings, causal
self-attention and the SwiGLU MLP, all tensor-parallel through engine.tensor_parallel.

Activation layout: (B, S, H) batch first; with sequence parallelism the residual stream
is (B, S/tp, H) and the TP regions (attention, MLP) see the full sequence.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from engine.models.config import ModelConfig
from engine.tensor_parallel.attrs import set_tp_attrs
from engine.tensor_parallel.layers import ColumnParallelLinear, NormalInit, RowParallelLinear
from engine.tensor_parallel.mappings import copy_to_tp_region, tp_world_size

__all__ = ["RMSNorm", "RotaryEmbedding", "apply_rotary", "Attention", "SwiGLU", "Block"]

ProcessGroup = Optional[dist.ProcessGroup]
Device = Optional[Union[torch.device, str]]
Dtype = Optional[torch.dtype]


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * w``, computed in fp32 and cast back to x's dtype.

    The weight is TP-replicated. Under sequence parallelism each rank normalises only its
    own tokens, so the weight gradient is partial; the weight then passes through
    copy-to-region, whose backward all-reduces that gradient over TP so the replicas stay
    identical (no separate gradient hook the engine could forget to call)."""

    def __init__(self, dim: int, eps: float, tp_group: ProcessGroup = None,
                 sequence_parallel: bool = False, device: Device = None, dtype: Dtype = None) -> None:
        super().__init__()
        self.eps = eps
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and tp_world_size(tp_group) > 1
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        set_tp_attrs(self.weight, sharded=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = copy_to_tp_region(self.weight, self.tp_group) if self.sequence_parallel else self.weight
        xf = x.float()                                                   # (..., H) fp32
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (y * w.float()).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables (S, head_dim) for rotary position embeddings, as non-persistent fp32
    buffers (not parameters, not in the state dict), rebuilt if a longer sequence comes.
    One instance is shared by all blocks built together."""

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

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        if seq_len > self.cos.shape[0]:
            self._build(seq_len)
        return self.cos[:seq_len], self.sin[:seq_len]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, heads, S, d) by position: pairs (i, i + d/2) rotate by angle
    ``pos * theta^(-2i/d)`` (the "rotate half" convention). Computed in fp32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention with heads split over TP ranks: fused column-parallel q/k/v
    (rank r holds heads ``[r*nh/tp, (r+1)*nh/tp)`` and the matching kv heads), SDPA, and a
    row-parallel output projection. Grouped-query attention when num_kv_heads < num_heads.
    Input/output (B, S, H), or (B, S/tp, H) with sequence parallelism."""

    def __init__(self, cfg: ModelConfig, layer: int, tp_group: ProcessGroup, sequence_parallel: bool,
                 seed: int, rotary: RotaryEmbedding, device: Device = None, dtype: Dtype = None) -> None:
        super().__init__()
        world = tp_world_size(tp_group)
        d = cfg.head_dim
        self.head_dim = d
        self.local_heads = cfg.num_heads // world
        self.local_kv_heads = cfg.num_kv_heads // world
        std_out = cfg.init_std / math.sqrt(2 * cfg.num_layers)  # GPT-2/Megatron residual scaling
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size, [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d], tp_group,
            init=NormalInit(cfg.init_std, seed, f"blocks.{layer}.attn.qkv"),
            sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.proj = RowParallelLinear(
            cfg.num_heads * d, cfg.hidden_size, tp_group,
            init=NormalInit(std_out, seed, f"blocks.{layer}.attn.proj"),
            sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.rotary = rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)                                                 # (B, S, (nh + 2 nkv) d / tp)
        b, s, _ = qkv.shape
        d, nh, nkv = self.head_dim, self.local_heads, self.local_kv_heads
        q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
        q = q.view(b, s, nh, d).transpose(1, 2)                           # (B, nh/tp, S, d)
        k = k.view(b, s, nkv, d).transpose(1, 2)                          # (B, nkv/tp, S, d)
        v = v.view(b, s, nkv, d).transpose(1, 2)
        cos, sin = self.rotary(s)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nh != nkv)  # (B, nh/tp, S, d)
        o = o.transpose(1, 2).reshape(b, s, nh * d)                       # (B, S, nh d / tp)
        return self.proj(o)                                               # (B, S, H) or (B, S/tp, H)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: gate/up fused column-parallel (F/tp each per rank),
    down row-parallel."""

    def __init__(self, cfg: ModelConfig, layer: int, tp_group: ProcessGroup, sequence_parallel: bool,
                 seed: int, device: Device = None, dtype: Dtype = None) -> None:
        super().__init__()
        f = cfg.ffn_hidden_size
        std_out = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.gate_up = ColumnParallelLinear(
            cfg.hidden_size, [f, f], tp_group, init=NormalInit(cfg.init_std, seed, f"blocks.{layer}.mlp.gate_up"),
            sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.down = RowParallelLinear(
            f, cfg.hidden_size, tp_group, init=NormalInit(std_out, seed, f"blocks.{layer}.mlp.down"),
            sequence_parallel=sequence_parallel, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)                       # (B, S, F/tp) each
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm decoder block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; hidden -> hidden."""

    def __init__(self, cfg: ModelConfig, layer: int, tp_group: ProcessGroup, sequence_parallel: bool,
                 seed: int, rotary: RotaryEmbedding, device: Device = None, dtype: Dtype = None) -> None:
        super().__init__()
        self.layer = layer
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, tp_group, sequence_parallel, device, dtype)
        self.attn = Attention(cfg, layer, tp_group, sequence_parallel, seed, rotary, device, dtype)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, tp_group, sequence_parallel, device, dtype)
        self.mlp = SwiGLU(cfg, layer, tp_group, sequence_parallel, seed, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))
