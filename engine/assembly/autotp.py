"""The engine around a model we did not write, with AutoTP (``tensor_parallel.autotp_size``
> 1 and an ``nn.Module`` that is not the reference GPT), as DeepSpeed users call it::

    engine, opt, _, _ = engine.initialize(model=hf_model, model_parameters=hf_model.parameters(),
                                          config=cfg)   # or optimizer=AdamW(hf_model.parameters())

Steps (:func:`autotp_parts`; the assembly then broadcasts from DP rank 0 and builds the
optimizer, :mod:`engine.assembly.assemble`):

1. TP ranks start from TP rank 0's weights (the whole model is broadcast over the TP group,
   parameter by parameter, each through the engine's device and back, so the device holds
   one parameter at a time; skipped for a meta-device model, whose weights are loaded later
   with :func:`engine.checkpoint.hf.load_hf_weights`);
2. :func:`engine.tensor_parallel.auto.autotp` swaps the projections for their shards, where
   the model is (host memory for a model built on the CPU);
3. the model goes to the engine's device and dtype (DP replicas start from DP rank 0's):
   only the shards and the replicated parameters reach the device, never the whole model;
4. the optimizer: the config's, or the client's (an instance built over the *unsharded*
   parameters, or a callable called with the sharded ones), over the sharded parameters,
   as at TP = 1 (:mod:`engine.optim.client`): its param groups and per-group
   hyperparameters are kept, each original parameter replaced by its shard
   (:func:`map_param_groups`); a scheduler built on it keeps driving it;
5. the TP data path: a forward pre-hook on the model broadcasts every tensor argument of
   the forward (``input_ids``, ``labels``, masks) from TP rank 0 over the TP group, on the
   engine's device, so every rank of a TP group computes on the same micro-batch whatever
   its data loader gave it (:class:`TPBatchBroadcast`). ``training_data`` given to
   ``initialize`` is already read per DP rank, so the broadcast then changes nothing.

``engine.train_batch`` works with ``{"input_ids", "labels"}`` micro-batches: without a
``loss_fn`` the model's own causal-LM loss is used (:func:`_hf_train_batch_loss`).
"""

from __future__ import annotations

import logging
import zlib
from typing import Any, Iterable, Optional, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from engine.config import Config
from engine.distributed import comm, strict
from engine.distributed.groups import AxisGroup, ParallelGroups
from engine.errors import ConfigError
from engine.optim.build import (
    OptimizerInputs,
    optimizer_inputs,
    precision_policy,
)
from engine.parts import LossFn, ModelParts
from engine.tensor_parallel.auto import autotp
from engine.tensor_parallel.auto_rules import LayerSpec, parse_layer_specs, specs_for

__all__ = ["autotp_parts", "map_param_groups", "layer_specs_of", "TPBatchBroadcast"]

logger = logging.getLogger(__name__)

_DTYPES = [torch.int64, torch.int32, torch.bool, torch.float32, torch.bfloat16, torch.float16, torch.uint8,
           torch.int8, torch.float64, torch.int16]
_MAX_TENSORS, _MAX_DIMS = 16, 6
_SLOT = 3 + _MAX_DIMS  # key hash, dtype code, ndim, dims


def layer_specs_of(cfg: Config, model: nn.Module) -> tuple[LayerSpec, ...]:
    """The AutoTP specs of the config's ``tensor_parallel`` section for ``model``."""
    t = cfg.tensor_parallel
    user = parse_layer_specs([s.to_dict() for s in t.partition_config.layer_specs])
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    try:
        return specs_for(model_type, t.preset_model, user, t.partition_config.use_default_specs)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def map_param_groups(params: Any, param_map: dict[int, nn.Parameter], model: nn.Module) -> Any:
    """Parameters (or torch-style group dicts) of the unsharded model -> the same over the
    sharded one: each replaced parameter becomes its shard, group options are kept."""
    live = {id(p) for p in model.parameters()}

    def one(p: Any) -> nn.Parameter:
        q = param_map.get(id(p), p)
        if id(q) not in live:
            raise ValueError("a parameter given to engine.initialize (model_parameters or the optimizer's param "
                             "groups) is not a parameter of the model: build them from model.parameters()")
        return q

    items = list(params)
    if items and isinstance(items[0], dict):
        return [{**g, "params": [one(p) for p in (g["params"] if isinstance(g["params"], (list, tuple))
                                                   else [g["params"]])]} for g in items]
    return [one(p) for p in items]


def _optimizer_inputs(cfg: Config, model: nn.Module, client: Any, model_parameters: Optional[list[Any]],
                      param_map: dict[int, nn.Parameter]) -> OptimizerInputs:
    """:func:`engine.optim.build.optimizer_inputs` as at TP = 1, with every original parameter
    mapped onto its shard by ``param_map``."""
    given = model if model_parameters is None else map_param_groups(model_parameters, param_map, model)

    def check(resolved: torch.optim.Optimizer) -> None:  # each client parameter is one of the model's
        map_param_groups(resolved.param_groups, param_map, model)

    return optimizer_inputs(cfg, given, client, param_map, check)


class TPBatchBroadcast:
    """Forward pre-hook: every tensor argument of the forward comes from TP rank 0.

    One fixed-size descriptor broadcast (key, dtype, shape of each tensor argument), one
    all-reduce that checks the ranks passed the same argument structure (so a mismatch is
    an error on every rank, not a hang), one host read of both (the source's shapes size the
    receive buffers: the only device sync of the hook), then one broadcast per tensor.
    Tensors are moved to ``device`` first (NCCL needs them there)."""

    def __init__(self, group: AxisGroup, src: int, device: torch.device) -> None:
        self.group, self.src, self.device = group, src, device
        self.is_src = dist.get_rank() == src

    @staticmethod
    def _slots(args: tuple, kwargs: dict) -> list[tuple[Any, torch.Tensor]]:
        out: list[tuple[Any, torch.Tensor]] = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        out += [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        return out

    def _describe(self, slots: list[tuple[Any, torch.Tensor]]) -> torch.Tensor:
        d = torch.zeros(1 + _MAX_TENSORS * _SLOT, dtype=torch.int64)
        d[0] = len(slots)
        for j, (key, t) in enumerate(slots[:_MAX_TENSORS]):
            row = [zlib.crc32(str(key).encode()), _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1, t.dim()]
            d[1 + j * _SLOT:1 + j * _SLOT + 3] = torch.tensor(row)
            d[1 + j * _SLOT + 3:1 + j * _SLOT + 3 + t.dim()] = torch.tensor(t.shape[:_MAX_DIMS], dtype=torch.int64)
        return d

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        slots = self._slots(args, kwargs)
        mine = self._describe(slots).to(self.device)
        desc = mine.clone()
        comm.broadcast(desc, self.src, self.group)
        # same keys in the same order on every rank (shapes may differ: rank 0's win), decided on
        # the device: the count, and the key hash of each of this rank's slots
        supported = len(slots) <= _MAX_TENSORS and all(t.dtype in _DTYPES and t.dim() <= _MAX_DIMS for _, t in slots)
        keys = torch.arange(min(len(slots), _MAX_TENSORS), device=self.device) * _SLOT + 1
        same = (desc[0] == mine[0]) & (desc[keys] == mine[keys]).all()
        ok = (same & supported).to(torch.int64).view(1)
        comm.all_reduce(ok, self.group, op=dist.ReduceOp.MIN)
        # the one host read of the forward (it was one per descriptor field, 20-30): the source's
        # shapes size the receive buffers, so they must reach the host before the broadcasts
        with strict.host_sync_allowed():
            host = torch.cat([ok, desc]).tolist()
        if not host[0]:
            raise ValueError(f"AutoTP: the ranks of a tensor-parallel group called the model with different tensor "
                             f"arguments (or more than {_MAX_TENSORS} tensors / {_MAX_DIMS} dims, or an unsupported "
                             f"dtype): every TP rank must call it with the same argument names")
        desc_host = host[1:]
        new_args, kwargs = list(args), dict(kwargs)
        for j, (key, t) in enumerate(slots):
            base = 1 + j * _SLOT
            dtype, ndim = _DTYPES[desc_host[base + 1]], desc_host[base + 2]
            shape = desc_host[base + 3:base + 3 + ndim]
            buf = t.to(self.device).contiguous() if self.is_src else torch.empty(shape, dtype=dtype,
                                                                                 device=self.device)
            comm.broadcast(buf, self.src, self.group)
            if isinstance(key, int):
                new_args[key] = buf
            else:
                kwargs[key] = buf
        return tuple(new_args), kwargs


def _hf_train_batch_loss(model: nn.Module, bcast: TPBatchBroadcast) -> Optional[LossFn]:
    """For ``engine.train_batch`` / ``eval_batch`` without a ``loss_fn``: the model's own
    causal-LM loss (``model.loss_function``: labels shifted inside, -100 ignored) of
    ``model(input_ids)`` against the micro-batch's ``labels`` (a dict with ``input_ids`` and
    ``labels``, or an ``(input_ids, labels)`` pair), the labels taken from TP rank 0 like the
    model's inputs. None for a model without ``loss_function`` (not a transformers model)."""
    if not hasattr(type(model), "loss_function"):
        return None

    def loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
        (labels,), _ = bcast(model, (labels,), {})
        logits = output.logits if hasattr(output, "logits") else output
        hf_loss: Any = cast(Any, model).loss_function
        return hf_loss(logits=logits, labels=labels, vocab_size=logits.shape[-1])
    return loss


@torch.no_grad()
def _broadcast_module(module: nn.Module, src: int, group: AxisGroup, device: torch.device) -> None:
    """Every parameter and buffer from global rank ``src``, one at a time through ``device``
    (the collectives' device): a tensor elsewhere (host memory) is copied there, broadcast
    and copied back, so the device holds at most one tensor of the model."""
    if group.size == 1:
        return
    for t in list(module.parameters()) + list(module.buffers()):
        if t.device == device:
            comm.broadcast(t.data, src, group)
            continue
        staged = t.data.to(device)
        comm.broadcast(staged, src, group)
        t.data.copy_(staged)
        del staged


def autotp_parts(cfg: Config, model: nn.Module, client_opt: Any, model_parameters: Optional[Iterable[Any]],
                 groups: ParallelGroups, device: torch.device,
                 loss_fn: Optional[LossFn]) -> tuple[ModelParts, OptimizerInputs]:
    """See the module docstring."""
    if cfg.pp > 1:
        raise ConfigError("AutoTP (a Hugging Face or other user model with tensor_parallel.autotp_size > 1) does "
                          "not compose with pipeline.stages > 1: use pipeline.stages 1, or the reference GPT")
    if cfg.tensor_parallel.sequence_parallel:
        raise ConfigError("tensor_parallel.sequence_parallel is implemented for the reference GPT only, not for "
                          "AutoTP models: set it to false")
    if cfg.fp8.enabled:
        raise ConfigError("fp8.enabled is implemented for the reference GPT only, not for AutoTP models")
    specs = layer_specs_of(cfg, model)
    params_in = None if model_parameters is None else list(model_parameters)
    meta = any(p.is_meta for p in model.parameters())
    tp_src = groups.tp_ranks[0]
    if not meta:
        _broadcast_module(model, tp_src, groups.tp_group, device)   # TP ranks slice the same weights
    result = autotp(model, groups.tp_group, specs)  # split where the model is (the host, usually)
    if not meta:
        model.to(device=device)  # the shards (and replicated parameters) only
    else:
        # weights come later (engine.checkpoint.hf.load_hf_weights); buffers computed in
        # __init__ (rotary inv_freq) are recomputed by the model's own initialiser
        model.to_empty(device=device)
        init = getattr(model, "initialize_weights", None)
        if callable(init):
            init()
    dtype = precision_policy(cfg).compute_dtype
    if dtype != torch.float32:
        model.to(dtype=dtype)
    inputs = _optimizer_inputs(cfg, model, client_opt, params_in, result.param_map)
    bcast = TPBatchBroadcast(groups.tp_group, tp_src, device)
    model.register_forward_pre_hook(bcast, with_kwargs=True)
    logger.info("AutoTP: %d layers split over %d ranks", len(result.replaced), cfg.tp)
    # the DP broadcast (every replica starts from DP rank 0's weights) is the assembly's
    return (ModelParts(model, loss_fn=loss_fn or _hf_train_batch_loss(model, bcast), dtype=dtype),
            inputs)
