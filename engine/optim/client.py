"""What a DeepSpeed script hands to ``initialize`` besides the model: its own optimizer
(an instance or a callable ``params -> Optimizer``), its own LR scheduler (an instance or a
callable ``optimizer -> scheduler``) and a Megatron-style ``mpu``.

The engine never steps the client's optimizer object: the ZeRO optimizer re-creates it
(same class, same per-group hyperparameters) over its fp32 master shards, so the param
groups and their options survive every ZeRO stage. :func:`param_groups_from_client` is
that one mapping (client groups -> torch-style group dicts over the engine's parameters);
a scheduler built on the client's optimizer keeps stepping that object and
:class:`ClientLRScheduler` copies its group options onto the inner optimizer's groups.
"""

from __future__ import annotations

import logging
import re
import warnings
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from engine.config import Config
from engine.errors import ConfigError
from engine.topology import Axis, Topology

__all__ = ["param_groups_from_client", "resolve_client_optimizer", "check_client_objects", "ClientLRScheduler",
           "mpu_mismatch", "agree_on_error"]

logger = logging.getLogger(__name__)


def check_client_objects(cfg: Config, optimizer: Any, lr_scheduler: Any) -> None:
    """Exactly one source for the optimizer and at most one for the schedule (pure: the
    same answer on every rank, so raising here cannot leave a peer hanging)."""
    if optimizer is not None and cfg.optimizer is not None:
        raise ConfigError(f"the config has an optimizer section ({cfg.optimizer.type}) and optimizer= was passed to "
                          "initialize: remove the section to use your optimizer, or pass optimizer=None")
    if optimizer is None and cfg.optimizer is None:
        raise ConfigError("no optimizer: add an optimizer section to the config ({\"type\": \"AdamW\", \"params\": "
                          "{\"lr\": ...}}) or pass optimizer= (a torch.optim.Optimizer or a callable params -> "
                          "optimizer) to initialize")
    if lr_scheduler is not None and cfg.scheduler is not None:
        raise ConfigError(f"the config has a scheduler section ({cfg.scheduler.type}) and lr_scheduler= was passed "
                          "to initialize: remove the section to use your scheduler, or pass lr_scheduler=None")
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler) and \
            not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError("lr_scheduler is a scheduler instance but optimizer= is not an optimizer instance (as in "
                         "DeepSpeed, an instantiated scheduler needs the instantiated optimizer it was built on): "
                         "pass lr_scheduler as a callable optimizer -> scheduler")


def resolve_client_optimizer(client: Any, params: Sequence[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """DeepSpeed's ``optimizer=``: an instance as it is, a callable called with the model's
    parameters (as ``deepspeed.initialize`` calls it)."""
    if isinstance(client, torch.optim.Optimizer):
        return client
    if callable(client):
        out = client(list(params))
        if not isinstance(out, torch.optim.Optimizer):
            raise TypeError(f"the optimizer callable returned {type(out).__name__}, not a torch.optim.Optimizer")
        return out
    raise TypeError(f"optimizer must be a torch.optim.Optimizer, a callable params -> optimizer, or None; "
                    f"got {type(client).__name__}")


def param_groups_from_client(optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter],
                             mapping: Optional[Mapping[int, torch.nn.Parameter]] = None) -> list[dict[str, Any]]:
    """The client's param groups as torch-style dicts over the engine's parameters.

    ``params``: every trainable parameter the engine trains on this rank. ``mapping``:
    ``id(client parameter) -> engine parameter`` where the engine replaced a parameter (a
    TP shard, a pipeline copy of a tied weight); other client parameters must be among
    ``params`` themselves. Client parameters with no counterpart here (another pipeline
    stage's layers) are dropped; every one of ``params`` must be in exactly one group.
    Each group keeps all its options (lr, weight_decay, betas, initial_lr, ...), in the
    client's group order, so group ``i`` here is the client's group ``i``.
    """
    mine = {id(p): p for p in params if p.requires_grad}
    mapping = dict(mapping or {})
    groups, seen = [], set()
    for g in optimizer.param_groups:
        out = []
        for p in g["params"]:
            q = mapping.get(id(p), p)
            if id(q) in mine and id(q) not in seen:
                seen.add(id(q))
                out.append(q)
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": out})
    missing = [p for pid, p in mine.items() if pid not in seen]
    if missing:
        shapes = ", ".join(str(tuple(p.shape)) for p in missing[:4])
        more = ", ..." if len(missing) > 4 else ""
        raise ValueError(f"{len(missing)} trainable parameter(s) of the model (shapes {shapes}{more}) are in "
                         "none of the client optimizer's param groups: add them to a group, or set "
                         "requires_grad=False on them")
    return groups


class ClientLRScheduler:
    """A client scheduler built on the client's optimizer, driving the engine's inner one.

    The scheduler keeps stepping the client's (never stepped) optimizer object; after each
    step the options of client group ``group_of[i]`` are copied onto inner group ``i`` (the
    ZeRO optimizer may split a client group by dtype or tied weight into several flat
    groups). Everything else (``get_last_lr``, ``last_epoch``, ...) is the scheduler's.
    """

    def __init__(self, scheduler: Any, client: torch.optim.Optimizer, inner: torch.optim.Optimizer,
                 group_of: Sequence[int]) -> None:
        if len(group_of) != len(inner.param_groups):
            raise ValueError("group_of must name a client group for every inner param group")
        self.scheduler, self.client, self.inner, self.group_of = scheduler, client, inner, list(group_of)
        self.sync()

    def sync(self) -> None:
        for g, i in zip(self.inner.param_groups, self.group_of):
            for k, v in self.client.param_groups[i].items():
                if k != "params":
                    g[k] = v

    def step(self, *args: Any, **kwargs: Any) -> None:
        with warnings.catch_warnings():
            # the client's optimizer object never steps (the engine's clone does): torch's
            # "lr_scheduler.step() before optimizer.step()" warning does not apply
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            self.scheduler.step(*args, **kwargs)
        self.sync()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)
        # LambdaLR & co. set the lr only on their next step: recompute the current one now
        get_lr = getattr(self.scheduler, "_get_closed_form_lr", None) or getattr(self.scheduler, "get_lr", None)
        last = getattr(self.scheduler, "_last_lr", None)
        if last is not None:
            for g, lr in zip(self.client.param_groups, last):
                g["lr"] = lr
        elif get_lr is not None:
            for g, lr in zip(self.client.param_groups, get_lr()):
                g["lr"] = lr
        self.sync()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["scheduler"], name)


# ---------------------------------------------------------------------------- mpu
_MPU_AXES = {"data": Axis.DP, "model": Axis.TP, "pipe": Axis.PP}


def mpu_mismatch(mpu: Any, topology: Topology, rank: int) -> Optional[str]:
    """Why a Megatron-style ``mpu`` (``get_{data,model,pipe}_parallel_{world_size,rank,group}``)
    does not describe the engine's layout (data = DP, model = TP, pipe = PP), or None when it
    does. Each method the mpu has is compared; groups by their member ranks (no
    communication). A local answer: :func:`agree_on_error` makes every rank raise."""
    if not any(hasattr(mpu, f"get_{a}_parallel_world_size") for a in _MPU_AXES):
        return ("mpu must have Megatron's get_data_parallel_world_size / get_model_parallel_world_size "
                "(and optionally get_pipe_parallel_*) methods")
    coord = topology.coord(rank)
    fix = (f"the engine takes its layout from the config (tensor_parallel.autotp_size = {topology.tp}, "
           f"pipeline.stages = {topology.pp}, data parallel = the rest): make the config and the mpu agree, "
           "or pass mpu=None")
    for name, axis in _MPU_AXES.items():
        expect = {"world_size": topology.size(axis), "rank": getattr(coord, axis.value)}
        for what, want in expect.items():
            fn = getattr(mpu, f"get_{name}_parallel_{what}", None)
            if fn is not None and int(fn()) != want:
                return (f"mpu.get_{name}_parallel_{what}() = {fn()} but the engine's {axis.value} "
                        f"{what.replace('_', ' ')} is {want} on rank {rank}: {fix}")
        fn = getattr(mpu, f"get_{name}_parallel_group", None)
        if fn is not None:
            group = fn()
            try:
                got: Optional[list[int]] = sorted(dist.get_process_group_ranks(group))
            except (RuntimeError, ValueError, AttributeError, KeyError):
                got = None  # not a group this rank belongs to
            want_ranks = sorted(topology.ranks_along(axis, rank))
            if got != want_ranks:
                return (f"mpu.get_{name}_parallel_group() holds ranks {got} but the engine's {axis.value} group "
                        f"of rank {rank} is {want_ranks}: {fix}")
    return None


def agree_on_error(message: Optional[str], device: torch.device, exc: type = ValueError) -> None:
    """Raise on every rank when any rank has a ``message`` (one all-reduce over the default
    group, on ``device``: a CUDA tensor under NCCL), so no peer is left waiting."""
    flag = torch.tensor([0 if message is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag.item()):
        raise exc(message or "another rank refused its arguments (see its error); this rank's were fine")
