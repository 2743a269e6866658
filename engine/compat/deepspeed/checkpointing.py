"""DeepSpeed's (and Megatron-DeepSpeed's) activation-checkpointing API for users' own models:
``deepspeed.checkpointing`` with the same names and signatures (deepspeed 0.19.8):

    checkpointing.configure(mpu, deepspeed_config=None, partition_activations=None, ...)
    y = checkpointing.checkpoint(block, x, mask)          # inside the model's forward
    checkpointing.model_parallel_cuda_manual_seed(seed)   # once, after the groups exist
    with checkpointing.get_cuda_rng_tracker().fork():      # dropout in TP regions
        ...

``checkpoint`` is :class:`engine.models.recompute.Recompute`: the function runs without a
graph, its tensor arguments are saved (the first one as this rank's 1/tp slice with
``partition_activations``; in host memory with ``checkpoint_in_cpu``), and backward replays
it under the forward's RNG states (the default generator and every state of the tracker),
so dropout masks and results are those of the forward. It runs on any device (CPU too).

Accepted and without effect: ``contiguous_checkpointing`` / ``num_checkpoints`` (DeepSpeed's
pre-allocated checkpoint buffer; the caching allocator serves this), ``synchronize`` and
``profile`` (DeepSpeed's timers), and the config's matching keys (engine/config/ignored.py).
As in DeepSpeed, the argument ``contiguous_checkpointing`` requires partitioned activations
and ``num_checkpoints``.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

import torch

from engine.config.reader import Section
from engine.config.sections import parse_activation_checkpointing
from engine.distributed.groups import NO_TP, AxisGroup
from engine.models.recompute import Recompute, RecomputeOptions, host_offload

__all__ = ["configure", "checkpoint", "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed", "is_configured",
           "reset", "CudaRNGStatesTracker", "CheckpointFunction"]

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"  # DeepSpeed's name of the TP state


@dataclass
class _Settings:
    configured: bool = False
    partition: bool = False
    cpu: bool = False
    contiguous: bool = False
    num_checkpoints: Optional[int] = None
    tp_group: AxisGroup = NO_TP
    tp_rank: int = 0


_SETTINGS = _Settings()


# ------------------------------------------------------------------ RNG states
def _device_rng() -> tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]]:
    """Get/set of the accelerator's default generator (CUDA when available, else the CPU one,
    as DeepSpeed's accelerator abstraction picks)."""
    if torch.cuda.is_available():
        return torch.cuda.get_rng_state, torch.cuda.set_rng_state
    return torch.get_rng_state, torch.set_rng_state


class CudaRNGStatesTracker:
    """Named RNG states (Megatron's tracker): ``add(name, seed)`` makes one, ``fork(name)``
    runs a block under it (and keeps its advance), ``get_states``/``set_states`` copy them."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        get, set_ = _device_rng()
        here = get()
        if torch.cuda.is_available():
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states_[name] = get()
        set_(here)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        get, set_ = _device_rng()
        here = get()
        set_(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = get()
            set_(here)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The tracker ``checkpoint`` saves and replays (DeepSpeed's ``get_cuda_rng_tracker``)."""
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """DeepSpeed's seeding: the default generator gets ``seed`` (same on the TP ranks), the
    tracker's model-parallel state ``seed + 2718 + tp_rank`` (different on each TP rank).
    The TP rank is the one of the ``mpu`` given to :func:`configure` (0 before)."""
    _TRACKER.reset()
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    _TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + _SETTINGS.tp_rank)


# ------------------------------------------------------------------ configuration
def _tp_of(mpu: Any) -> tuple[AxisGroup, int]:
    if mpu is None:
        return NO_TP, 0
    if hasattr(mpu, "get_tensor_model_parallel_rank"):
        rank, size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
        group = mpu.get_tensor_model_parallel_group()
    else:
        rank, size = mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()
        group = mpu.get_model_parallel_group()
    if size <= 1:
        return NO_TP, rank
    return AxisGroup.of(group, "tensor model parallel (mpu)"), rank


def _read_config(deepspeed_config: Union[str, dict, Any]) -> dict:
    if isinstance(deepspeed_config, str):
        with open(deepspeed_config) as f:
            return dict(json.load(f))
    if isinstance(deepspeed_config, dict):
        return deepspeed_config
    raise TypeError(f"deepspeed_config must be a JSON path or a dict, got {type(deepspeed_config).__name__}")


def configure(mpu_: Any, deepspeed_config: Any = None, partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
              checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
              profile: Optional[bool] = None) -> None:
    """DeepSpeed's ``configure``: the config's ``activation_checkpointing`` section first, then
    the keyword arguments given (not None) override it. ``mpu_``: Megatron's model-parallel
    unit (``get_tensor_model_parallel_group``/``_rank``/``_world_size``, or the older
    ``get_model_parallel_*``), or None without TP."""
    s = _SETTINGS
    if deepspeed_config is not None:
        raw = _read_config(deepspeed_config)
        ac = parse_activation_checkpointing(Section({"activation_checkpointing": raw.get("activation_checkpointing")},
                                                    "", ("activation_checkpointing",)))
        s.partition, s.cpu = ac.partition_activations, ac.cpu_checkpointing
    if partition_activations is not None:
        s.partition = bool(partition_activations)
    if contiguous_checkpointing is not None:
        s.contiguous = bool(contiguous_checkpointing)
    if num_checkpoints is not None:
        s.num_checkpoints = num_checkpoints
    if checkpoint_in_cpu is not None:
        s.cpu = bool(checkpoint_in_cpu)
    if s.contiguous and not s.partition:
        raise ValueError("contiguous checkpointing is only available with partitioned activations: set "
                         "partition_activations true (activation_checkpointing.partition_activations)")
    if s.contiguous and s.num_checkpoints is None:
        raise ValueError("contiguous checkpointing needs the number of layers: pass num_checkpoints "
                         "(activation_checkpointing.number_checkpoints)")
    s.tp_group, s.tp_rank = _tp_of(mpu_)
    s.configured = True


def is_configured() -> bool:
    """True once :func:`configure` was called (DeepSpeed's ``is_configured``)."""
    return _SETTINGS.configured


def reset() -> None:
    """DeepSpeed frees its contiguous buffers here; nothing is pre-allocated in this engine."""


# ------------------------------------------------------------------ checkpoint
def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, recomputed in backward (DeepSpeed's ``checkpoint``)."""
    if kwargs:
        keys, n, inner = tuple(kwargs), len(args), function

        def function(*all_args: Any) -> Any:
            return inner(*all_args[:n], **dict(zip(keys, all_args[n:])))

        args = args + tuple(kwargs.values())
    if not torch.is_grad_enabled():
        return function(*args)
    s = _SETTINGS
    tracked = _TRACKER.get_states()
    calls = [0]

    def run(*a: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:  # the forward
            return function(*a)
        here = _TRACKER.get_states()  # the recomputation: the tracker as in the forward
        _TRACKER.set_states(tracked)
        try:
            return function(*a)
        finally:
            _TRACKER.set_states(here)

    options = RecomputeOptions(partition=s.tp_group if s.partition else NO_TP)
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    offload = host_offload(device) if s.cpu else contextlib.nullcontext()
    with offload:
        return Recompute.apply(run, options, *args)


class CheckpointFunction:
    """DeepSpeed's ``CheckpointFunction.apply(function, all_outputs, *args)``, the autograd
    function behind its ``checkpoint``: runs :func:`checkpoint` and appends the function's
    outputs to ``all_outputs`` (DeepSpeed's channel for outputs that are not tensors)."""

    @staticmethod
    def apply(function: Callable[..., Any], all_outputs: list, *args: Any) -> Any:
        out = checkpoint(function, *args)
        all_outputs.extend(out if isinstance(out, tuple) else [out])
        return out
