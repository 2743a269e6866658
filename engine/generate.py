"""Greedy text generation from a trained engine.

The model may be split over TP, PP and (ZeRO-3) DP ranks. Generation is a small demo
step, so rank 0 runs the whole reference model on CPU with ``tp_group=NO_TP``. Its weights
arrive one parameter at a time: each TP group all-gathers a parameter, and the holder on
(dp 0, tp 0) of each later pipeline stage sends it to global rank 0 over the pp group
(point-to-point on the engine's device), which copies it into the CPU model at once. The
device memory this needs is one full parameter, not the model: an object gather of the
whole fp32 model through rank 0 (``gather_object`` stages ``max size x world`` bytes on
rank 0's GPU under NCCL) runs out of memory for any multi-billion model at the end of a
successful run. Collective: every rank calls :func:`gather_reference_model`; only rank 0
gets a model.

At ZeRO-3 without pipeline stages the model is never whole anywhere, not even for the sample:
:func:`greedy_generate_sharded` runs the same greedy loop on every rank through the engine's
own module, each unit gathered for its forward and released after it (as in training), the
vocabulary-parallel logits of the last position gathered over TP, and rank 0's token sent to
all so the ranks stay in lockstep.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence, cast

import torch
import torch.distributed as dist

from engine.distributed import comm
from engine.distributed.groups import NO_TP, AxisGroup
from engine.engine import Engine
from engine.models import GPT
from engine.pipeline.partition import layers_of
from engine.pipeline.stages import reference_layer_params, stage_bounds, whole_sequences
from engine.tensor_parallel.layers import gather_full_tensor
from engine.topology import Role
from engine.zero.stage3 import Zero3Optimizer

__all__ = ["gather_reference_model", "greedy_generate", "generates_sharded", "greedy_generate_sharded"]


def _local_full_params(chunks, tp_group) -> Iterator[tuple[int, str, torch.Tensor]]:
    """(layer index, name, full tensor) of this rank's layers in order; TP-collective."""
    for chunk in chunks:
        for j, layer in enumerate(chunk.layers):
            for name, p in layer.named_parameters():
                full = gather_full_tensor(p.detach(), p, tp_group) if tp_group.size > 1 else p.detach()
                yield chunk.start + j, name, full


@torch.no_grad()
def gather_reference_model(engine: Engine) -> Optional[GPT]:
    """The trained reference model, unsharded, fp32, on CPU on global rank 0 (None elsewhere).

    The engine's :class:`~engine.parts.ModelParts` must be the reference model's (built by
    :func:`engine.initialize` with ``model=None`` or a GPT). Collective over the whole world.
    """
    cfg, groups = engine.config, engine.groups
    chunks = engine.parts.chunks if engine.parts.reference else None
    if chunks is None or cfg.model is None:
        raise ValueError("gather_reference_model needs an engine built on the reference model "
                         "(engine.initialize with model=None or an engine.models.GPT)")
    if groups is None:
        raise RuntimeError("gather_reference_model: the engine was destroyed")
    tp_group = groups.tp_group
    holder = groups.speaks_for(Role.GRAD, Role.TP)  # sends (or, on rank 0, keeps) full tensors
    # stage 3 builds a Zero3Optimizer (the only one that gathers)
    gathered = (cast(Zero3Optimizer, engine.optimizer).gathered_params() if cfg.zero.stage == 3
                else contextlib.nullcontext())
    model = GPT(cfg.model, tp_group=NO_TP, seed=cfg.seed) if dist.get_rank() == 0 else None
    with gathered:
        for idx, name, full in _local_full_params(chunks, tp_group):
            if model is not None:
                model.layers[idx].get_parameter(name).copy_(full)
            elif holder:
                op = comm.p2p_op(dist.isend, full.contiguous(), groups.pp_ranks[0], groups.pp_group)
                for work in comm.batch_isend_irecv([op]):
                    work.wait()
        if model is not None and cfg.pp > 1:
            dtype = next(p for c in chunks for p in c.parameters()).dtype
            _receive_later_stages(model, cfg, groups, dtype, engine.device)
    return None if model is None else model.eval()


def _receive_later_stages(model: GPT, cfg, groups, dtype: torch.dtype, device: torch.device) -> None:
    """On global rank 0: every parameter of pipeline stages 1.. from its (dp 0, tp 0) holder,
    in the order it sends them (chunks, layers, named_parameters), one at a time."""
    bounds = stage_bounds(reference_layer_params(cfg.model), cfg)
    for stage in range(1, cfg.pp):
        for c in range(cfg.pipeline.virtual_stages):
            for idx in layers_of(bounds, stage, cfg.pp, c):
                for _name, target in model.layers[idx].named_parameters():
                    buf = torch.empty(target.shape, dtype=dtype, device=device)
                    op = comm.p2p_op(dist.irecv, buf, groups.pp_ranks[stage], groups.pp_group)
                    for work in comm.batch_isend_irecv([op]):
                        work.wait()
                    target.copy_(buf)


@torch.no_grad()
def greedy_generate(model: GPT, prompt_ids: Sequence[int], max_new_tokens: int,
                    stop_id: Optional[int] = None) -> list[int]:
    """``prompt_ids`` followed by up to ``max_new_tokens`` argmax tokens (the context is the
    last ``seq_len`` tokens); stops early at ``stop_id``."""
    vocab = model.cfg.vocab_size
    return _greedy(prompt_ids, max_new_tokens, stop_id, next(model.parameters()).device, model.cfg.seq_len,
                   lambda ctx: model(ctx)[0, -1, :vocab].argmax().view(1, 1))            # (1, n, V) -> (1, 1)


def _greedy(prompt_ids: Sequence[int], max_new_tokens: int, stop_id: Optional[int], device: torch.device,
            window: int, next_token: Callable[[torch.Tensor], torch.Tensor]) -> list[int]:
    """The greedy loop: ``next_token(context (1, <= window))`` -> the argmax token (1, 1)."""
    if not prompt_ids:
        raise ValueError("greedy generation needs a non-empty prompt")
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)   # (1, n)
    for _ in range(max_new_tokens):
        nxt = next_token(ids[:, -window:])
        ids = torch.cat([ids, nxt], dim=1)
        if stop_id is not None and int(nxt) == stop_id:
            break
    return ids[0].tolist()


def generates_sharded(engine: Engine) -> bool:
    """Whether the sample runs through the sharded module (:func:`greedy_generate_sharded`):
    ZeRO-3 on the reference model without pipeline stages."""
    return engine.config.zero.stage == 3 and engine.config.pp == 1 and engine.parts.reference


@torch.no_grad()
def greedy_generate_sharded(engine: Engine, prompt_ids: Sequence[int], max_new_tokens: int,
                            stop_id: Optional[int] = None) -> list[int]:
    """:func:`greedy_generate` on every rank through the engine's module (``pp == 1``; at
    ZeRO-3 each unit is gathered for its forward and released after it, so no rank holds
    more than its shards plus the units in use). Collective over the whole world; every rank
    returns the same ids."""
    cfg, groups = engine.config, engine.groups
    if cfg.model is None or cfg.pp != 1 or groups is None:
        raise ValueError("greedy_generate_sharded needs a live engine on the reference model without pipeline stages")
    module, device = engine.module, engine.device
    world, vocab, tp = AxisGroup.world(), cfg.model.vocab_size, groups.tp_group

    def next_token(ctx: torch.Tensor) -> torch.Tensor:
        last = module(ctx)[0, -1].contiguous()                                  # (V_pad/tp,)
        if tp.size > 1:
            full = torch.empty(last.numel() * tp.size, dtype=last.dtype, device=device)
            comm.all_gather(full, last, tp)                                      # (V_pad,)
            last = full
        nxt = last[:vocab].argmax().view(1, 1)
        comm.broadcast(nxt, 0, world)  # the same on every rank; rank 0's keeps them in lockstep
        return nxt

    was_training = module.training
    module.eval()
    try:
        with whole_sequences(engine.parts.chunks):  # under CP every rank runs the whole (short) context
            return _greedy(prompt_ids, max_new_tokens, stop_id, device, cfg.model.seq_len, next_token)
    finally:
        module.train(was_training)
