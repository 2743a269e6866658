"""``engine.initialize``: DeepSpeed's ``deepspeed.initialize`` for this engine.

    engine, optimizer, dataloader, lr_scheduler = engine.initialize(
        model=model, model_parameters=model.parameters(), config="configs/zero2.json")

Without tensor or pipeline parallelism any ``nn.Module`` works with the DeepSpeed loop
(``loss = engine(batch); engine.backward(loss); engine.step()``). With TP or PP the model
is the reference GPT (``model=None`` builds it from the config's ``model`` section; an
unsharded :class:`engine.models.GPT` is sharded onto this rank) or, with TP = 1, a list of
layers cut into pipeline stages; ``engine.train_batch(data_iter)`` runs a whole step.
Any other ``nn.Module`` (a Hugging Face decoder) with ``tensor_parallel.autotp_size > 1``
is split by AutoTP (:mod:`engine.assembly.autotp`, docs/autotp.md); a Hugging Face Llama /
Qwen2 / Mistral with ``context_parallel.size`` (``sequence_parallel_size``) > 1 gets the
context-parallel attention and batch sharding of :mod:`engine.context_parallel.hf`; a Hugging
Face Mixtral / Qwen2-MoE with ``expert_parallel.size`` > 1 gets this rank's experts and the
all-to-all dispatch of :mod:`engine.moe.hf`.

Assembly is explicit: one builder per kind of model (:mod:`engine.assembly.builders`,
:func:`engine.assembly.autotp.autotp_parts`, :func:`engine.pipe.build.pipeline_module_parts`)
makes the rank's :class:`~engine.parts.ModelParts`, and
:func:`engine.assembly.assemble.assemble_engine` builds the optimizer, the pipeline runner and
the engine over them.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from engine.assembly.assemble import assemble_engine
from engine.assembly.autotp import autotp_parts
from engine.assembly.builders import layer_list_parts, module_parts, reference_parts
from engine.config import Config, load_config
from engine.config.ignored import log_ignored_keys
from engine.context_parallel.groups import build_cp_layout
from engine.context_parallel.hf import SUPPORTED_MODEL_TYPES, check_hf_model, is_hf_model, prepare_hf_model
from engine.context_parallel.layout import CPLayout
from engine.data.ds_loader import deepspeed_loader
from engine.distributed.env import (
    DistEnv,
    arm_exit_teardown,
    device_for_initialised_group,
    init_distributed,
    launcher_local_rank,
)
from engine.distributed.groups import ParallelGroups
from engine.engine import Engine
from engine.errors import ConfigError
from engine.models import GPT
from engine.moe.hf import hf_moe_problem, prepare_hf_moe_model
from engine.monitor import build_monitor
from engine.optim.build import OptimizerInputs
from engine.optim.client import agree_on_error, check_client_objects, mpu_mismatch
from engine.parts import LossFn, ModelParts
from engine.pipe.build import pipeline_config, pipeline_module_parts
from engine.pipe.module import PipelineModule
from engine.precision.fp8 import fp8_states
from engine.topology import Axis, Role

__all__ = ["initialize"]

logger = logging.getLogger(__name__)

ConfigArg = Union[str, "os.PathLike[str]", dict, Config, None]


def _config_source(args: Any, config: ConfigArg, config_params: ConfigArg) -> Union[str, "os.PathLike[str]", dict, Config]:
    given = [c for c in (config, config_params) if c is not None]
    from_args = None
    if args is not None:
        from_args = (getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
                     or getattr(args, "config", None))
    if from_args is not None:
        given.append(from_args)
    if not given:
        raise ConfigError("no config: pass config= (a path, a dict or a Config), or args with "
                          "--deepspeed_config / --config")
    if len(given) > 1:
        raise ConfigError("the config was given more than once (config=, config_params= and/or "
                          "args.deepspeed_config): pass exactly one")
    return given[0]


def _device_of_default_group() -> torch.device:
    """The device collectives of an already-initialised default group work on (see
    :func:`engine.distributed.env.device_for_initialised_group`); NCCL: also made current."""
    backend = dist.get_backend()
    if backend != "nccl":
        return torch.device("cpu")
    bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
    kind, index = device_for_initialised_group(backend, bound.index if bound is not None else None,
                                               torch.cuda.current_device(), torch.cuda.device_count())
    dev = torch.device(kind) if index is None else torch.device(kind, index)
    torch.cuda.set_device(dev)
    return dev


def _check_fp8_model(cfg: Config, model: Any) -> None:
    """``fp8.enabled`` needs an FP8 layer somewhere in the model. Decided from the whole model,
    which every rank has (the config for the reference GPT, the full layer list, the module),
    so all ranks raise together: a check on one pipeline stage's chunk alone would raise on a
    stage holding only the embedding or the head and leave its peers in a collective."""
    if not cfg.fp8.enabled or model is None or isinstance(model, GPT):
        return  # the reference model's blocks get FP8 layers from the config
    if isinstance(model, PipelineModule):  # it holds one stage's layers: ask its whole list
        if not model.any_layer(fp8_states):
            raise ConfigError("fp8.enabled but no layer of the PipelineModule is an FP8 layer (use "
                              "engine.precision.fp8.Fp8Linear in your layers)")
        return
    whole = nn.ModuleList(list(model)) if _is_layer_list(model) else model
    if isinstance(whole, nn.Module) and not fp8_states(whole):
        raise ConfigError("fp8.enabled but the model has no FP8 layer (the reference model's blocks get them "
                          "from the config; a custom module needs engine.precision.fp8.Fp8Linear)")


def _check_cp_model(cfg: Config, model: Any, loss_fn: Optional[LossFn]) -> None:
    """Context parallelism runs the reference GPT (from the config, or an engine.models.GPT),
    whose attention attends across the CP group, or a Hugging Face Llama / Qwen2 / Mistral
    through the DeepSpeed loop, whose attention the adapter replaces
    (:mod:`engine.context_parallel.hf`). Checked on every rank before any collective."""
    if cfg.cp == 1:
        return
    key = "context_parallel.size (or sequence_parallel_size)"
    if model is not None and not isinstance(model, GPT):
        if not is_hf_model(model):
            raise ConfigError(f"{key} = {cfg.cp} needs the reference GPT (model=None with a model section, or an "
                              f"engine.models.GPT) or a Hugging Face {'/'.join(SUPPORTED_MODEL_TYPES)} model: "
                              f"{type(model).__name__} has its own attention, which context parallelism cannot "
                              "split; set the size to 1")
        if cfg.tp > 1 or cfg.pp > 1:
            raise ConfigError(f"{key} = {cfg.cp} with a Hugging Face model runs the DeepSpeed loop with data "
                              f"parallelism only: set tensor_parallel.autotp_size ({cfg.tp}) and the pipeline "
                              f"stages ({cfg.pp}) to 1, or set the size to 1")
        check_hf_model(model, key, cfg.cp, cfg.context_parallel.ulysses_size)
    if loss_fn is not None:
        raise ConfigError(f"{key} = {cfg.cp}: a custom loss_fn is not supported with context parallelism (the engine "
                          "normalises the token loss over the context-parallel shards); drop loss_fn")


def _check_hf_moe_model(cfg: Config, model: Any) -> None:
    """A Hugging Face model at ``expert_parallel.size`` > 1 must be a Mixtral or Qwen2-MoE the
    expert-parallel adapter can split (:mod:`engine.moe.hf`). Reads only the model's config and
    classes, so every rank raises together, before any collective."""
    ep = cfg.expert_parallel.size
    if ep > 1 and is_hf_model(model):
        problem = hf_moe_problem(model, ep, cfg.tp, cfg.pp)
        if problem is not None:
            raise ConfigError(problem)


def _is_layer_list(model: Any) -> bool:
    return isinstance(model, (list, tuple, nn.ModuleList))


def _dataloader(data: Any, cfg: Config, groups: ParallelGroups, collate_fn: Optional[Callable],
                device: torch.device, pipeline: bool) -> Any:
    """DeepSpeed's ``deepspeed_io``: micro-batches of ``train_micro_batch_size_per_gpu``,
    each DP rank reading its own shard of the dataset, in DeepSpeed's order
    (:mod:`engine.data.ds_loader`: sampler seed 0, last batch kept unless
    ``dataloader_drop_last``; unshuffled and repeating under a pipeline). On a GPU the
    batches are pinned, so the engine's non-blocking copy to the device overlaps compute."""
    rows = groups.role(Role.BATCH)  # the ranks that read different rows
    return deepspeed_loader(data, cfg.train_micro_batch_size_per_gpu, rows.size, rows.rank, collate_fn=collate_fn,
                            drop_last=cfg.dataloader_drop_last, pipeline=pipeline,
                            pin_memory=device.type != "cpu")


def initialize(args: Any = None, model: Union[nn.Module, Sequence[nn.Module], None] = None,  # noqa: PLR0913 (deepspeed.initialize's signature, plus three keyword-only options)
               optimizer: Any = None, model_parameters: Optional[Iterable[Any]] = None,
               training_data: Any = None, lr_scheduler: Any = None, distributed_port: Optional[int] = None,
               mpu: Any = None, dist_init_required: Optional[bool] = None, collate_fn: Optional[Callable] = None,
               config: ConfigArg = None, config_params: ConfigArg = None, *, dist_env: Optional[DistEnv] = None,
               loss_fn: Optional[LossFn] = None, timeout_s: float = 1800.0) -> tuple[Engine, Any, Any, Any]:
    """Build the engine. Returns ``(engine, optimizer, dataloader, lr_scheduler)`` as DeepSpeed.

    DeepSpeed's arguments keep their meaning. ``optimizer``: a ``torch.optim.Optimizer`` or a
    callable ``params -> Optimizer`` when the config has no optimizer section (its param
    groups and hyperparameters are kept at every ZeRO stage); ``lr_scheduler``: a scheduler
    (built on that optimizer) or a callable ``optimizer -> scheduler`` when the config has
    no scheduler section. ``mpu`` (Megatron's ``get_{data,model,pipe}_parallel_*``) is
    checked against the layout the config gives and refused naming the first mismatch;
    ``distributed_port`` is ignored (the launcher gives the port).
    ``config``: a JSON path, a dict or a loaded :class:`~engine.config.Config`.
    ``dist_env``: the :class:`~engine.distributed.env.DistEnv` of an initialised run; without it and
    without an initialised default group, :func:`engine.distributed.env.init_distributed` is called.
    ``loss_fn(output, targets)``: the loss of a layer-list model (default: cross-entropy of
    the last layer's logits); ``timeout_s``: collective timeout when initialising here.
    """
    source = _config_source(args, config, config_params)
    if not dist.is_initialized():
        if dist_init_required is False:
            raise RuntimeError("dist_init_required=False but torch.distributed is not initialised")
        dist_env = init_distributed(timeout_s=timeout_s)
    arm_exit_teardown()  # a group made by the caller (accelerate, torch) is torn down at exit too
    world = dist.get_world_size()
    if isinstance(model, PipelineModule):  # DeepSpeed's pipeline API: the module gives the depth
        cfg = pipeline_config(source, model, world)
    else:
        cfg = source if isinstance(source, Config) else load_config(source, world_size=world)
    if cfg.world_size != world:
        raise ConfigError(f"the config was resolved for {cfg.world_size} ranks but the job has {world}")
    log_ignored_keys(cfg.ignored_keys, dist.get_rank(), logger)  # once, rank 0: accepted, no effect
    _check_fp8_model(cfg, model)  # on every rank, before any collective
    _check_cp_model(cfg, model, loss_fn)
    _check_hf_moe_model(cfg, model)
    check_client_objects(cfg, optimizer, lr_scheduler)
    device = dist_env.device if dist_env is not None else _device_of_default_group()
    if mpu is not None:
        agree_on_error(mpu_mismatch(mpu, cfg.topology, dist.get_rank()), device)
    monitor = build_monitor(cfg.monitor, is_writer=dist.get_rank() == 0)  # checks the packages on every rank
    groups = ParallelGroups.build(cfg.topology, timeout_s=getattr(dist_env, "timeout_s", None), ep=cfg.expert_parallel.size)

    pipelined = isinstance(model, PipelineModule) or cfg.pp > 1  # DeepSpeed's PipelineEngine reads in order
    loader = None if training_data is None else _dataloader(training_data, cfg, groups, collate_fn, device, pipelined)
    cp = build_cp_layout(cfg.context_parallel, groups, getattr(dist_env, "timeout_s", None))  # collective (hybrid)
    parts, opt_inputs = _build_parts(cfg, model, optimizer, model_parameters, groups, device, loss_fn, cp)
    engine = assemble_engine(cfg, parts, opt_inputs, lr_scheduler, groups, device, dist_env=dist_env,
                             monitor=monitor, training_dataloader=loader)
    if args is not None and hasattr(args, "local_rank"):  # as DeepSpeed: the launcher's, whatever argparse defaulted to
        local = dist_env.local_rank if dist_env is not None else launcher_local_rank(world)
        if local is not None:  # None: a group made by hand, no launcher; the script's own value stays
            args.local_rank = local
    logger.info("engine: %s, ZeRO-%d, %s, %s", cfg.topology, cfg.zero.stage, cfg.precision,
                f"pipeline {cfg.pipeline.schedule}" if cfg.pp > 1 else "no pipeline")
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _build_parts(cfg: Config, model: Union[nn.Module, Sequence[nn.Module], None], optimizer: Any,
                 model_parameters: Optional[Iterable[Any]], groups: ParallelGroups, device: torch.device,
                 loss_fn: Optional[LossFn], cp: Optional[CPLayout] = None) -> tuple[ModelParts, OptimizerInputs]:
    """The builder for this kind of model (see the module docstring)."""
    if isinstance(model, PipelineModule):
        return pipeline_module_parts(cfg, model, optimizer, model_parameters, groups, device)
    if model is not None and not _is_layer_list(model) and cfg.tp == 1 and cfg.pp == 1 \
            and not (cfg.cp > 1 and isinstance(model, GPT)):  # a GPT under CP: the reference chunks
        if cp is not None:  # a Hugging Face model (_check_cp_model): its attention and batches go CP
            prepare_hf_model(model, cp, groups[Axis.CP])  # type: ignore[arg-type]
        if groups.ep_size > 1 and is_hf_model(model):  # _check_hf_moe_model: a Mixtral / Qwen2-MoE
            prepare_hf_moe_model(model, groups.role(Role.EP))  # type: ignore[arg-type]
        return module_parts(cfg, model, optimizer, model_parameters, device, loss_fn)  # type: ignore[arg-type]
    if isinstance(model, nn.Module) and not _is_layer_list(model) and not isinstance(model, GPT) and cfg.tp > 1:
        return autotp_parts(cfg, model, optimizer, model_parameters, groups, device, loss_fn)  # a model we did not write
    if optimizer is not None or model_parameters is not None:
        raise ValueError("with tensor or pipeline parallelism (or model=None) the engine builds the "
                         "optimizer from the config over its own parameter shards: pass optimizer=None "
                         "and model_parameters=None")
    if model is None or isinstance(model, GPT):
        return reference_parts(cfg, model, groups, device, loss_fn, cp)
    if _is_layer_list(model):
        return layer_list_parts(cfg, list(model), groups, device, loss_fn)  # type: ignore[arg-type]
    raise TypeError(f"with tensor or pipeline parallelism (tp={cfg.tp}, pp={cfg.pp}) engine.initialize takes "
                    f"model=None (the reference GPT from the config), an engine.models.GPT or a list of "
                    f"layers; got {type(model).__name__}")
