"""Small builders from the user's model to :class:`engine.parts.ModelParts` (and what the
optimizer is built over, :class:`engine.optim.build.OptimizerInputs`):

- :func:`reference_parts`: the reference GPT of the config's ``model`` section
  (``model=None``), or a given unsharded :class:`engine.models.GPT` copied into this rank's
  shards; DP x TP x PP;
- :func:`layer_list_parts`: a list of layers cut into pipeline stages (``tp == 1``);
- :func:`module_parts`: any ``nn.Module`` for the DeepSpeed loop (``tp == pp == 1``).

AutoTP (:func:`engine.assembly.autotp.autotp_parts`) and DeepSpeed's ``PipelineModule``
(:func:`engine.pipe.build.pipeline_module_parts`) have their own. Each builder moves the
model to its device and dtype; the DP broadcast, the optimizer and the pipeline runner are
the assembly's (:mod:`engine.assembly.assemble`).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch
import torch.nn as nn

from engine.config import Config
from engine.context_parallel.layout import CPLayout
from engine.distributed.groups import NO_TP, AxisGroup, ParallelGroups
from engine.errors import ConfigError
from engine.models import GPT
from engine.moe.context import NO_EP
from engine.moe.wiring import moe_context
from engine.optim.build import (
    OptimizerInputs,
    optimizer_factory,
    optimizer_inputs,
    precision_policy,
)
from engine.parts import LossFn, ModelParts, TokenLoss
from engine.pipeline.stages import ReferenceModel, build_reference_chunks, chunks_from_layers, load_full_weights
from engine.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from engine.topology import Role
from engine.zero.init import Init as zero_init

__all__ = ["reference_parts", "layer_list_parts", "module_parts"]


def _stage_module(cfg: Config, chunks: Sequence[nn.Module]) -> nn.Module:
    """What the engine holds: the chunks (``pp > 1``, driven by the pipeline) or the one chunk."""
    return nn.ModuleList(chunks) if cfg.pp > 1 else chunks[0]


def _tied_reference(cfg: Config, chunks: Sequence[Any]) -> tuple[nn.Parameter, ...]:
    """The tied embedding / head weight where the first and the last model stage are on
    different pipeline ranks (``pp > 1``; summed over the embedding group). In V placement
    both are on rank 0 and share one parameter: nothing to sum."""
    if cfg.pp == 1 or cfg.model is None or not cfg.model.tie_embeddings:
        return ()
    first, last = chunks[0].is_first, chunks[-1].is_last
    if first and last:
        return ()
    return tuple(([chunks[0].layers[0].weight] if first else []) + ([chunks[-1].layers[-1].weight] if last else []))


def reference_parts(cfg: Config, model: Optional[GPT], groups: ParallelGroups, device: torch.device,
                    loss_fn: Optional[LossFn], cp: Optional[CPLayout] = None) -> tuple[ModelParts, OptimizerInputs]:
    """The reference GPT (``model=None``: built from the config; a GPT: its weights); ``cp``:
    this rank's context-parallel layout (``context_parallel.size`` > 1)."""
    if cfg.model is None:
        raise ConfigError("the config has no \"model\" section, which the reference GPT needs (model=None builds it "
                          "from the section; an engine.models.GPT must match it): add a model section with "
                          "vocab_size, hidden_size, num_layers, num_heads and seq_len")
    if model is not None and model.cfg != cfg.model:
        raise ConfigError("the GPT given to engine.initialize was built from a different model config than "
                          "the config's model section: make them equal")
    dtype = precision_policy(cfg).compute_dtype
    tp_group = groups.tp_group
    # ZeRO-3 builds the reference model already partitioned over DP (never whole on a rank);
    # the MoE experts (engine.moe.experts.GroupedSwiGLU) are placed as expert shards in their
    # constructor, so zero.Init cuts them over the expert-gradient group, not the grad group
    experts = groups.expert_roles()
    partition_at_build = cfg.zero.stage == 3 and model is None
    with zero_init(data_parallel_group=groups.role(Role.GRAD), enabled=partition_at_build,
                   expert_group=experts.get(Role.EXPERT_GRAD, AxisGroup.single("expert_grad"))):
        # the MoE layers' groups (model.moe): the EP role's group (size 1 at expert_parallel.size 1)
        chunks = build_reference_chunks(cfg, groups.pp_rank, tp_group, device=device, dtype=dtype, cp=cp,
                                        moe=moe_context(cfg, groups, ep_group=experts.get(Role.EP, NO_EP)))
    if model is not None:
        load_full_weights(chunks, model, tp_group)
    loss: Optional[LossFn] = loss_fn or (lambda logits, targets: vocab_parallel_cross_entropy(logits, targets,
                                                                                              tp_group))
    module: nn.Module = _stage_module(cfg, chunks)
    if cfg.pp == 1 and loss_fn is None:  # called like a GPT: forward(ids, targets) -> loss
        module, loss = ReferenceModel(chunks[0], tp_group), None
    # the engine's own loss (none given): train_batch / eval_batch take the global token mean
    token = None if loss_fn is not None else TokenLoss(
        lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, tp_group, reduction="sum"))
    parts = ModelParts(module, tuple(chunks), _tied_reference(cfg, chunks), loss, dtype, reference=True,
                       token_loss=token, cp=cp)
    return parts, OptimizerInputs(module, optimizer_factory(cfg.optimizer))


def layer_list_parts(cfg: Config, layers: Sequence[nn.Module], groups: ParallelGroups, device: torch.device,
                     loss_fn: Optional[LossFn]) -> tuple[ModelParts, OptimizerInputs]:
    """A list of layers (``tp == 1``) cut into this rank's chunk(s); default loss:
    cross-entropy of the last layer's logits."""
    if cfg.model is None and cfg.pp > 1:
        raise ConfigError("the config has no \"model\" section, which pipeline parallelism needs (model.seq_len and "
                          "model.hidden_size give the shape of the activations sent between stages): add a model "
                          "section with vocab_size, hidden_size, num_layers, num_heads and seq_len")
    if cfg.tp > 1:
        raise ConfigError("a list of layers can be trained with pipeline and data parallelism only: with "
                          "tensor_parallel.autotp_size > 1 pass model=None (the reference GPT from the "
                          "config) or an engine.models.GPT")
    dtype = precision_policy(cfg).compute_dtype
    chunks, tied = chunks_from_layers(list(layers), cfg, groups.pp_rank)
    for ch in chunks:
        ch.to(device=device, dtype=dtype)
    loss = loss_fn or (lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, NO_TP))
    module = _stage_module(cfg, chunks)
    return (ModelParts(module, tuple(chunks), tuple(tied), loss, dtype),
            OptimizerInputs(module, optimizer_factory(cfg.optimizer)))


def module_parts(cfg: Config, model: nn.Module, client_opt: Any, model_parameters: Optional[Iterable[Any]],
                 device: torch.device, loss_fn: Optional[LossFn]) -> tuple[ModelParts, OptimizerInputs]:
    """Any module for the DeepSpeed loop (DP with ZeRO 0-3). ``model_parameters``:
    parameters or torch-style group dicts (DeepSpeed takes both)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module (or a list of layers), got {type(model).__name__}")
    dtype = precision_policy(cfg).compute_dtype
    model.to(device=device)
    if dtype != torch.float32:
        model.to(dtype=dtype)  # as DeepSpeed's module.half() / .bfloat16(); masters stay fp32
    given = list(model.parameters() if model_parameters is None else model_parameters)
    inputs = optimizer_inputs(cfg, given, client_opt)  # a client's class and groups, over the master shards
    return ModelParts(model, loss_fn=loss_fn, dtype=dtype), inputs
