"""What a rank trains: the reference GPT (or a user's list of stage layers) cut into this
rank's pipeline chunk(s) and tensor-parallel shard.

- :func:`stage_bounds`: where the layer list ``[embedding, block_0 .. block_{L-1}, head]``
  is cut (``pipeline.partition``), from per-layer parameter counts;
- :func:`build_reference_chunks`: this rank's chunks of the reference model, built
  directly at their TP shard (the initialisation depends only on the seed, so the model is
  the same whatever (dp, tp, pp));
- :func:`load_full_weights`: copy a whole (unsharded) GPT's weights into this rank's shards;
- :func:`chunks_from_layers`: a user's list of layers cut the same way, with a parameter
  shared by the first and last stage (a tied embedding) split into a marked copy;
- :class:`StageChunk`: a contiguous run of layers, optionally activation-checkpointed.

Config features honoured here: ``data.document_masking`` (every forward takes the
micro-batch's document ids, ``doc_ids=`` (B, S); the blocks get the document-causal mask and
per-document rotary positions) and ``fp8.enabled`` (the blocks' linear layers run FP8 GEMMs
with the config's recipe; the embedding and LM head stay bf16; the engine renews the
scales once per optimizer step).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.nn as nn

from engine.config import Config
from engine.context_parallel.layout import CPLayout
from engine.distributed.groups import NO_TP, AxisGroup
from engine.errors import ConfigError
from engine.models import GPT, ModelConfig, build_stage_layers, num_stage_layers
from engine.models.attention import AttnMask
from engine.models.blocks import attention_inputs, cp_attention_inputs, forward_layers
from engine.models.gpt import block_param_count
from engine.models.recompute import (
    RecomputeOptions,
    RecomputePolicy,
    apply_selective,
    full_units,
    maybe_offload,
    policy_from_config,
    recompute,
)
from engine.moe.context import LOCAL_MOE, MoEContext
from engine.pipeline.actions import stage_and_chunk
from engine.pipeline.partition import layers_of, partition_layers
from engine.pipeline.schedule import placement_of as schedule_placement
from engine.placement import placement_of, set_placement
from engine.precision.fp8 import fp8_recipe_from_config, fp8_states
from engine.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from engine.tensor_parallel.layers import shard_tensor
from engine.tensor_parallel.mappings import tp_rank, tp_world_size

__all__ = ["StageChunk", "ReferenceModel", "reference_layer_params", "stage_bounds", "build_reference_chunks",
           "check_layer_support",
           "load_full_weights", "chunks_from_layers", "check_reference_support", "check_doc_ids", "whole_sequences"]


logger = logging.getLogger(__name__)


class StageChunk(nn.Module):
    """Layers ``[start, start + len(layers))`` of the model's layer list, run in order.

    ``recompute``: the activation-checkpointing policy of the blocks (layers that are
    neither the embedding nor the head; :mod:`engine.models.recompute`): full recompute
    units, offload of saved tensors to the host (selective parts are marked on the blocks
    themselves by :func:`build_reference_chunks`); ``tp_group``: where ``partition_activations``
    shards a unit's input. ``checkpoint_interval > 0`` (``pipeline.activation_checkpoint_interval``)
    without a policy is full recompute in runs of that many blocks. Recomputation is exact
    (bit-identical outputs and gradients).

    ``forward(x, doc_ids=None, attn_mask=None, position_ids=None)``: the optional attention
    inputs (``engine.models.blocks.attention_inputs``) are built once and given to every
    block of the chunk; ``doc_ids`` (B, S) is what reaches every pipeline stage (data side).
    ``document_masking`` (``data.document_masking``; None: not checked): every forward must
    give ``doc_ids`` when True and must not when False (config and data must agree).

    ``cp``: context parallelism (``context_parallel.size`` > 1): ``x`` holds this rank's
    head-tail shard of the sequence (B, S/C) and every forward gets ``positions`` (B, S/C),
    the shard's global positions (and, with ``doc_ids``, ``position_ids``: its per-document
    positions); the blocks attend across the CP group
    (:func:`engine.models.blocks.cp_attention_inputs`). Without ``cp``, ``positions`` is an error.
    """

    def __init__(self, layers: Sequence[nn.Module], start: int, num_layers_total: int,
                 checkpoint_interval: int = 0, document_masking: Optional[bool] = None,
                 cp: Optional[CPLayout] = None, recompute: Optional[RecomputePolicy] = None,
                 tp_group: AxisGroup = NO_TP, inputs_may_change: bool = False) -> None:
        super().__init__()
        # a user's layers may work in place on their input (nn.ReLU(inplace=True)): the pipeline
        # executor and the checkpointed segments then run them on a copy; our blocks never do
        self.inputs_may_change = inputs_may_change
        if recompute is None and checkpoint_interval > 0:
            recompute = RecomputePolicy("full", num_layers=checkpoint_interval)
        self.recompute = recompute
        part = recompute is not None and recompute.partition_activations
        self.recompute_options = RecomputeOptions(partition=tp_group if part else NO_TP)
        self.cp = cp
        self.document_masking = document_masking
        self.layers = nn.ModuleList(layers)
        self.start = start
        self.is_first = start == 0
        self.is_last = start + len(layers) == num_layers_total
        uniform = recompute is not None and recompute.granularity == "full" and recompute.method == "uniform"
        self.checkpoint_interval = recompute.num_layers if recompute is not None and uniform else 0

    def _run(self, lo: int, hi: int, x: torch.Tensor, mask: Optional[AttnMask] = None,
             pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        return forward_layers(self.layers[lo:hi], x, mask, pos)

    def _run_segment(self, lo: int, hi: int, x: torch.Tensor, mask: Optional[AttnMask] = None,
                     pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A checkpointed run of layers. ``inputs_may_change`` (a user's layers, which may
        work in place on their input): the run starts from a copy, so the input the checkpoint
        keeps for the recomputation is not changed (a transient copy, not saved)."""
        return self._run(lo, hi, x.clone() if self.inputs_may_change else x, mask, pos)

    def forward(self, x: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                attn_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.document_masking is not None:
            check_doc_ids(doc_ids, self.document_masking)
        mask: Optional[AttnMask]
        pos: Optional[torch.Tensor]
        if self.cp is not None:
            if attn_mask is not None:
                raise ValueError("attn_mask cannot be combined with context parallelism: the mask is causal or "
                                 "document-causal (data.document_masking)")
            mask, pos = cp_attention_inputs(self.cp, positions, doc_ids, position_ids)  # CP mask, (B, S/C)
        elif positions is not None:
            raise ValueError("this forward got sequence-shard positions but context parallelism is off "
                             "(context_parallel.size 1): feed whole sequences")
        else:
            mask, pos = attention_inputs(None, doc_ids, attn_mask, position_ids)  # AttnMask, (B, S)
        n = len(self.layers)
        policy = self.recompute
        if policy is None or not policy.active or not torch.is_grad_enabled():
            return self._run(0, n, x, mask, pos)
        lo = 1 if self.is_first else 0                 # the embedding takes integer ids: not checkpointed
        hi = n - 1 if self.is_last else n              # nor the head (its logits are needed anyway)
        x = self._run(0, lo, x)
        with maybe_offload(policy, x.device):          # cpu_checkpointing: saved tensors to the host
            for a, b, unit in full_units(policy, lo, hi):
                if unit:  # x: (B, S, H) ((B, S/tp, H) under SP), the one tensor the unit keeps
                    x = recompute(self._run_segment, a, b, x, mask, pos, options=self.recompute_options)
                else:
                    x = self._run(a, b, x, mask, pos)
        return self._run(hi, n, x)


class ReferenceModel(nn.Module):
    """The whole model as one chunk (``pp == 1``), called like :class:`engine.models.GPT`:
    ``forward(ids)`` -> logits (B, S, V_pad/tp); ``forward(ids, targets)`` -> mean
    vocab-parallel cross-entropy (so the DeepSpeed loop works with TP too).
    ``doc_ids`` (B, S): the packed rows' document ids (``data.document_masking``; the chunk
    checks that config and data agree). Under context parallelism ``ids``/``targets`` are the
    rank's (B, S/C) shards with their ``positions`` (and ``position_ids``; :class:`StageChunk`)."""

    def __init__(self, chunk: StageChunk, tp_group: AxisGroup) -> None:
        super().__init__()
        self.chunk = chunk
        self.tp_group = tp_group

    def forward(self, ids: torch.Tensor, targets: Optional[torch.Tensor] = None, *,
                doc_ids: Optional[torch.Tensor] = None, ignore_index: int = -100,
                positions: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        logits = self.chunk(ids, doc_ids, position_ids=position_ids, positions=positions)
        if targets is None:
            return logits
        return vocab_parallel_cross_entropy(logits, targets, self.tp_group, ignore_index=ignore_index)


@contextlib.contextmanager
def whole_sequences(chunks: Sequence[StageChunk]) -> Iterator[None]:
    """Run ``chunks`` on whole sequences inside the block although context parallelism is on
    (the sampler's short prompts: every CP rank computes the same tokens, their parameters
    being copies). Explicit, never a fallback: outside it a CP chunk without positions raises."""
    saved = [c.cp for c in chunks]
    for c in chunks:
        c.cp = None
    try:
        yield
    finally:
        for c, cp in zip(chunks, saved):
            c.cp = cp


def reference_layer_params(cfg: ModelConfig) -> list[int]:
    """Parameter count of each entry of the reference layer list (the head counts its
    vocabulary matrix even when tied: the last stage holds a copy of it)."""
    v, h = cfg.vocab_size, cfg.hidden_size
    return [v * h] + [block_param_count(cfg, i) for i in range(cfg.num_layers)] + [h + v * h]


def stage_bounds(layer_params: Sequence[int], cfg: Config) -> list[int]:
    """Boundaries of the ``pp * virtual_stages`` pieces (``pipeline.partition``)."""
    return partition_layers(list(layer_params), cfg.pp * cfg.pipeline.virtual_stages, cfg.pipeline.partition)


def check_doc_ids(doc_ids: Optional[torch.Tensor], document_masking: bool) -> None:
    """A micro-batch's document ids must be there exactly when ``data.document_masking`` is on."""
    if document_masking and doc_ids is None:
        raise ValueError("data.document_masking is true but this micro-batch has no document ids: feed "
                         "engine.data batches built with document_masking=True (launch/train.py does), or pass "
                         "doc_ids=(B, S); or set data.document_masking to false")
    if not document_masking and doc_ids is not None:
        raise ValueError("this micro-batch carries document ids but data.document_masking is false: set it to "
                         "true to keep attention inside documents, or build the data without document_masking")


def check_reference_support(cfg: Config) -> None:
    """Config features the reference model cannot honour: an error, never a silent no-op
    (none left: activation_checkpointing is honoured in full, engine.models.recompute)."""


def build_reference_chunks(cfg: Config, pp_rank: int, tp_group: AxisGroup, *, device: torch.device,
                           dtype: torch.dtype, cp: Optional[CPLayout] = None,
                           moe: MoEContext = LOCAL_MOE) -> list[StageChunk]:
    """This rank's chunk(s) of the reference GPT (one per virtual stage), TP-sharded; with
    ``fp8.enabled`` the blocks' linear layers are FP8 (embedding and LM head stay bf16);
    ``cp``: this rank's context-parallel layout (``context_parallel.size`` > 1); ``moe``: the
    groups of the MoE layers (``model.moe``; engine.moe.wiring.moe_context)."""
    check_reference_support(cfg)
    model = cfg.model
    assert model is not None  # the reference GPT is built only from a config with a model section
    total = num_stage_layers(model)
    bounds = stage_bounds(reference_layer_params(model), cfg)
    recipe = fp8_recipe_from_config(cfg.fp8)
    if recipe is not None:
        logger.info("FP8 GEMMs in the blocks' linear layers (recipe %s, format %s); embedding and LM head in %s",
                    recipe.scaling, recipe.fp8_format, dtype)
    chunks = []
    placement = schedule_placement(cfg.pipeline.schedule)
    for c in range(cfg.pipeline.virtual_stages):
        rng = layers_of(bounds, pp_rank, cfg.pp, c, placement)
        layers = build_stage_layers(model, tp_group, sequence_parallel=cfg.tensor_parallel.sequence_parallel,
                                    seed=cfg.seed, start=rng.start, stop=rng.stop, device=device, dtype=dtype,
                                    fp8_recipe=recipe, moe=moe)
        policy = policy_from_config(cfg)
        if policy.granularity == "selective":
            for block in layers:
                if getattr(block, "takes_attention_inputs", False):
                    apply_selective(block, policy.modules)
        chunks.append(StageChunk(layers, rng.start, total, document_masking=cfg.data.document_masking, cp=cp,
                                 recompute=policy, tp_group=tp_group))
    if model.tie_embeddings and chunks[0].is_first and chunks[-1].is_last and len(chunks) > 1:
        # V placement: the embedding (chunk 0) and the head (chunk 1) are on this rank, so the
        # head uses the embedding's very parameter (as in one process) instead of a copy to sync
        head = chunks[-1].layers[-1]
        head.weight = chunks[0].layers[0].weight
    return chunks


@torch.no_grad()
def load_full_weights(chunks: Sequence[StageChunk], full: GPT, tp_group: AxisGroup) -> None:
    """Copy the unsharded ``full`` model's weights into ``chunks`` (this rank's TP shard of
    each parameter, this rank's experts of an expert shard; padded vocabulary rows stay zero)."""
    world, rank = tp_world_size(tp_group), tp_rank(tp_group)
    for chunk in chunks:
        for j, layer in enumerate(chunk.layers):
            src_layer = full.layers[chunk.start + j]
            for name, p in layer.named_parameters():
                src = src_layer.get_parameter(name).detach().to(torch.float32).cpu()
                experts = placement_of(p).expert
                if experts is not None:  # rows [first, first + count) of the stacked experts
                    src = src[experts.first:experts.first + experts.count]
                shard = placement_of(p).tp
                if shard is not None:
                    dim = shard.dim
                    if shard.unpadded_size is not None:  # pad the vocabulary to V_pad before slicing
                        extra = p.shape[dim] * world - src.shape[dim]
                        pad_shape = list(src.shape)
                        pad_shape[dim] = extra
                        src = torch.cat([src, src.new_zeros(pad_shape)], dim=dim)
                    src = shard_tensor(src, dim, rank, world, shard.fused_parts)
                if src.shape != p.shape:
                    raise ValueError(f"layer {chunk.start + j} parameter {name}: the given model has shape "
                                     f"{tuple(src.shape)} where this rank's shard needs {tuple(p.shape)}")
                p.copy_(src)


def chunks_from_layers(layers: Sequence[nn.Module], cfg: Config, pp_rank: int, *,  # noqa: PLR0913
                       bounds: Optional[Sequence[int]] = None, checkpoint_interval: Optional[int] = None,
                       checked: bool = False) -> tuple[list[StageChunk], list[nn.Parameter]]:
    """A user's layer list (``tp == 1``) cut into this rank's chunk(s).

    ``bounds``: the cut (``pp * virtual_stages`` pieces; default: ``pipeline.partition`` over
    the parameter counts); ``checkpoint_interval``: default ``pipeline.activation_checkpoint_interval``.

    Returns ``(chunks, tied)``: a parameter used by layers on both the first and the last
    pipeline stage (a tied embedding/head) stays the original on the first stage and
    becomes a marked copy on the last (``tied`` lists it on both, for the gradient sum over
    the embedding group). Sharing between any other stages is an error.
    """
    layers = list(layers)
    if not checked:  # (``checked``: the caller ran the checks on the whole model, e.g. a PipelineModule's specs)
        _check_layers(layers, cfg)
    if bounds is None:
        bounds = stage_bounds([sum(p.numel() for p in m.parameters()) for m in layers], cfg)
    elif len(bounds) != cfg.pp * cfg.pipeline.virtual_stages + 1:
        raise ValueError(f"bounds cut {len(bounds) - 1} pieces, the pipeline has "
                         f"{cfg.pp * cfg.pipeline.virtual_stages}")
    interval = cfg.pipeline.activation_checkpoint_interval if checkpoint_interval is None else checkpoint_interval
    placement = schedule_placement(cfg.pipeline.schedule)
    shared = _shared_across_stages(layers, bounds, cfg.pp, placement)
    # first layer using each shared parameter, taken before the last stage swaps in its copies
    # (a module shared by two layers, e.g. a TiedLayerSpec, gets the copy in both places)
    first_use = {pid: min(i for i, m in enumerate(layers) if any(id(q) == pid for q in m.parameters()))
                 for pid in shared}
    chunks, tied = [], []
    copies: dict[int, nn.Parameter] = {}
    for c in range(cfg.pipeline.virtual_stages):
        rng = layers_of(bounds, pp_rank, cfg.pp, c, placement)
        mine = layers[rng.start:rng.stop]
        if shared and pp_rank == cfg.pp - 1 and cfg.pp > 1:  # (V placement: nothing shared across ranks)
            _swap_in_tied_copies(mine, shared, copies)
        chunks.append(StageChunk(mine, rng.start, len(layers), document_masking=cfg.data.document_masking,
                                 recompute=policy_from_config(cfg, interval), inputs_may_change=True))
    if cfg.pp > 1:
        local = {id(p): p for ch in chunks for p in ch.parameters()}
        order = sorted(shared, key=lambda pid: first_use[pid])
        for pid in order:
            p = copies[pid] if pid in copies else local.get(pid)
            if p is not None:
                tied.append(p)
    return chunks, tied


def _check_layers(layers: list[nn.Module], cfg: Config) -> None:
    """The layer list is usable with this config (document masking and FP8 need layers that support them)."""
    if not layers or not all(isinstance(m, nn.Module) for m in layers):
        raise TypeError("model must be a non-empty list of nn.Module layers")
    check_layer_support(cfg, lambda test: any(test(m) for m in layers))


def check_layer_support(cfg: Config, any_layer: Callable[[Callable[[nn.Module], object]], bool]) -> None:
    """Document masking and FP8 need some layer that supports them; ``any_layer(test)``
    answers for the whole model (every rank the same answer). Selective recompute names parts
    of the reference model's blocks, which a user's layers do not have."""
    if cfg.activation_checkpointing.granularity == "selective":
        raise ConfigError("activation_checkpointing.granularity \"selective\" names parts of the reference model's "
                          "blocks (activation_checkpointing.modules); a model given as a list of layers has none: use "
                          "\"full\" (whole layers recomputed), or deepspeed.checkpointing.checkpoint inside them")
    if cfg.data.document_masking and not any_layer(lambda m: getattr(m, "takes_attention_inputs", False)):
        raise ConfigError("data.document_masking: none of the given layers takes an attention mask (layers with "
                          "takes_attention_inputs = True get attn_mask= and position_ids=, like "
                          "engine.models' blocks); set data.document_masking to false")
    if cfg.fp8.enabled and not any_layer(fp8_states):
        raise ConfigError("fp8.enabled: the given layers hold no FP8 layer (only the reference model's blocks "
                          "are made FP8 from the config; use engine.precision.fp8.Fp8Linear in your layers), "
                          "or set fp8.enabled to false")


def _shared_across_stages(layers: list[nn.Module], bounds: Sequence[int], pp: int,
                          placement: str = "loop") -> set[int]:
    """ids of the parameters used by layers on more than one pipeline rank (piece ``k`` is on
    rank ``k % pp`` in the loop placement; in V placement the first and last piece are both on
    rank 0, so a tied embedding and head is one parameter there); only the first and the last
    stage may share one."""
    owner: dict[int, set[int]] = {}
    for k in range(len(bounds) - 1):
        rank = stage_and_chunk(k, pp, placement)[0]
        for m in layers[bounds[k]:bounds[k + 1]]:
            for p in m.parameters():
                owner.setdefault(id(p), set()).add(rank)
    shared = {pid for pid, ranks in owner.items() if len(ranks) > 1}
    for pid in shared:
        if owner[pid] != {0, pp - 1}:
            raise ConfigError(f"a parameter is shared by layers on pipeline stages {sorted(owner[pid])}: only "
                              "the first and the last stage may share one (a tied embedding and head)")
    return shared


def _swap_in_tied_copies(mine: list[nn.Module], shared: set[int], copies: dict[int, nn.Parameter]) -> None:
    """On the last stage: each shared parameter in ``mine`` replaced by its marked copy (made once, in ``copies``)."""
    for m in mine:
        for mod in m.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None and id(p) in shared:
                    if id(p) not in copies:
                        copies[id(p)] = nn.Parameter(p.detach().clone())
                        # the copy is laid out like the original (a new tensor carries no placement)
                        set_placement(copies[id(p)], replace(placement_of(p), tied_copy=True))
                    mod._parameters[name] = copies[id(p)]
