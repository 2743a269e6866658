"""``engine.zero.Init`` and ``engine.zero.GatheredParameters``: DeepSpeed's names and semantics.

``with engine.zero.Init(data_parallel_group=group): model = MyModel()`` builds a model
whose parameters are partitioned over the data-parallel group as they are created: when a
module's constructor returns, each parameter it registered directly is cut into ``N`` equal
flat pieces (padded at the end), this rank keeps its piece as ``p.ds_tensor`` ``(ceil(n/N),)``
and ``p.data`` becomes an empty placeholder. At any moment a rank holds its shards plus
the parameters of the one module under construction (its children are already
partitioned), never the whole model. Because a shard is the slice of the value the module
initialised, a model whose initialisation depends only on the seed (the reference GPT:
per-parameter generators) has shards equal to the slices of the unsharded model.

Attributes set on a partitioned parameter (DeepSpeed's): ``ds_tensor``, ``ds_numel``,
``ds_shape``, ``ds_process_group``. :class:`engine.zero.Zero3Optimizer` takes such
parameters and lays out its buckets from the shards (one parameter gathered at a time).

``with engine.zero.GatheredParameters(params, modifier_rank=None):`` makes the given
parameters whole on every rank inside the block (partitioned ones from their shards,
stage-3 optimizer-managed ones from their buckets); on exit they are partitioned again.
With ``modifier_rank=r`` the values rank ``r`` (a rank of the parameters' data-parallel
group) holds at exit are broadcast and written back to every shard (and to the fp32 master
of an optimizer that manages them); with ``None`` changes are discarded. A collective:
every rank of the group must enter with the same parameters.

Modules whose constructors are being wrapped: every subclass of ``nn.Module`` known when
the context is entered, and any defined inside it (as DeepSpeed does).

Where the shards live (DeepSpeed's rule): ``remote_device="cpu"`` (or, with
``remote_device=None``, a ``config_dict_or_path`` whose ``zero_optimization.offload_param.device``
is ``"cpu"``) keeps them in host memory; otherwise they go to the accelerator of this rank,
the device the default process group's collectives run on (``cuda:<local rank>`` under
NCCL, the CPU under gloo; :func:`engine.distributed.env.device_for_initialised_group`). A
parameter is built where its module builds it (one module at a time) and only its slice is
copied to that device. The empty placeholder ``p.data`` sits on the shard's device, so a
later ``model.to(device)`` moves the placeholder, and the shard follows it when the
parameter is next gathered (:func:`gather_partitioned`): gathers always run where the
placeholder is, the device NCCL needs.
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Any, Iterable, Optional, Protocol, TypeGuard, Union, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from engine.config.reader import read_json_file
from engine.distributed import comm
from engine.distributed.env import device_for_initialised_group
from engine.distributed.groups import AxisGroup
from engine.placement import placement_of

__all__ = ["Init", "GatheredParameters", "is_partitioned", "param_numel", "param_shape", "register_managed",
           "gather_partitioned", "shard_range", "accelerator_device"]


class PartitionedParameter(Protocol):
    """A parameter after :class:`Init` partitioned it (DeepSpeed's attribute names)."""

    data: torch.Tensor  # empty placeholder between uses
    ds_tensor: torch.Tensor  # (ceil(numel / world),) this rank's shard
    ds_numel: int
    ds_shape: torch.Size
    ds_process_group: AxisGroup  # the data-parallel axis it is sharded over


def is_partitioned(p: torch.Tensor) -> TypeGuard[PartitionedParameter]:
    """Whether ``p`` was partitioned by :class:`Init` (its values live in ``p.ds_tensor``)."""
    return getattr(p, "ds_tensor", None) is not None


def param_numel(p: torch.Tensor) -> int:
    """Elements of the whole parameter (also when partitioned)."""
    return int(p.ds_numel) if is_partitioned(p) else p.numel()


def param_shape(p: torch.Tensor) -> torch.Size:
    return p.ds_shape if is_partitioned(p) else p.shape


def shard_range(numel: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of shard ``rank`` of a flat ``numel``-element parameter cut in ``world``
    equal pieces of ``ceil(numel / world)`` (the last ones padded past ``numel``)."""
    per = -(-numel // world)
    return rank * per, (rank + 1) * per


def _partition(p: nn.Parameter, group: AxisGroup, dtype: Optional[torch.dtype], device: torch.device) -> None:
    world, rank = comm.group_size(group), comm.group_rank(group)
    flat = p.detach().reshape(-1)
    if dtype is not None and flat.is_floating_point():
        flat = flat.to(dtype)
    n = flat.numel()
    lo, hi = shard_range(n, rank, world)
    shard = torch.zeros(hi - lo, dtype=flat.dtype, device=device)  # (ceil(n/world),) on the shards' device
    if lo < n:
        shard[:min(hi, n) - lo].copy_(flat[lo:min(hi, n)])
    part = cast(PartitionedParameter, p)  # it becomes one here
    part.ds_shape, part.ds_numel, part.ds_process_group = p.shape, n, group
    part.ds_tensor = shard
    set_data(p, torch.empty(0, dtype=flat.dtype, device=device))


def set_data(p: Any, t: torch.Tensor) -> None:  # a Parameter, also typed as a PartitionedParameter
    """``p.data = t``, also where the two tensor types cannot share a shallow copy (a
    placeholder on another kind of device, e.g. the meta device tests use as a fake
    accelerator): then ``p`` is swapped in place (``torch.utils.swap_tensors``, as
    ``nn.Module.to`` does) and keeps its Python attributes."""
    if torch._has_compatible_shallow_copy_type(p.data, t):  # dense CPU <-> CUDA
        p.data = t
        return
    attrs = dict(p.__dict__)
    torch.utils.swap_tensors(p, nn.Parameter(t, requires_grad=p.requires_grad))
    p.__dict__.update(attrs)


def _follow_placeholder(p: PartitionedParameter) -> None:
    """``model.to(device)`` moved the empty placeholder only: bring the shard after it."""
    if p.ds_tensor.device != p.data.device:
        p.ds_tensor = p.ds_tensor.to(p.data.device)


def gather_partitioned(p: PartitionedParameter) -> torch.Tensor:
    """The whole value of a partitioned parameter, ``ds_shape`` (one all-gather), on the
    device of its placeholder ``p.data`` (the shard moves there first if the model was moved)."""
    _follow_placeholder(p)
    group = p.ds_process_group
    world = comm.group_size(group)
    full = torch.empty(p.ds_tensor.numel() * world, dtype=p.ds_tensor.dtype, device=p.ds_tensor.device)
    comm.all_gather(full, p.ds_tensor, group)
    return full[:p.ds_numel].view(p.ds_shape)


def accelerator_device() -> torch.device:
    """This rank's accelerator: the device the default group's collectives run on
    (``cuda:<local rank>`` under NCCL, resolved as :func:`engine.initialize` does; the CPU
    under gloo or without an initialised group)."""
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return torch.device("cpu")
    bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
    kind, index = device_for_initialised_group("nccl", bound.index if bound is not None else None,
                                               torch.cuda.current_device(), torch.cuda.device_count())
    return torch.device(kind) if index is None else torch.device(kind, index)


def _config_dict(config: Any) -> dict:
    """``config_dict_or_path`` as a dict: a dict, a JSON file's path, or None (empty)."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)):
        raw = read_json_file(config)
        if isinstance(raw, dict):
            return raw
    raise TypeError(f"engine.zero.Init: config_dict_or_path must be a dict or the path of a JSON file, "
                    f"got {type(config).__name__}")


def _section(raw: dict, *keys: str) -> dict:
    for k in keys:
        v = raw.get(k)
        raw = v if isinstance(v, dict) else {}
    return raw


def _placement_from(remote_device: Optional[str], config: dict) -> str:
    """DeepSpeed's rule: an explicit ``remote_device``, else the config's
    ``zero_optimization.offload_param.device``, else the accelerator ("device")."""
    offload = _section(config, "zero_optimization", "offload_param").get("device")
    where = remote_device if remote_device is not None else (offload if offload not in (None, "none") else None)
    if where not in (None, "cpu", "cuda"):
        raise ValueError(f"engine.zero.Init: parameters on {where!r} (remote_device or zero_optimization."
                         "offload_param.device) are not supported: use None (the accelerator) or 'cpu'")
    return "cpu" if where == "cpu" else "device"


def _dtype_from(config: dict) -> Optional[torch.dtype]:
    """DeepSpeed: the config's half precision, when ``dtype`` is not given."""
    if _section(config, "bf16").get("enabled") is True:
        return torch.bfloat16
    if _section(config, "fp16").get("enabled") is True:
        return torch.float16
    return None


def _all_subclasses(cls: type) -> list[type]:
    out: list[type] = []
    todo: list[type] = [cls]
    while todo:
        c = todo.pop()
        subclasses: list[type] = c.__subclasses__()
        for s in subclasses:
            out.append(s)
            todo.append(s)
    return out



def _dp_axis(group: Union[AxisGroup, dist.ProcessGroup, None]) -> AxisGroup:
    """DeepSpeed's ``data_parallel_group`` as an axis value: None is the world, as in DeepSpeed."""
    if isinstance(group, AxisGroup):
        return group
    return AxisGroup.world() if group is None else AxisGroup.of(group, "data_parallel_group")

_NO_EXPERT_GROUP = AxisGroup.single("expert_grad")  # Init's default: expert parameters stay whole


class Init:
    """Partition parameters over the data-parallel group as modules are built (see the
    module docstring). DeepSpeed's keyword names; ``data_parallel_group``: an
    :class:`~engine.distributed.groups.AxisGroup` or a torch process group, None meaning the
    default (world) group as in DeepSpeed (converted here, at the DeepSpeed edge); ``dtype``: the shards' dtype (default:
    the config's bf16/fp16 when ``config_dict_or_path`` enables one, else as built);
    ``remote_device`` / ``config_dict_or_path``: where the shards live (module docstring;
    ``config`` is DeepSpeed's deprecated name of the latter); ``enabled=False``: a no-op
    context. Options DeepSpeed offers for NVMe offload (``remote_device="nvme"``,
    ``pin_memory``) are refused rather than ignored. ``expert_group`` (this engine's, not
    DeepSpeed's): the replicas of this rank's experts (the expert-gradient role); a parameter
    whose placement is an expert shard (:func:`engine.placement.set_expert_placement`) when its
    module's constructor returns is partitioned over it, as ZeRO-3 partitions its gradient; by
    default (a size-1 group) such a parameter stays whole (its values differ between
    expert-parallel ranks, so no shard of the data-parallel group could hold it)."""

    def __init__(self, module: Optional[nn.Module] = None,  # noqa: PLR0913 (DeepSpeed's keywords + expert_group)
                 data_parallel_group: Union[AxisGroup, dist.ProcessGroup, None] = None,
                 mem_efficient_linear: bool = True, remote_device: Optional[str] = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: Optional[torch.dtype] = None, mpu: Any = None,
                 expert_group: AxisGroup = _NO_EXPERT_GROUP) -> None:
        if pin_memory:
            raise ValueError("engine.zero.Init: pin_memory=True is not supported; leave it False")
        if config is not None and config_dict_or_path is not None:
            raise ValueError("engine.zero.Init: pass config_dict_or_path only (config is its deprecated name)")
        raw = _config_dict(config_dict_or_path if config_dict_or_path is not None else config)
        where = _placement_from(remote_device, raw)
        if mpu is not None:
            raise ValueError("engine.zero.Init: mpu is not supported; pass data_parallel_group=")
        if enabled and not dist.is_initialized():
            raise RuntimeError("engine.zero.Init needs an initialised process group (engine.distributed.env."
                               "init_distributed(), or gloo with world_size=1)")
        self.group = _dp_axis(data_parallel_group) if enabled else AxisGroup.single("dp")
        self.expert_group = expert_group
        self.enabled = bool(enabled)
        self.dtype = dtype if dtype is not None else _dtype_from(raw)
        # the shards' device: host memory or this rank's accelerator (module docstring)
        self.device = torch.device("cpu") if where == "cpu" else accelerator_device()
        self._saved: dict[type, Any] = {}
        self._depth: dict[int, int] = {}
        self._prev_subclass_hook: Any = None
        if module is not None and self.enabled:  # DeepSpeed: partition an already built module
            for m in module.modules():
                self._partition_module(m)

    # ------------------------------------------------------------------ context
    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        for cls in [nn.Module] + _all_subclasses(nn.Module):
            self._wrap(cls)
        init_obj = self
        prev = nn.Module.__dict__.get("__init_subclass__")
        self._prev_subclass_hook = prev

        def hook(cls: type[nn.Module], **kw: Any) -> None:
            super(nn.Module, cls).__init_subclass__(**kw)
            init_obj._wrap(cls)

        # a classmethod put on nn.Module for the block (as DeepSpeed's zero.Init does)
        nn.Module.__init_subclass__ = classmethod(hook)  # type: ignore[method-assign, assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        for cls, orig in self._saved.items():
            cls.__init__ = orig  # type: ignore[misc]
        self._saved.clear()
        if self._prev_subclass_hook is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self._prev_subclass_hook  # type: ignore[method-assign]

    def _wrap(self, cls: type) -> None:
        if "__init__" not in cls.__dict__ or cls in self._saved:
            return
        orig = cls.__dict__["__init__"]
        self._saved[cls] = orig
        init_obj = self

        @functools.wraps(orig)
        def wrapped(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            key = id(module)
            init_obj._depth[key] = init_obj._depth.get(key, 0) + 1
            try:
                orig(module, *args, **kwargs)
            finally:
                init_obj._depth[key] -= 1
            if init_obj._depth[key] == 0:  # the outermost constructor of this module returned
                del init_obj._depth[key]
                init_obj._partition_module(module)

        cls.__init__ = wrapped  # type: ignore[misc]

    def _partition_module(self, module: nn.Module) -> None:
        for p in module.parameters(recurse=False):
            if is_partitioned(p):
                continue
            if placement_of(p).expert_sharded:  # this rank's experts: replicated over the expert group only
                if self.expert_group.size > 1:
                    _partition(p, self.expert_group, self.dtype, self.device)
                continue
            _partition(p, self.group, self.dtype, self.device)


# ---------------------------------------------------------------------- optimizer-managed parameters
# id(param) -> (weakref to param, weakref to the Zero3Optimizer that holds its shard)
_MANAGED: dict[int, tuple[Any, Any]] = {}


def register_managed(params: Iterable[torch.Tensor], optimizer: Any) -> None:
    """Called by :class:`engine.zero.Zero3Optimizer` for the parameters it shards, so that
    :class:`GatheredParameters` can gather them from its buckets."""
    ref = weakref.ref(optimizer)
    for p in params:
        _MANAGED[id(p)] = (weakref.ref(p), ref)


def _manager(p: torch.Tensor) -> Any:
    entry = _MANAGED.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


class GatheredParameters:
    """Whole parameters inside the block, partitioned again on exit (see the module
    docstring). ``params``: one parameter or an iterable; parameters that are neither
    partitioned nor managed by a stage-3 optimizer are left alone. ``modifier_rank``: the
    rank (in the parameters' data-parallel group) whose changes are kept, or None."""

    def __init__(self, params: Union[torch.Tensor, Iterable[torch.Tensor]], modifier_rank: Optional[int] = None,
                 fwd_module: Optional[nn.Module] = None, enabled: bool = True) -> None:
        plist = [params] if isinstance(params, torch.Tensor) else list(params)
        self.enabled = bool(enabled)
        self.modifier_rank = modifier_rank
        self.partitioned = [p for p in plist if is_partitioned(p)]
        self.managed: dict[int, tuple[Any, list[torch.Tensor]]] = {}
        for p in plist:
            opt = None if is_partitioned(p) else _manager(p)
            if opt is not None:
                self.managed.setdefault(id(opt), (opt, []))[1].append(p)
        if modifier_rank is not None:
            for p in self.partitioned:
                if not 0 <= modifier_rank < comm.group_size(p.ds_process_group):
                    raise ValueError(f"modifier_rank {modifier_rank} is not a rank of the parameters' data-parallel "
                                     f"group of {comm.group_size(p.ds_process_group)}")

    def __enter__(self) -> None:
        if not self.enabled:
            return
        for p in self.partitioned:
            set_data(p, gather_partitioned(p))
        for opt, ps in self.managed.values():
            opt.gather_for_modification(ps)

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        for p in self.partitioned:
            group = p.ds_process_group
            if self.modifier_rank is not None:
                src = group.global_rank_of(self.modifier_rank)
                comm.broadcast(p.data, src, group)
                world, rank = comm.group_size(group), comm.group_rank(group)
                lo, hi = shard_range(p.ds_numel, rank, world)
                flat = p.data.reshape(-1)
                if lo < p.ds_numel:
                    p.ds_tensor[:min(hi, p.ds_numel) - lo].copy_(flat[lo:min(hi, p.ds_numel)])
            set_data(p, torch.empty(0, dtype=p.ds_tensor.dtype, device=p.ds_tensor.device))
        for opt, ps in self.managed.values():
            opt.release_after_modification(ps, self.modifier_rank)
