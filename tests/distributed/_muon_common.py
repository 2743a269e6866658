"""Shared helpers of the Muon layout tests: the tiny reference GPT (2 layers, hidden 32,
4 heads, vocab 128, seq 16, tied embedding) with Muon at any (dp, tp, pp, ZeRO stage,
gradient accumulation), fed a global batch of 16 sequences that depends only on the step."""

from __future__ import annotations

from typing import Any

import torch

VOCAB, SEQ, GLOBAL_BATCH = 128, 16, 16
MATRICES_PER_STEP = 2 * 7  # per block: q, k, v (fused qkv), proj, gate, up (fused), down


def config(dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, ga: int = 1, ns_dtype: str = "float32",
           **extra: Any) -> dict:
    cfg = {
        "train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": ga, "seed": 11, "gradient_clipping": 1.0,
        "optimizer": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 3e-3, "weight_decay": 0.1,
                                                 "adjust_lr_fn": "match_rms_adamw", "ns_dtype": ns_dtype}},
        "zero_optimization": {"stage": zero, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 100},
        "tensor_parallel": {"autotp_size": tp},
        "pipeline": {"stages": pp, "partition": "uniform"},
        "model": {"vocab_size": VOCAB, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "seq_len": SEQ},
    }
    cfg.update(extra)
    return cfg


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 5, (GLOBAL_BATCH, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def train(eng: Any, steps: int) -> list[float]:
    losses = []
    dp, r = eng.groups.dp_size, eng.groups.dp_rank
    micro = eng.config.train_micro_batch_size_per_gpu
    per = GLOBAL_BATCH // dp
    for _ in range(steps):
        x, y = global_batch(eng.global_steps)
        x, y = x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]
        mbs = [(x[i:i + micro], y[i:i + micro]) for i in range(0, per, micro)]
        losses.append(eng.train_batch(iter(mbs)).item())
    return losses


def ns_calls_of_job(eng: Any) -> int:
    """Newton-Schulz calls summed over every rank (collective)."""
    import torch.distributed as dist

    calls = torch.tensor([eng.optimizer.optimizer.ns_calls], dtype=torch.int64)
    dist.all_reduce(calls)
    return int(calls.item())


def build(cfg: dict) -> Any:
    import engine

    eng, *_ = engine.initialize(config=cfg)
    return eng


def run(cfg: dict, steps: int) -> tuple[list[float], int]:
    eng = build(cfg)
    losses = train(eng, steps)
    return losses, ns_calls_of_job(eng)
