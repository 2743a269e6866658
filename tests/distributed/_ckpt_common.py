"""Shared helpers of the checkpoint tests: the tiny reference GPT at any layout, fed a
synthetic global batch that is a pure function of the step (so every layout and every
resumed run sees the same data), and a few engine probes."""

from __future__ import annotations

import torch

VOCAB, SEQ, GLOBAL_BATCH, MICRO = 128, 16, 8, 2


def config(dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 1, layers: int = 4, micro: int = MICRO, **extra) -> dict:
    cfg = {
        "train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": micro, "seed": 11,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "torch_adam": True}},
        "scheduler": {"type": "cosine", "params": {"warmup_num_steps": 2, "total_num_steps": 10}},
        "zero_optimization": {"stage": zero, "reduce_bucket_size": 3000,
                              "stage3_param_persistence_threshold": 100},
        "tensor_parallel": {"autotp_size": tp},
        "pipeline": {"stages": pp, "partition": "uniform"},
        "model": {"vocab_size": VOCAB, "hidden_size": 32, "num_layers": layers, "num_heads": 4, "seq_len": SEQ},
    }
    cfg.update(extra)
    return cfg


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(GLOBAL_BATCH, SEQ) inputs and targets of step ``step``: arithmetic sequences mod VOCAB
    with a random start and stride, so there is something to learn."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 5, (GLOBAL_BATCH, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def microbatches(eng, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = global_batch(step)
    dp, r = eng.groups.dp_size, eng.groups.dp_rank
    per, micro = GLOBAL_BATCH // dp, eng.config.train_micro_batch_size_per_gpu
    x, y = x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]
    return [(x[i:i + micro], y[i:i + micro]) for i in range(0, per, micro)]


def train(eng, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        losses.append(eng.train_batch(iter(microbatches(eng, eng.global_steps))).item())
    return losses


def build(cfg: dict):
    import engine

    eng, *_ = engine.initialize(config=cfg)
    return eng


def dense_state(eng) -> dict:
    """The unsharded fp32 weights on rank 0 (None elsewhere), named as GPT's state dict."""
    from engine.generate import gather_reference_model

    model = gather_reference_model(eng)
    return None if model is None else {k: v.clone() for k, v in model.state_dict().items()}
