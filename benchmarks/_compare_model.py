"""The plain GPT-style ``nn.Module``, its data and its config, shared by every comparison in
benchmarks/compare.py: nothing in it comes from the engine, so every system trains exactly
the same PyTorch code.

``PlainGPT(spec)``: token + learned position embedding, ``num_layers`` pre-norm blocks
(LayerNorm, causal multi-head attention through ``scaled_dot_product_attention``, GELU MLP
4H), final LayerNorm and an untied LM head. ``forward(ids, targets)`` returns the mean
cross-entropy; ``stage_layers()`` returns the same modules as a list
``[embedding, block_0 .. block_{L-1}, head]`` (the head's output is the logits) for
pipeline parallelism.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ModelSpec", "PlainGPT", "cross_entropy", "make_batches", "ds_config"]


@dataclass(frozen=True)
class ModelSpec:
    vocab: int = 4096
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    seq: int = 128
    micro_batch: int = 4
    grad_accum: int = 2

    def to_dict(self) -> dict:
        return asdict(self)


class Embedding(nn.Module):
    def __init__(self, s: ModelSpec) -> None:
        super().__init__()
        self.tok = nn.Embedding(s.vocab, s.hidden)
        self.pos = nn.Embedding(s.seq, s.hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, S) -> (B, S, H)
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.tok(ids) + self.pos(pos)


class Block(nn.Module):
    def __init__(self, s: ModelSpec) -> None:
        super().__init__()
        self.heads = s.heads
        self.ln1 = nn.LayerNorm(s.hidden)
        self.qkv = nn.Linear(s.hidden, 3 * s.hidden)
        self.proj = nn.Linear(s.hidden, s.hidden)
        self.ln2 = nn.LayerNorm(s.hidden)
        self.fc1 = nn.Linear(s.hidden, 4 * s.hidden)
        self.fc2 = nn.Linear(4 * s.hidden, s.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, S, H) -> (B, S, H)
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, S, d)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, s: ModelSpec) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(s.hidden)
        self.out = nn.Linear(s.hidden, s.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, S, H) -> logits (B, S, V)
        return self.out(self.ln(x))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy; logits (B, S, V), targets (B, S)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class PlainGPT(nn.Module):
    def __init__(self, s: ModelSpec, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = Embedding(s)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.head = Head(s)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def stage_layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for blk in self.blocks:
            h = blk(h)
        return cross_entropy(self.head(h), targets)

    def clone(self) -> "PlainGPT":
        return copy.deepcopy(self)


def make_batches(s: ModelSpec, step: int, rank: int, device: Any = "cpu",
                 micro: int | None = None, count: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (default grad_accum) micro-batches of ``micro`` (default micro_batch)
    sequences of step ``step`` for data-parallel rank ``rank``: (ids, targets), (B, S) each."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    out = []
    for _ in range(count or s.grad_accum):
        ids = torch.randint(0, s.vocab, (micro or s.micro_batch, s.seq + 1), generator=g)
        out.append((ids[:, :-1].to(device), ids[:, 1:].to(device)))
    return out


def ds_config(s: ModelSpec, stage: int, *, dp: int, lr: float = 1e-3, clip: float = 1.0, bf16: bool = False,
              torch_adam: bool = True, bucket: int = 500_000, overlap_comm: bool = False,
              zero: Optional[dict] = None) -> dict:
    """The one DeepSpeed JSON config both systems read (fp32 unless ``bf16``).

    ``torch_adam``: both sides step ``torch.optim.AdamW`` (DeepSpeed's fused CPU Adam and
    ours differ; this compares the ZeRO machinery, not the Adam kernels). ``zero``: more
    ``zero_optimization`` keys (compare.py's ``--zero KEY=VALUE``), the same for both.
    """
    return {
        "train_batch_size": s.micro_batch * s.grad_accum * dp,
        "train_micro_batch_size_per_gpu": s.micro_batch,
        "gradient_accumulation_steps": s.grad_accum,
        "gradient_clipping": clip,
        "steps_per_print": 10 ** 9,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                   "weight_decay": 0.1, "torch_adam": torch_adam}},
        "bf16": {"enabled": bf16},
        "zero_optimization": {
            "stage": stage, "overlap_comm": overlap_comm, "contiguous_gradients": True,
            "reduce_scatter": True, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
            # stage 3: DeepSpeed's defaults for the reuse distance and live parameters written
            # out (ours defaults to reuse distance 0), so both systems run with the same setting
            **({"stage3_prefetch_bucket_size": bucket, "stage3_param_persistence_threshold": 10_000,
                "stage3_max_live_parameters": 10 ** 9, "stage3_max_reuse_distance": 10 ** 9} if stage == 3 else {}),
            **(zero or {}),
        },
    }
