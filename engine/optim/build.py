"""From the ``optimizer`` / ``scheduler`` / ``fp16`` / ``zero_optimization`` config sections
to the objects the engine steps: the inner optimizer factory, the ZeRO wrapper, the loss
scaler and the LR schedule.

The inner optimizer always runs over the ZeRO optimizer's fp32 master shards, so it is
built by a *factory* (``param_groups -> torch.optim.Optimizer``), never over the model's
own parameters. A client optimizer handed to :func:`engine.initialize` (DeepSpeed allows
an instance or a callable) is turned into such a factory by :func:`optimizer_inputs`, the one
place every model builder gets its optimizer inputs from.
"""

from __future__ import annotations

import copy
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist

from engine.config import AdamParams, Config, LionParams, MuonParams, OptimizerConfig
from engine.distributed.groups import ParallelGroups
from engine.errors import ConfigError
from engine.optim.chunked_adam import ChunkedAdam, ChunkedAdamW
from engine.optim.client import ClientLRScheduler, param_groups_from_client, resolve_client_optimizer
from engine.optim.ds_adam import DeepSpeedCPUAdam, check_offload_client
from engine.optim.fused_adamw import FusedAdamW
from engine.optim.lion import Lion
from engine.optim.lr_schedules import build_lr_scheduler
from engine.optim.muon import Muon
from engine.optim.muon_assign import split_muon_groups
from engine.precision.loss_scaler import build_loss_scaler
from engine.precision.mixed import PrecisionPolicy
from engine.zero import OffloadOptions, ZeroOptimizer, build_zero_optimizer
from engine.zero.base import OptimizerFactory

__all__ = ["OptimizerInputs", "optimizer_factory", "optimizer_inputs", "build_engine_optimizer",
           "build_scheduler", "precision_policy"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OptimizerInputs:
    """What a model builder gives the optimizer: ``params`` (parameters, torch-style group
    dicts, or the module itself), the inner optimizer ``factory`` over param groups, and the
    client's optimizer object when the script passed one (its scheduler keeps driving it)."""

    params: Any
    factory: OptimizerFactory
    client: Optional[torch.optim.Optimizer] = None


def optimizer_factory(opt: Optional[OptimizerConfig]) -> OptimizerFactory:
    """The inner optimizer the config names, as a factory over param groups.

    ``Adam``/``AdamW`` with ``adam_w_mode`` (the default): :class:`engine.optim.FusedAdamW`
    (the fused kernel when it builds, its PyTorch reference otherwise), or
    ``torch.optim.AdamW``'s update (multi-tensor, stepped in chunks: :class:`ChunkedAdamW`) with
    ``torch_adam``; ``adam_w_mode: false``: ``torch.optim.Adam``'s (:class:`ChunkedAdam`)
    (L2 weight decay added to the gradient). ``Lion``: :class:`Lion`.
    """
    if opt is None:
        raise ConfigError("no optimizer: add an optimizer section to the config ({\"type\": \"AdamW\", \"params\": "
                          "{\"lr\": ...}}) or pass optimizer= to initialize")
    p = opt.params
    if opt.type in ("Adam", "AdamW"):
        assert isinstance(p, AdamParams)  # the config parses Adam/AdamW params as AdamParams
        kw: dict[str, Any] = dict(lr=p.lr, betas=(p.betas[0], p.betas[1]), eps=p.eps, weight_decay=p.weight_decay)
        # torch's update stepped in chunks of the flat master (engine.optim.chunked_adam: the
        # same bits and state dict as torch.optim.Adam/AdamW, chunk-sized temporaries instead
        # of master-sized ones). Multi-tensor path: bit-identical to its default per-tensor
        # loop on CPU (measured: same bits after 13 steps) and 2x faster on a 5M-element shard.
        if not p.adam_w_mode:
            return lambda groups: ChunkedAdam(groups, foreach=True, **kw)
        if p.torch_adam:
            return lambda groups: ChunkedAdamW(groups, foreach=True, **kw)
        return lambda groups: FusedAdamW(groups, **kw)
    if opt.type == "Lion":
        assert isinstance(p, LionParams)  # the config parses Lion params as LionParams
        lion = p
        return lambda groups: Lion(groups, lr=lion.lr, betas=(lion.betas[0], lion.betas[1]),
                                   weight_decay=lion.weight_decay)
    if isinstance(p, MuonParams):
        return _muon_factory(p)
    raise ConfigError(f"optimizer.type {opt.type!r} is not one of Adam, AdamW, Lion, Muon")


def _muon_factory(p: MuonParams) -> OptimizerFactory:
    """:class:`engine.optim.Muon` with the config's two parts (DeepSpeed's ``muon_lr`` /
    ``adam_lr`` override the shared ``lr``; ``adam_weight_decay`` the shared ``weight_decay``)."""
    adam_wd = p.weight_decay if p.adam_weight_decay is None else p.adam_weight_decay
    muon_lr = p.lr if p.muon_lr is None else p.muon_lr
    adam_lr = p.lr if p.adam_lr is None else p.adam_lr
    return lambda groups: Muon(groups, lr=muon_lr, weight_decay=p.weight_decay, momentum=p.momentum,
                               nesterov=p.nesterov, ns_coefficients=tuple(p.ns_coefficients), eps=p.ns_eps,
                               ns_steps=p.ns_steps, adjust_lr_fn=p.adjust_lr_fn, ns_dtype=p.ns_dtype,
                               adamw_lr=adam_lr, adamw_betas=tuple(p.betas), adamw_eps=p.eps,
                               adamw_weight_decay=adam_wd)


def _clone_client(client: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The client's object with its whole ``__dict__`` (``copy.copy`` goes through torch's
    ``Optimizer.__getstate__``, which keeps only ``defaults``/``state``/``param_groups`` and
    loses what a subclass's constructor set: a kernel handle, a scale, a step counter).
    Attributes are shared, as DeepSpeed steps the client's object itself (a list the update
    appends to is the client's list); the hook tables and ``defaults`` are copies, so hooks
    registered on one object do not fire on the other. Methods patched onto the instance are
    not taken: a torch LR scheduler built on the client wraps its ``step`` there, bound to the
    client (the clone would step the client's object over the model's parameters)."""
    cls = type(client)
    opt = object.__new__(cls)
    for k, v in client.__dict__.items():
        if callable(v) and callable(getattr(cls, k, None)):
            continue  # an instance override of a method (step, zero_grad): the class's own
        opt.__dict__[k] = copy.copy(v) if k.startswith("_optimizer_") and k.endswith("_hooks") else v
    opt.defaults = dict(client.defaults)
    return opt


def _clone_factory(client: torch.optim.Optimizer) -> OptimizerFactory:
    """DeepSpeed's ``optimizer=`` instance as a factory.

    The instance is cloned (:func:`_clone_client`: its class and every attribute its
    constructor set) with fresh state and the given groups (the master shards; each group
    dict carries the client group's options,
    :func:`engine.optim.client.param_groups_from_client`). The client's object itself is
    left as it was (a scheduler built on it keeps working through
    :class:`engine.optim.client.ClientLRScheduler`). It must not have stepped yet: its
    state would not match the shards.
    """
    if any(len(s) for s in client.state.values()):
        raise ValueError("the optimizer passed to engine.initialize already has state (it has stepped): "
                         "pass a fresh optimizer, a callable params -> optimizer, or none (the config's)")

    def make(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        opt = _clone_client(client)
        if isinstance(opt, FusedAdamW):
            opt.clear_param_copies()  # its own, not the client's (ZeRO-Offload attaches host copies)
        opt.state = defaultdict(dict)
        opt.param_groups = []
        for g in groups:
            opt.add_param_group(g)  # options the group lacks come from the client's defaults
        return opt
    return make


def optimizer_inputs(cfg: Config, params: Any, client: Any = None,
                     mapping: Optional[Mapping[int, torch.nn.Parameter]] = None,
                     check: Optional[Callable[[torch.optim.Optimizer], None]] = None) -> OptimizerInputs:
    """What every model builder hands the optimizer: the config's optimizer over ``params``
    (parameters, torch-style group dicts or a module), or the client's (DeepSpeed's
    ``optimizer=``: an instance, or a callable called with the parameters) re-created over
    the master shards with the client's groups and options. ``mapping``: ``id(client
    parameter) -> engine parameter`` where the builder replaced one (a TP shard, a pipeline
    copy of a tied weight); ``check(client)``: the builder's own test of the client's groups."""
    if client is None:
        return OptimizerInputs(params, optimizer_factory(cfg.optimizer))
    given = list(params.parameters() if isinstance(params, torch.nn.Module) else params)
    resolved = resolve_client_optimizer(client, given)
    check_offload_client(resolved, cfg.zero.offload_optimizer.enabled, cfg.zero_force_ds_cpu_optimizer)
    check_bf16_master_client(resolved, cfg)
    if check is not None:
        check(resolved)
    flat = [q for x in given for q in (x["params"] if isinstance(x, dict) else [x])]
    return OptimizerInputs(param_groups_from_client(resolved, flat, mapping), _clone_factory(resolved), resolved)


def precision_policy(cfg: Config) -> PrecisionPolicy:
    check = cfg.bf16.check_grad_overflow if cfg.bf16.enabled else None
    return PrecisionPolicy.from_name(cfg.precision, check_nonfinite=check, grad_accum=cfg.data_types.grad_accum_dtype,
                                     comm=cfg.communication_data_type,
                                     master="bf16" if cfg.bf16.bf16_master_weights_and_grads else "fp32")


def check_bf16_master_client(client: torch.optim.Optimizer, cfg: Config) -> None:
    """DeepSpeed's rules for a client optimizer with ``bf16.bf16_master_weights_and_grads`` under
    ZeRO-Offload (``_configure_master_weights``): it must be DeepSpeedCPUAdam (whatever
    ``zero_force_ds_cpu_optimizer`` says), and with ``bf16_optimizer_states`` one constructed with
    ``fp32_optimizer_states=False``. Raised on every rank before any collective."""
    b = cfg.bf16
    if not (b.bf16_master_weights_and_grads and cfg.zero.offload_optimizer.enabled):
        return
    if not isinstance(client, DeepSpeedCPUAdam):
        raise ConfigError(f"bf16.bf16_master_weights_and_grads with zero_optimization.offload_optimizer needs the "
                          f"client optimizer to be DeepSpeedCPUAdam (DeepSpeed asserts \"Master weights feature "
                          f"requires ZeRO Offload with DeepSpeedCPUAdam\"), got {type(client).__name__}: pass "
                          "engine.compat.deepspeed.ops.adam.DeepSpeedCPUAdam, or the config's optimizer section")
    if b.bf16_optimizer_states and client.fp32_optimizer_states:
        raise ConfigError("bf16.bf16_optimizer_states with ZeRO-Offload requires DeepSpeedCPUAdam constructed with "
                          "fp32_optimizer_states=False so optimizer moments are stored in bf16 (DeepSpeed's rule): "
                          "pass fp32_optimizer_states=False, or set bf16.bf16_optimizer_states to false")


def _with_master_state(cfg: Config, factory: OptimizerFactory) -> OptimizerFactory:
    """With bf16 master weights under offload, the config's optimizer (DeepSpeed's DeepSpeedCPUAdam
    there, built with ``fp32_optimizer_states = not bf16_optimizer_states``) keeps fp32 moments
    unless ``bf16_optimizer_states``; elsewhere the moments follow the masters' dtype."""
    b = cfg.bf16
    if not (b.bf16_master_weights_and_grads and cfg.zero.offload_optimizer.enabled and cfg.optimizer is not None):
        return factory

    def make(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        opt = factory(groups)
        assert isinstance(opt, FusedAdamW)  # engine.config.low_precision admits only the CPU Adam here
        opt.state_dtype = None if b.bf16_optimizer_states else torch.float32
        return opt

    return make


def build_engine_optimizer(cfg: Config, params: Any, factory: OptimizerFactory, *,
                           groups: ParallelGroups, tied_params: Sequence[torch.nn.Parameter] = (),
                           module: Optional[torch.nn.Module] = None) -> ZeroOptimizer:
    """The ZeRO optimizer of ``cfg.zero.stage`` over ``params`` with its loss scaler and clipping.
    With ``optimizer.type`` Muon, ``params`` are split into Muon and AdamW groups first
    (:func:`engine.optim.muon_assign.split_muon_groups`, names taken from ``module``); with
    no optimizer section (a client optimizer, ``factory``), ``params`` are used as given."""
    policy = precision_policy(cfg)
    factory = _with_master_state(cfg, factory)
    if cfg.optimizer is not None and isinstance(cfg.optimizer.params, MuonParams):  # None: a client optimizer
        params = _muon_groups_everywhere(cfg.optimizer.params, params, module)
    f = cfg.fp16
    scaler = build_loss_scaler(policy.compute_dtype, loss_scale=f.loss_scale,
                               initial_scale_power=f.initial_scale_power, loss_scale_window=f.loss_scale_window,
                               hysteresis=f.hysteresis, consecutive_hysteresis=f.consecutive_hysteresis,
                               min_loss_scale=f.min_loss_scale)
    z = cfg.zero
    offload = OffloadOptions(optimizer=z.offload_optimizer.enabled, param=z.offload_param.enabled,
                             pin_memory=z.offload_optimizer.pin_memory or z.offload_param.pin_memory)
    return build_zero_optimizer(
        z.stage, params, factory, groups, module=module, tied_params=tied_params, precision=policy, loss_scaler=scaler,
        role_groups=groups.expert_roles(),
        reduce_bucket_size=z.reduce_bucket_size, overlap_comm=z.overlap_comm, clip_grad=cfg.gradient_clipping,
        stage3_prefetch_bucket_size=z.stage3_prefetch_bucket_size,
        stage3_max_live_parameters=z.stage3_max_live_parameters,
        stage3_max_reuse_distance=z.stage3_max_reuse_distance,
        stage3_param_persistence_threshold=z.stage3_param_persistence_threshold, offload=offload)


def _muon_groups_everywhere(p: MuonParams, params: Any, module: Optional[torch.nn.Module]) -> list[dict[str, Any]]:
    """The Muon / AdamW split, with a bad pattern (which may match parameters of one
    pipeline stage only) raised on every rank before any rank enters a collective."""
    groups, err = None, None
    try:
        groups = split_muon_groups(params, module, p.muon_params or (), p.adam_params or ())
    except ValueError as exc:
        err = str(exc)
    if dist.is_initialized() and dist.get_world_size() > 1:
        errs: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errs, err)
        bad = [(r, e) for r, e in enumerate(errs) if e is not None]
        if bad:
            raise ConfigError(f"optimizer.params (Muon) on rank {bad[0][0]}: {bad[0][1]}")
    if err is not None or groups is None:
        raise ConfigError(f"optimizer.params (Muon): {err}")
    return groups


def build_scheduler(cfg: Config, optimizer: ZeroOptimizer, client: Union[None, Any] = None,
                    client_optimizer: Optional[torch.optim.Optimizer] = None) -> Any:
    """The LR schedule: the client's (an object with ``step()``, or a callable
    ``optimizer -> scheduler`` called with the inner torch optimizer, as DeepSpeed allows),
    else the config's ``scheduler`` section, else None (constant lr).

    A scheduler instance built on ``client_optimizer`` (the object the script passed, which
    the engine re-created over its master shards) keeps driving that object; its group
    options are copied onto the inner optimizer's groups after every step."""
    if client is not None:
        if hasattr(client, "step"):
            bound = getattr(client, "optimizer", optimizer.optimizer)
            if client_optimizer is not None and bound is client_optimizer:
                return ClientLRScheduler(client, client_optimizer, optimizer.optimizer,
                                         [g.key.param_group for g in optimizer.groups])
            if bound is not optimizer.optimizer:
                raise ValueError("the lr_scheduler was built on an optimizer the engine does not step (the engine "
                                 "re-creates the optimizer over its fp32 master shards): build it on the optimizer "
                                 "you pass to initialize, pass a callable optimizer -> scheduler, or use the "
                                 "config's scheduler section")
            return client
        if callable(client):
            return client(optimizer.optimizer)
        raise TypeError(f"lr_scheduler must be a scheduler or a callable optimizer -> scheduler, "
                        f"got {type(client).__name__}")
    if cfg.scheduler is None:
        return None
    return build_lr_scheduler(optimizer, cfg.scheduler.type, cfg.scheduler.params)
