"""The reference GPT/Llama-style decoder, as a list of stage layers.

``build_stage_layers(cfg, tp_group)`` returns ``[embedding, block_0 .. block_{L-1}, head]``
(``num_stage_layers(cfg) = L + 2`` entries); a pipeline gives stage k a slice of it
(build only that slice with ``start``/``stop``). Contract of the list:

- layer 0, ``VocabParallelEmbedding``: token ids (B, S) int64 -> hidden (B, S, H);
- blocks: hidden -> hidden;
- last, ``FinalNormAndHead``: hidden -> logits (B, S, V_pad/tp), this TP rank's slice of
  the vocabulary; padded vocabulary columns (V_pad = V rounded up to the TP degree) are
  -inf. With TP=1 they are the full logits (B, S, V).

Hidden states are batch first. With ``sequence_parallel`` the hidden states between
layers are (B, S/tp, H): TP rank r holds positions ``[r*S/tp, (r+1)*S/tp)``.

Blocks also take optional attention inputs (``attn_mask``, ``position_ids``; see
``blocks.attention_inputs``): :func:`forward_layers` passes them to the blocks only.
``fp8_recipe`` makes the blocks' linear layers FP8; the embedding and the LM head stay in
the model dtype (as Transformer Engine recipes keep them).

``GPT`` is exactly the composition of that list (``GPT.layers``), a plain ``nn.Module``
that needs no torch.distributed when ``tp_group=NO_TP`` (the default). Every weight is drawn from
``(seed, its name)`` (block weights by block index), so the model is identical whatever
the TP degree, the pipeline split and the construction order.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Union, cast

import torch
import torch.nn as nn

from engine.distributed.groups import NO_TP, AxisGroup
from engine.errors import ConfigError
from engine.models.blocks import Block, RMSNorm, RotaryEmbedding, attention_inputs, forward_layers, moe_mlp
from engine.models.config import ModelConfig
from engine.moe.context import LOCAL_MOE, MoEContext
from engine.placement import placement_of, set_placement
from engine.precision.fp8 import Fp8Recipe
from engine.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from engine.tensor_parallel.layers import (
    NormalInit,
    VocabParallelEmbedding,
    vocab_parallel_logits,
    vocab_parallel_weight,
)
from engine.tensor_parallel.mappings import tp_world_size

__all__ = ["GPT", "FinalNormAndHead", "build_stage_layers", "num_stage_layers",
           "param_count", "block_param_count", "flops_per_token", "vocab_parallel_cross_entropy"]

Device = Optional[Union[torch.device, str]]
Dtype = Optional[torch.dtype]

EMBEDDING_KEY = "embedding"  # init key of the embedding, and of a tied head's own copy
HEAD_KEY = "head"            # init key of an untied head


class FinalNormAndHead(nn.Module):
    """Final RMSNorm and the vocab-parallel LM head: hidden (B, S, H) (or (B, S/tp, H))
    -> logits (B, S, V_pad/tp).

    ``tied_weight``: the embedding's weight, when the embedding lives in the same process
    (the head then uses that very parameter). With ``cfg.tie_embeddings`` and no
    ``tied_weight`` (embedding on another pipeline stage) the head holds its own copy,
    initialised identically to the embedding and placed as a ``tied_copy``; keeping
    it in sync (summing the two gradients over the embedding group) is the pipeline's job.
    """

    def __init__(self, cfg: ModelConfig, tp_group: AxisGroup = NO_TP, sequence_parallel: bool = False,
                 seed: int = 1234, tied_weight: Optional[nn.Parameter] = None, device: Device = None, dtype: Dtype = None) -> None:
        super().__init__()
        if tied_weight is not None and not cfg.tie_embeddings:
            raise ConfigError("FinalNormAndHead got a tied_weight but model.tie_embeddings is false")
        self.tp_group = tp_group
        self.vocab_size = cfg.vocab_size
        self.sequence_parallel = sequence_parallel and tp_world_size(tp_group) > 1
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, tp_group, sequence_parallel, device, dtype)
        if tied_weight is not None:
            self.weight = tied_weight                                     # (V_pad/tp, H), shared
        else:
            key = EMBEDDING_KEY if cfg.tie_embeddings else HEAD_KEY
            self.weight = vocab_parallel_weight(cfg.vocab_size, cfg.hidden_size, tp_group,
                                                init=NormalInit(cfg.init_std, seed, key),
                                                device=device, dtype=dtype)
            if cfg.tie_embeddings:
                set_placement(self.weight, replace(placement_of(self.weight), tied_copy=True))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(self.norm(h), self.weight, self.tp_group, self.vocab_size,
                                     sequence_parallel=self.sequence_parallel)


def num_stage_layers(cfg: ModelConfig) -> int:
    """Length of the stage-layer list: embedding + num_layers blocks + head."""
    return cfg.num_layers + 2


def build_stage_layers(cfg: ModelConfig, tp_group: AxisGroup = NO_TP, *, sequence_parallel: bool = False,
                       seed: int = 1234, start: int = 0, stop: Optional[int] = None,
                       device: Device = None, dtype: Dtype = None,
                       fp8_recipe: Optional[Fp8Recipe] = None, moe: MoEContext = LOCAL_MOE) -> list[nn.Module]:
    """Layers ``[start, stop)`` of ``[embedding, block_0 .. block_{L-1}, head]``.

    Building a slice gives the same parameters as slicing the full list (seeds are per
    layer), except that a tied head built without the embedding holds its own marked copy.
    ``fp8_recipe``: the blocks' linear layers run their GEMMs in FP8 (not the embedding/head).
    ``moe``: the groups of the MoE layers (``model.moe``; engine.moe.context), default all local.
    """
    total = num_stage_layers(cfg)
    stop = total if stop is None else stop
    if not 0 <= start < stop <= total:
        raise ValueError(f"stage layer range [{start}, {stop}) must be non-empty and within [0, {total}) "
                         f"(embedding + {cfg.num_layers} blocks + head)")
    tp = tp_world_size(tp_group)
    cfg.check_parallel(tp, 1)
    if sequence_parallel and tp > 1 and cfg.seq_len % tp:
        raise ConfigError(f"sequence parallelism splits the sequence over the TP group: model.seq_len "
                          f"({cfg.seq_len}) must be divisible by the TP degree {tp}")
    rotary = None
    if start <= cfg.num_layers and stop > 1:  # at least one block: one rotary table shared by all
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.seq_len, device=device)
    layers: list[nn.Module] = []
    for i in range(start, stop):
        if i == 0:
            layers.append(VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_group,
                                                 init=NormalInit(cfg.init_std, seed, EMBEDDING_KEY),
                                                 sequence_parallel=sequence_parallel, device=device, dtype=dtype))
        elif i <= cfg.num_layers:
            assert rotary is not None  # built above whenever the range holds a block
            layers.append(Block(cfg, i - 1, tp_group, sequence_parallel, seed, rotary, device, dtype,
                                fp8_recipe=fp8_recipe,
                                mlp=moe_mlp(moe) if cfg.moe is not None and cfg.moe.is_moe_layer(i - 1) else None))
        else:
            tied = cast(VocabParallelEmbedding, layers[0]).weight if (cfg.tie_embeddings and start == 0) else None
            layers.append(FinalNormAndHead(cfg, tp_group, sequence_parallel, seed, tied, device, dtype))
    return layers


class GPT(nn.Module):
    """The whole decoder: ``GPT.layers`` is ``build_stage_layers(cfg, ...)``.

    ``forward(ids (B, S))`` returns the logits (B, S, V_pad/tp) (see the module docstring);
    ``forward(ids, targets (B, S))`` returns the mean cross-entropy over the tokens whose
    target is not ``ignore_index``, computed without gathering the logits.

    Packed documents: ``forward(ids, doc_ids=(B, S))`` keeps attention inside each document
    and restarts rotary positions per document, so every document gets the logits it would
    get alone; or give ``attn_mask`` (B, 1, S, S) bool and/or ``position_ids`` (B, S).
    """

    def __init__(self, cfg: ModelConfig, tp_group: AxisGroup = NO_TP, sequence_parallel: bool = False,
                 seed: int = 1234, *, device: Device = None, dtype: Dtype = None,
                 fp8_recipe: Optional[Fp8Recipe] = None, moe: MoEContext = LOCAL_MOE) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.layers = nn.ModuleList(build_stage_layers(cfg, tp_group, sequence_parallel=sequence_parallel,
                                                       seed=seed, device=device, dtype=dtype,
                                                       fp8_recipe=fp8_recipe, moe=moe))

    def forward(self, ids: torch.Tensor, targets: Optional[torch.Tensor] = None, *,
                doc_ids: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, ignore_index: int = -100) -> torch.Tensor:
        if ids.dim() != 2:
            raise ValueError(f"GPT expects token ids of shape (batch, seq), got {tuple(ids.shape)}")
        mask, pos = attention_inputs(ids.shape[1], doc_ids, attn_mask, position_ids)
        h = forward_layers(self.layers, ids, mask, pos)
        if targets is None:
            return h
        return vocab_parallel_cross_entropy(h, targets, self.tp_group, ignore_index=ignore_index)


def _attn_params(cfg: ModelConfig) -> int:
    h, d = cfg.hidden_size, cfg.head_dim
    return h * cfg.num_heads * d + 2 * h * cfg.kv_heads * d + cfg.num_heads * d * h  # q, k, v, proj


def _mlp_params(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """(matmul weights held, matmul weights each token uses) of block ``layer``'s MLP: the dense
    SwiGLU's gate/up/down, or an MoE layer's router, every expert (held) or its top_k (used),
    and the shared experts."""
    h, moe = cfg.hidden_size, cfg.moe
    if moe is None or not moe.is_moe_layer(layer):
        dense = 3 * h * cfg.ffn_size
        return dense, dense
    expert = 3 * h * moe.expert_hidden_size
    always = moe.num_experts * h + moe.shared_experts * expert              # router + shared experts
    return always + moe.num_experts * expert, always + moe.top_k * expert


def block_param_count(cfg: ModelConfig, layer: int) -> int:
    """Parameters of block ``layer`` (attention, MLP or MoE, two RMSNorm weights)."""
    return _attn_params(cfg) + _mlp_params(cfg, layer)[0] + 2 * cfg.hidden_size


def param_count(cfg: ModelConfig) -> int:
    """Exact number of parameters of the unsharded model (no vocabulary padding), a tied
    embedding/head weight counted once; with ``model.moe`` every expert counts."""
    h = cfg.hidden_size
    blocks = sum(block_param_count(cfg, i) for i in range(cfg.num_layers))
    embedding = cfg.vocab_size * h
    return embedding + blocks + h + (0 if cfg.tie_embeddings else cfg.vocab_size * h)


def flops_per_token(cfg: ModelConfig, seq_len: Optional[int] = None) -> int:
    """Training FLOPs per token (forward + backward), for MFU, as in PaLM (App. B) and
    Megatron-LM::

        6 * N_matmul + 12 * L * H * S

    ``N_matmul`` counts the weights used in matmuls: every block's q/k/v/proj and
    gate/up/down weights (an MoE layer: the router, the top_k experts a token uses and the
    shared experts: ACTIVE parameters) plus the LM head (V*H, tied or not; the embedding lookup and the
    norms do no matmul). The attention term is QK^T and AV: 2 matmuls * 2 FLOPs * S * H per
    token per layer forward, times 3 for forward + backward; like PaLM it does not halve
    for the causal mask. ``S`` defaults to ``cfg.seq_len``. Activation recomputation is
    not counted (this is model FLOPs, not hardware FLOPs).
    """
    s = cfg.seq_len if seq_len is None else seq_len
    head = cfg.vocab_size * cfg.hidden_size
    n_matmul = sum(_attn_params(cfg) + _mlp_params(cfg, i)[1] for i in range(cfg.num_layers)) + head
    return 6 * n_matmul + 12 * cfg.num_layers * cfg.hidden_size * s
