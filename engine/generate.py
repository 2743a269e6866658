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

The model is never whole anywhere for the sample at ZeRO-3 or with pipeline stages:
:func:`greedy_generate_sharded` runs the same greedy loop on every rank through the engine's
own module (``pp == 1``) or chunks (``pp > 1``: each model stage runs on the rank that holds
it and sends its hidden states (1, n, H) to the next one, as a forward-only pipeline of one
micro-batch), each ZeRO-3 unit gathered for its forward and released after it (as in
training), the vocabulary-parallel logits of the last position gathered over TP, and the
token sent to all so the ranks stay in lockstep. :func:`gather_reference_model` remains for
the one layout that path does not run (pipeline stages with sequence parallelism, whose
boundary is cut along the sequence); at ZeRO-3 it gathers one unit at a time.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from engine.distributed import comm
from engine.distributed.groups import NO_TP, AxisGroup
from engine.engine import Engine
from engine.models import GPT
from engine.pipeline.partition import layers_of
from engine.pipeline.schedule import placement_of, stage_index
from engine.pipeline.stages import reference_layer_params, stage_bounds, whole_sequences
from engine.tensor_parallel.layers import gather_full_tensor
from engine.topology import Role
from engine.zero.init import GatheredParameters

__all__ = ["gather_reference_model", "greedy_generate", "generates_sharded", "greedy_generate_sharded"]


def _local_full_params(chunks, tp_group) -> Iterator[tuple[int, str, torch.Tensor]]:
    """(layer index, name, full tensor) of this rank's layers in order; TP-collective. A
    ZeRO-3 parameter is gathered over DP for its turn only (one parameter's bucket at a time,
    every DP rank in the same order), never the whole stage."""
    for chunk in chunks:
        for j, layer in enumerate(chunk.layers):
            for name, p in layer.named_parameters():
                with GatheredParameters([p]):  # a no-op for a parameter that is not partitioned
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
    model = GPT(cfg.model, tp_group=NO_TP, seed=cfg.seed) if dist.get_rank() == 0 else None
    for idx, name, full in _local_full_params(chunks, tp_group):
        if model is not None:
            model.layers[idx].get_parameter(name).copy_(full)
        elif holder:
            op = comm.p2p_op(dist.isend, full.contiguous(), groups.pp_ranks[0], groups.pp_group)
            for work in comm.batch_isend_irecv([op]):
                work.wait()
    if model is not None and cfg.pp > 1:
        _receive_later_stages(model, cfg, groups, engine.parts.dtype, engine.device)
    return None if model is None else model.eval()


def _receive_later_stages(model: GPT, cfg, groups, dtype: torch.dtype, device: torch.device) -> None:
    """On global rank 0: every parameter of pipeline stages 1.. from its (dp 0, tp 0) holder,
    in the order it sends them (chunks, layers, named_parameters), one at a time."""
    bounds = stage_bounds(reference_layer_params(cfg.model), cfg)
    for stage in range(1, cfg.pp):
        for c in range(cfg.pipeline.virtual_stages):
            for idx in layers_of(bounds, stage, cfg.pp, c, placement_of(cfg.pipeline.schedule)):
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
    the reference model at ZeRO-3 or with pipeline stages (not with sequence parallelism
    across pipeline stages: :func:`gather_reference_model` then)."""
    cfg = engine.config
    if not engine.parts.reference:
        return False
    if cfg.pp == 1:
        return cfg.zero.stage == 3
    return not (cfg.tensor_parallel.sequence_parallel and cfg.tp > 1)


@torch.no_grad()
def greedy_generate_sharded(engine: Engine, prompt_ids: Sequence[int], max_new_tokens: int,
                            stop_id: Optional[int] = None) -> list[int]:
    """:func:`greedy_generate` on every rank through the engine's module (``pp == 1``) or its
    pipeline chunks (:func:`generates_sharded`); at ZeRO-3 each unit is gathered for its
    forward and released after it, so no rank holds more than its shards plus the units in
    use. Collective over the whole world; every rank returns the same ids."""
    cfg, groups = engine.config, engine.groups
    if cfg.model is None or groups is None or not generates_sharded(engine):
        raise ValueError("greedy_generate_sharded needs a live engine on the reference model at ZeRO-3 or with "
                         "pipeline stages (not sequence parallelism across stages): see generates_sharded")
    module, device = engine.module, engine.device
    world, vocab, tp = AxisGroup.world(), cfg.model.vocab_size, groups.tp_group
    masking = cfg.data.document_masking

    def token_of(last: torch.Tensor) -> torch.Tensor:
        """(V_pad/tp,) logits of the last position -> the argmax token (1, 1); TP-collective."""
        if tp.size > 1:
            full = torch.empty(last.numel() * tp.size, dtype=last.dtype, device=device)
            comm.all_gather(full, last.contiguous(), tp)                         # (V_pad,)
            last = full
        return last[:vocab].argmax().view(1, 1)

    def next_token(ctx: torch.Tensor) -> torch.Tensor:
        doc = torch.zeros_like(ctx) if masking else None  # the prompt is one document
        if cfg.pp > 1:
            nxt = _pipeline_next_token(engine, ctx, doc, token_of)
        else:
            nxt = token_of(module(ctx, doc_ids=doc)[0, -1])
        comm.broadcast(nxt, 0, world)  # the same on every rank; rank 0's keeps them in lockstep
        return nxt

    was_training = module.training
    module.eval()
    try:
        with whole_sequences(engine.parts.chunks):  # under CP every rank runs the whole (short) context
            return _greedy(prompt_ids, max_new_tokens, stop_id, device, cfg.model.seq_len, next_token)
    finally:
        module.train(was_training)


def _pipeline_next_token(engine: Engine, ctx: torch.Tensor, doc: Optional[torch.Tensor],
                         token_of: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One forward of ``ctx`` (1, n) through the pipeline: model stage k runs on the rank
    holding it, which receives the hidden states (1, n, H) from the holder of stage k-1 and
    sends its own to the holder of k+1 (p2p over the pp group, blocking, in stage order on
    every rank); the last stage's holder picks the argmax token (1, 1) and broadcasts it over
    the pp group, so every rank returns it."""
    cfg, groups = engine.config, engine.groups
    assert cfg.model is not None and groups is not None  # checked by greedy_generate_sharded
    pp, v, me = cfg.pp, cfg.pipeline.virtual_stages, groups.pp_rank
    holder = {stage_index(cfg.pipeline.schedule, r, c, pp, v): (r, c) for r in range(pp) for c in range(v)}
    shape = (1, ctx.shape[1], cfg.model.hidden_size)
    chunks = engine.parts.chunks
    x = ctx
    for k in range(pp * v):
        rank, chunk = holder[k]
        prev = holder[k - 1][0] if k > 0 else rank
        if rank == me:
            if prev != me:
                x = torch.empty(shape, dtype=engine.parts.dtype, device=engine.device)
                _p2p(dist.irecv, x, groups.pp_ranks[prev], groups.pp_group)
            x = chunks[chunk](x, doc)                     # (1, n, H), the last stage (1, n, V_pad/tp)
        elif prev == me:
            _p2p(dist.isend, x.contiguous(), groups.pp_ranks[rank], groups.pp_group)
    last = holder[pp * v - 1][0]
    nxt = token_of(x[0, -1]) if me == last else torch.zeros(1, 1, dtype=torch.long, device=engine.device)
    comm.broadcast(nxt, groups.pp_ranks[last], groups.pp_group)
    return nxt


def _p2p(op, t: torch.Tensor, peer: int, group: AxisGroup) -> None:
    for work in comm.batch_isend_irecv([comm.p2p_op(op, t, peer, group)]):
        work.wait()
