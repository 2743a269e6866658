"""``engine.initialize``: DeepSpeed's ``deepspeed.initialize`` for this engine.

    engine, optimizer, dataloader, lr_scheduler = engine.initialize(
        model=model, model_parameters=model.parameters(), config="configs/zero2.json")

Without tensor or pipeline parallelism any ``nn.Module`` works with the DeepSpeed loop
(``loss = engine(batch); engine.backward(loss); engine.step()``). With TP or PP the model
is the reference GPT (``model=None`` builds it from the config's ``model`` section; an
unsharded :class:`engine.models.GPT` is sharded onto this rank) or, with TP = 1, a list of
layers cut into pipeline stages; ``engine.train_batch(data_iter)`` runs a whole step.
Any other ``nn.Module`` (a Hugging Face decoder) with ``tensor_parallel.autotp_size > 1``
is split by AutoTP (:mod:`engine.runtime.autotp`, docs/autotp.md).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from engine.config import Config, load_config
from engine.dist import comm
from engine.dist.groups import ParallelGroups
from engine.engine import Engine, LossFn
from engine.errors import ConfigError
from engine.models import GPT
from engine.monitor import Monitor, build_monitor
from engine.pipe.build import build_pipeline_engine, pipeline_config
from engine.pipe.module import PipelineModule
from engine.runtime.client import (
    agree_on_error,
    check_client_objects,
    mpu_mismatch,
    param_groups_from_client,
    resolve_client_optimizer,
)
from engine.runtime.model import ReferenceModel, build_reference_chunks, chunks_from_layers, load_full_weights
from engine.runtime.optim import (
    build_engine_optimizer,
    build_scheduler,
    client_optimizer_factory,
    optimizer_factory,
    precision_policy,
)
from engine.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from engine.zero.init import Init as zero_init
from engine.zero.init import is_partitioned

__all__ = ["initialize"]

logger = logging.getLogger(__name__)

ConfigArg = Union[str, "os.PathLike[str]", dict, Config, None]


def _config_source(args: Any, config: ConfigArg, config_params: ConfigArg) -> Union[str, dict, Config]:
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
    :func:`engine.dist.env.device_for_initialised_group`); NCCL: also made current."""
    from engine.dist.env import device_for_initialised_group

    backend = dist.get_backend()
    if backend != "nccl":
        return torch.device("cpu")
    bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
    kind, index = device_for_initialised_group(backend, bound.index if bound is not None else None,
                                               torch.cuda.current_device(), torch.cuda.device_count())
    dev = torch.device(kind, index)
    torch.cuda.set_device(dev)
    return dev


def _broadcast_from_first_replica(module: nn.Module, groups: ParallelGroups) -> None:
    """Every DP replica starts from DP rank 0's weights and buffers (as DeepSpeed does)."""
    if groups.dp_size == 1:
        return
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if not is_partitioned(t):  # built under engine.zero.Init: already equal slices
                comm.broadcast(t.data, groups.dp_ranks[0], groups.dp_group)


def _check_fp8_model(cfg: Config, model: Any) -> None:
    """``fp8.enabled`` needs an FP8 layer somewhere in the model. Decided from the whole model,
    which every rank has (the config for the reference GPT, the full layer list, the module),
    so all ranks raise together: a check on one pipeline stage's chunk alone would raise on a
    stage holding only the embedding or the head and leave its peers in a collective."""
    from engine.precision.fp8 import fp8_states

    if not cfg.fp8.enabled or model is None or isinstance(model, GPT):
        return  # the reference model's blocks get FP8 layers from the config
    whole = nn.ModuleList(list(model)) if _is_layer_list(model) else model
    if isinstance(whole, nn.Module) and not fp8_states(whole):
        raise ConfigError("fp8.enabled but the model has no FP8 layer (the reference model's blocks get them "
                          "from the config; a custom module needs engine.precision.fp8.Fp8Linear)")


def _is_layer_list(model: Any) -> bool:
    return isinstance(model, (list, tuple, nn.ModuleList))


def _dataloader(data: Any, cfg: Config, groups: ParallelGroups, collate_fn: Optional[Callable],
                device: torch.device) -> Any:
    """DeepSpeed's ``deepspeed_io``: micro-batches of ``train_micro_batch_size_per_gpu``,
    each DP rank reading its own shard of the dataset (``DistributedSampler``). On a GPU the
    batches are pinned, so the engine's non-blocking copy to the device overlaps compute."""
    from torch.utils.data import DataLoader, DistributedSampler

    if not isinstance(data, torch.utils.data.Dataset):
        raise TypeError(f"training_data must be a torch.utils.data.Dataset, got {type(data).__name__}")
    sampler = DistributedSampler(data, num_replicas=groups.dp_size, rank=groups.dp_rank, shuffle=True,
                                 seed=cfg.seed, drop_last=True)
    return DataLoader(data, batch_size=cfg.train_micro_batch_size_per_gpu, sampler=sampler,
                      collate_fn=collate_fn, drop_last=True, pin_memory=device.type != "cpu")


def initialize(args: Any = None, model: Union[nn.Module, Sequence[nn.Module], None] = None,
               optimizer: Any = None, model_parameters: Optional[Iterable[Any]] = None,
               training_data: Any = None, lr_scheduler: Any = None, distributed_port: Optional[int] = None,
               mpu: Any = None, dist_init_required: Optional[bool] = None, collate_fn: Optional[Callable] = None,
               config: ConfigArg = None, config_params: ConfigArg = None, *, dist_env: Any = None,
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
    ``dist_env``: the :class:`~engine.dist.env.DistEnv` of an initialised run; without it and
    without an initialised default group, :func:`engine.dist.env.init_distributed` is called.
    ``loss_fn(output, targets)``: the loss of a layer-list model (default: cross-entropy of
    the last layer's logits); ``timeout_s``: collective timeout when initialising here.
    """
    source = _config_source(args, config, config_params)
    if not dist.is_initialized():
        if dist_init_required is False:
            raise RuntimeError("dist_init_required=False but torch.distributed is not initialised")
        from engine.dist.env import init_distributed

        dist_env = init_distributed(timeout_s=timeout_s)
    world = dist.get_world_size()
    if isinstance(model, PipelineModule):  # DeepSpeed's pipeline API: the module gives the depth
        cfg = pipeline_config(source, model, world)
    else:
        cfg = source if isinstance(source, Config) else load_config(source, world_size=world)
    if cfg.world_size != world:
        raise ConfigError(f"the config was resolved for {cfg.world_size} ranks but the job has {world}")
    _check_fp8_model(cfg, model)  # on every rank, before any collective
    check_client_objects(cfg, optimizer, lr_scheduler)
    device = dist_env.device if dist_env is not None else _device_of_default_group()
    if mpu is not None:
        agree_on_error(mpu_mismatch(mpu, cfg.topology, dist.get_rank()), device)
    monitor = build_monitor(cfg.monitor, is_writer=dist.get_rank() == 0)  # checks the packages on every rank
    groups = ParallelGroups.build(cfg.topology, timeout_s=getattr(dist_env, "timeout_s", None))

    if isinstance(model, PipelineModule):
        engine = build_pipeline_engine(cfg, model, optimizer, model_parameters, lr_scheduler, groups, device,
                                       dist_env, monitor)
    elif model is not None and not _is_layer_list(model) and cfg.tp == 1 and cfg.pp == 1:
        engine = _module_engine(cfg, model, optimizer, model_parameters, lr_scheduler, groups, device,
                                dist_env, loss_fn, monitor)
    elif isinstance(model, nn.Module) and not _is_layer_list(model) and not isinstance(model, GPT) and cfg.tp > 1:
        from engine.runtime.autotp import build_autotp_engine  # AutoTP: a model we did not write

        engine = build_autotp_engine(cfg, model, optimizer, model_parameters, lr_scheduler, groups, device,
                                     dist_env, loss_fn, monitor)
    else:
        if optimizer is not None or model_parameters is not None:
            raise ValueError("with tensor or pipeline parallelism (or model=None) the engine builds the "
                             "optimizer from the config over its own parameter shards: pass optimizer=None "
                             "and model_parameters=None")
        engine = _parallel_engine(cfg, model, lr_scheduler, groups, device, dist_env, loss_fn, monitor)
    if training_data is not None:
        engine.training_dataloader = _dataloader(training_data, cfg, groups, collate_fn, device)
    logger.info("engine: %s, ZeRO-%d, %s, %s", cfg.topology, cfg.zero.stage, cfg.precision,
                f"pipeline {cfg.pipeline.schedule}" if cfg.pp > 1 else "no pipeline")
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _module_engine(cfg: Config, model: nn.Module, client_opt: Any, model_parameters: Any, client_sched: Any,
                   groups: ParallelGroups, device: torch.device, dist_env: Any, loss_fn: Optional[LossFn],
                   monitor: Optional[Monitor] = None) -> Engine:
    """DP (ZeRO 0-3) around any module."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module (or a list of layers), got {type(model).__name__}")
    dtype = precision_policy(cfg).compute_dtype
    model.to(device=device)
    if dtype != torch.float32:
        model.to(dtype=dtype)  # as DeepSpeed's module.half() / .bfloat16(); masters stay fp32
    _broadcast_from_first_replica(model, groups)
    # model_parameters: parameters or torch-style group dicts (DeepSpeed takes both)
    given = list(model.parameters() if model_parameters is None else model_parameters)
    client = None if client_opt is None else resolve_client_optimizer(client_opt, given)
    if client is None:
        factory, params = optimizer_factory(cfg.optimizer), given
    else:  # the client's class and groups, re-created over the master shards
        flat = [q for x in given for q in (x["params"] if isinstance(x, dict) else [x])]
        factory, params = client_optimizer_factory(client), param_groups_from_client(client, flat)
    opt = build_engine_optimizer(cfg, params, factory, dp_group=groups.dp_group, module=model)
    sched = build_scheduler(cfg, opt, client_sched, client_optimizer=client)
    return Engine(cfg, model, opt, device=device, groups=groups, lr_scheduler=sched, loss_fn=loss_fn,
                  dist_env=dist_env, monitor=monitor)


def _parallel_engine(cfg: Config, model: Any, client_sched: Any, groups: ParallelGroups, device: torch.device,
                     dist_env: Any, loss_fn: Optional[LossFn], monitor: Optional[Monitor] = None) -> Engine:
    """The reference model (or a layer list) over DP x TP x PP."""
    dtype = precision_policy(cfg).compute_dtype
    tp_group = groups.tp_group if cfg.tp > 1 else None
    reference = model is None or isinstance(model, GPT)
    if cfg.model is None and (reference or cfg.pp > 1):
        raise ConfigError(
            "the config has no \"model\" section, which "
            + ("the reference GPT needs (model=None builds it from the section; an engine.models.GPT must match "
               "it)" if reference else
               "pipeline parallelism needs (model.seq_len and model.hidden_size give the shape of the activations "
               "sent between stages)")
            + ": add a model section with vocab_size, hidden_size, num_layers, num_heads and seq_len")
    if reference:
        if isinstance(model, GPT) and cfg.model is not None and model.cfg != cfg.model:
            raise ConfigError("the GPT given to engine.initialize was built from a different model config than "
                              "the config's model section: make them equal")
        # ZeRO-3 builds the reference model already partitioned over DP (never whole on a rank)
        sharded_build = cfg.zero.stage == 3 and model is None
        with zero_init(data_parallel_group=groups.dp_group, enabled=sharded_build):
            chunks = build_reference_chunks(cfg, groups.pp_rank, tp_group, device=device, dtype=dtype)
        if isinstance(model, GPT):
            load_full_weights(chunks, model, tp_group)
        tied = []
        if cfg.pp > 1 and cfg.model.tie_embeddings:
            if groups.is_first_stage:
                tied.append(chunks[0].layers[0].weight)
            if groups.is_last_stage:
                tied.append(chunks[-1].layers[-1].weight)
        loss = loss_fn or (lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, tp_group))
    elif _is_layer_list(model):
        if cfg.tp > 1:
            raise ConfigError("a list of layers can be trained with pipeline and data parallelism only: with "
                              "tensor_parallel.autotp_size > 1 pass model=None (the reference GPT from the "
                              "config) or an engine.models.GPT")
        chunks, tied = chunks_from_layers(list(model), cfg, groups.pp_rank)
        for ch in chunks:
            ch.to(device=device, dtype=dtype)
        loss = loss_fn or (lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, None))
    else:
        raise TypeError(f"with tensor or pipeline parallelism (tp={cfg.tp}, pp={cfg.pp}) engine.initialize takes "
                        f"model=None (the reference GPT from the config), an engine.models.GPT or a list of "
                        f"layers; got {type(model).__name__}")

    pipeline = None
    if cfg.pp > 1:
        module: nn.Module = nn.ModuleList(chunks)
    elif reference and loss_fn is None:
        module = ReferenceModel(chunks[0], tp_group)
    else:
        module = chunks[0]
    _broadcast_from_first_replica(module, groups)
    factory = optimizer_factory(cfg.optimizer)
    opt = build_engine_optimizer(cfg, module, factory, dp_group=groups.dp_group, tp_group=tp_group,
                                 pp_group=groups.pp_group if cfg.pp > 1 else None,
                                 embedding_group=groups.embedding_group if tied else None, tied_params=tied,
                                 module=module)
    if cfg.pp > 1:
        from engine.pipeline.runner import PipelineRunner

        pipeline = PipelineRunner(chunks, cfg, groups, loss, device=device, dtype=dtype, grads=opt)
    sched = build_scheduler(cfg, opt, client_sched)
    engine_loss = None if (cfg.pp > 1 or isinstance(module, ReferenceModel)) else loss
    engine = Engine(cfg, module, opt, device=device, groups=groups, lr_scheduler=sched, pipeline=pipeline,
                    loss_fn=engine_loss, dist_env=dist_env, monitor=monitor)
    if reference:
        engine.reference_chunks = list(chunks)  # for gather_reference_model (sampling, export)
    return engine
