"""``engine.initialize(model=PipelineModule(...))``: the config gets the module's pipeline
depth, the layers are cut with the module's ``partition_method`` into this rank's chunks
(:func:`engine.pipeline.stages.chunks_from_layers`: the tied embedding/head weight becomes a
marked copy on the last stage, its gradient summed over the embedding group), and the
engine runs them with the configured schedule, ZeRO 0-3 and ``train_batch``.
:func:`pipeline_module_parts` is the builder (:class:`engine.parts.ModelParts`).
"""

from __future__ import annotations

import os
from typing import Any, Union

import torch
import torch.nn as nn

from engine.config import Config, load_config
from engine.config.reader import read_json_file
from engine.distributed.groups import ParallelGroups
from engine.errors import ConfigError
from engine.optim.build import (
    OptimizerInputs,
    optimizer_inputs,
    precision_policy,
)
from engine.parts import LossFn, ModelParts
from engine.pipe.module import PipelineModule
from engine.pipeline.schedule import placement_of as schedule_placement
from engine.pipeline.stages import check_layer_support, chunks_from_layers

__all__ = ["pipeline_config", "pipeline_module_parts"]


def pipeline_config(source: Union[str, "os.PathLike[str]", dict, Config], module: PipelineModule,
                    world_size: int) -> Config:
    """The config with ``pipeline.stages = module.num_stages`` (DeepSpeed's configs do not
    have the key: the module gives the depth); a different explicit value is an error."""
    n = module.num_stages
    if isinstance(source, Config):
        if source.pp != n:
            raise ConfigError(f"the config has pipeline.stages = {source.pp} but the PipelineModule has num_stages = "
                              f"{n}: make them equal (or leave pipeline.stages out)")
        return source
    raw = dict(source) if isinstance(source, dict) else read_json_file(source)
    pipe = dict(raw.get("pipeline") or {})
    if "stages" in pipe and pipe["stages"] != n:
        raise ConfigError(f"the config has pipeline.stages = {pipe['stages']!r} but the PipelineModule has "
                          f"num_stages = {n}: make them equal (or leave pipeline.stages out)")
    pipe["stages"] = n
    raw["pipeline"] = pipe
    return load_config(raw, world_size=world_size)


def _param_slots(module: nn.Module) -> dict[tuple[int, str], nn.Parameter]:
    return {(id(m), name): p for m in module.modules() for name, p in m._parameters.items() if p is not None}


def _loss_fn(module: PipelineModule) -> LossFn:
    if module.loss_fn is not None:
        return module.loss_fn
    return lambda outputs, labels: outputs  # DeepSpeed: without loss_fn the last layer's output is the loss


def pipeline_module_parts(cfg: Config, module: PipelineModule, client_opt: Any, model_parameters: Any,
                          groups: ParallelGroups, device: torch.device) -> tuple[ModelParts, OptimizerInputs]:
    """This rank's stage(s) of ``module`` (see the module docstring)."""
    if cfg.tp > 1:
        raise ConfigError("a PipelineModule is trained with pipeline and data parallelism only: set "
                          "tensor_parallel.autotp_size to 1")
    placement = schedule_placement(cfg.pipeline.schedule)
    v = cfg.pipeline.virtual_stages
    if module.rebuilt_for(v) and isinstance(client_opt, torch.optim.Optimizer):  # the same answer on every rank
        raise ValueError(f"the PipelineModule was built at construction for one piece per stage, and "
                         f"pipeline.schedule {cfg.pipeline.schedule!r} with virtual_stages = {v} cuts it anew at "
                         f"engine.initialize: an optimizer object made before lacks the new layers' parameters; "
                         f"pass optimizer as a callable (params -> optimizer) or use the config's optimizer section")
    bounds = module.build_stage(groups.pp_rank, cfg.pp, v, placement)  # this rank's layers only
    module.check_tied(bounds, cfg.pp, placement)  # on every rank, from the specs
    if model_parameters is not None:
        mine = {id(p) for p in module.parameters()} | module.built_parameter_ids()
        given = [q for x in model_parameters for q in (x["params"] if isinstance(x, dict) else [x])]
        if any(id(p) not in mine for p in given):
            raise ValueError("model_parameters holds parameters that are not the PipelineModule's: pass "
                             "[p for p in net.parameters() if p.requires_grad] or None")
    dtype = precision_policy(cfg).compute_dtype
    before = _param_slots(module)
    check_layer_support(cfg, module.any_layer)  # the whole model's layers (this rank holds its stage's only)
    chunks, tied = chunks_from_layers(module.layer_list(), cfg, groups.pp_rank, bounds=bounds,
                                      checkpoint_interval=module.activation_checkpoint_interval, checked=True)
    # the last stage's copies of tied weights stand for the originals in a client optimizer's groups
    replaced = {id(old): new for slot, new in _param_slots(module).items()
                if (old := before[slot]) is not new}
    for ch in chunks:
        ch.to(device=device, dtype=dtype)
    module.keep_only([m for ch in chunks for m in ch.layers])  # the other stages' layers are released
    stage: nn.Module = nn.ModuleList(chunks) if cfg.pp > 1 else chunks[0]
    trainable = [p for p in stage.parameters() if p.requires_grad]
    # this stage's share of a client's groups (the tied copy on the last stage included)
    inputs = optimizer_inputs(cfg, trainable, client_opt, replaced)
    # the DP broadcast, the optimizer and the (lazy: the boundary shape is measured on the
    # first micro-batch) pipeline runner are the assembly's (engine.assembly.assemble)
    parts = ModelParts(stage, tuple(chunks), tuple(tied), _loss_fn(module), dtype, measure_boundary=True)
    return parts, inputs
