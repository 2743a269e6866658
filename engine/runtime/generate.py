"""Greedy text generation from a trained engine.

The model may be split over TP, PP and (ZeRO-3) DP ranks. Generation is a small demo
step, so we take the simplest correct route: gather the unsharded weights onto global
rank 0 (TP all-gather per parameter, then one ``gather_object`` over the world) and run
the whole reference model there with ``tp_group=None``. Collective: every rank calls
:func:`gather_reference_model`; only rank 0 gets a model.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from engine.models import GPT
from engine.tensor_parallel.layers import gather_full_tensor

__all__ = ["gather_reference_model", "greedy_generate"]


@torch.no_grad()
def gather_reference_model(engine) -> Optional[GPT]:
    """The trained reference model, unsharded, fp32, on CPU on global rank 0 (None elsewhere).

    ``engine.module`` must be the reference model's chunks (built by :func:`engine.initialize`
    with ``model=None`` or a GPT). Collective over the whole world.
    """
    cfg, groups = engine.config, engine.groups
    chunks = getattr(engine, "reference_chunks", None)
    if chunks is None:
        raise ValueError("gather_reference_model needs an engine built on the reference model "
                         "(engine.initialize with model=None or an engine.models.GPT)")
    tp_group = groups.tp_group if cfg.tp > 1 else None
    keep = groups.dp_rank == 0 and groups.tp_rank == 0
    gathered = engine.optimizer.gathered_params() if cfg.zero.stage == 3 else contextlib.nullcontext()
    local: dict[str, torch.Tensor] = {}
    with gathered:
        for chunk in chunks:
            for j, layer in enumerate(chunk.layers):
                for name, p in layer.named_parameters():
                    full = gather_full_tensor(p.detach(), p, tp_group) if tp_group is not None else p.detach()
                    if keep:
                        local[f"{chunk.start + j}/{name}"] = full.float().cpu().clone()
    everything: Optional[list] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, everything, dst=0)
    if dist.get_rank() != 0:
        return None
    model = GPT(cfg.model, tp_group=None, seed=cfg.seed)
    for part in everything:
        for key, t in part.items():
            idx, name = key.split("/", 1)
            model.layers[int(idx)].get_parameter(name).copy_(t)
    return model.eval()


@torch.no_grad()
def greedy_generate(model: GPT, prompt_ids: Sequence[int], max_new_tokens: int,
                    stop_id: Optional[int] = None) -> list[int]:
    """``prompt_ids`` followed by up to ``max_new_tokens`` argmax tokens (the context is the
    last ``seq_len`` tokens); stops early at ``stop_id``."""
    if not prompt_ids:
        raise ValueError("greedy_generate needs a non-empty prompt")
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)   # (1, n)
    vocab, window = model.cfg.vocab_size, model.cfg.seq_len
    for _ in range(max_new_tokens):
        logits = model(ids[:, -window:])                                      # (1, n, V)
        nxt = logits[0, -1, :vocab].argmax().view(1, 1)
        ids = torch.cat([ids, nxt], dim=1)
        if stop_id is not None and int(nxt) == stop_id:
            break
    return ids[0].tolist()
