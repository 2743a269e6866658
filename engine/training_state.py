"""The engine's training state as one value with PyTorch DCP's ``Stateful`` protocol.

Everything a resumed run needs besides the weights and the optimizer's element-wise
state (which ZeRO exports through its shard view, :mod:`engine.zero.shard_view`):

- ``counters``: ``global_steps``, ``global_samples``, ``micro_steps`` (the engine's) and
  ``skipped_steps`` (the optimizer's fp16 overflow count);
- ``data_position``: the step and the samples consumed (the data order is a pure
  function of the step, so nothing else is needed; informational on load);
- ``lr_scheduler`` and ``lr_scheduler_groups`` (the user param group of each inner group,
  so a per-group list follows its groups under another layout);
- ``loss_scaler``: the scale and its growth/backoff counters;
- ``rng``: this process's Python / NumPy / torch (CPU and CUDA) generator states;
- ``fp8``: the delayed-scaling state (scales, amax histories) of every FP8 layer, keyed
  by the layer's global module name (``layers.{i}.…``); None without FP8 layers;
- ``moe_bias``: the aux-free routing bias of every MoE layer (``model.moe``), keyed
  ``{global module name}.expert_bias``, a list of ``num_experts`` floats by GLOBAL expert
  index (whole and identical on every rank, whatever the expert-parallel size); None without
  MoE layers. fp32 values round-trip exactly through JSON (a Python float holds them).

:meth:`TrainingState.state_dict` returns plain JSON values (the checkpoint stores them in
its metadata); :meth:`TrainingState.load_state_dict` restores the keys that are present,
so a caller leaves out what it does not want restored (``rng`` at another layout,
``lr_scheduler`` when told not to load it). Build it with ``Engine.training_state()``.
"""

from __future__ import annotations

import logging
import random
from typing import Any, Mapping, Optional, Protocol, Sequence, Union

import numpy as np
import torch

from engine.precision.fp8 import Fp8LinearState
from engine.precision.loss_scaler import DynamicLossScaler, StaticLossScaler

__all__ = ["Stateful", "StepCounters", "ScaledOptimizer", "TrainingState", "capture_rng", "restore_rng",
           "encode_bytes", "decode_bytes"]

logger = logging.getLogger(__name__)


class Stateful(Protocol):
    """PyTorch DCP's protocol (``torch.distributed.checkpoint.stateful.Stateful``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class StepCounters(Protocol):
    """The engine's counters (DeepSpeed's names)."""

    global_steps: int
    global_samples: int
    micro_steps: int


class ScaledOptimizer(Protocol):
    """What the training state reads of the optimizer: its loss scaler, its skipped-step
    count and its param groups (the learning rate the next step uses)."""

    loss_scaler: Union[StaticLossScaler, DynamicLossScaler]
    skipped_steps: int

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...


def encode_bytes(b: bytes) -> str:
    import base64

    return base64.b64encode(b).decode("ascii")


def decode_bytes(s: str) -> bytes:
    import base64

    return base64.b64decode(s.encode("ascii"))


def capture_rng(device: torch.device) -> dict[str, Any]:
    """This process's RNG states as JSON values: Python, NumPy, torch CPU (and CUDA)."""
    version, state, gauss = random.getstate()
    np_state: Any = np.random.get_state()  # the legacy tuple (name, keys, pos, has_gauss, cached)
    out: dict[str, Any] = {
        "python": [version, list(state), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch_cpu": encode_bytes(torch.get_rng_state().numpy().tobytes()),
        "torch_cuda": None,
    }
    if device.type == "cuda":
        out["torch_cuda"] = encode_bytes(torch.cuda.get_rng_state(device).numpy().tobytes())
    return out


def restore_rng(rng: dict[str, Any], device: torch.device) -> None:
    """Inverse of :func:`capture_rng`."""
    version, state, gauss = rng["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.frombuffer(bytearray(decode_bytes(rng["torch_cpu"])), dtype=torch.uint8))
    if device.type == "cuda" and rng.get("torch_cuda"):
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(decode_bytes(rng["torch_cuda"])), dtype=torch.uint8),
                                 device)


def _remap_per_group(value: Any, saved_pgs: Sequence[int], new_pgs: Sequence[int]) -> Any:
    """A per-inner-group list of the saved layout -> the new layout's groups (matched by the
    user param group each inner group belongs to)."""
    if not isinstance(value, list) or len(value) != len(saved_pgs) or list(saved_pgs) == list(new_pgs):
        return value
    by_pg = {pg: value[i] for i, pg in enumerate(saved_pgs)}
    return [by_pg[pg] for pg in new_pgs]


class TrainingState:
    """See the module docstring. ``counters``: the engine; ``optimizer``: its ZeRO
    optimizer; ``param_group_ids``: the user param group of each inner param group;
    ``fp8``: the FP8 layers' states by global module name; ``train_batch_size``: samples
    per step (the data position)."""

    def __init__(self, counters: StepCounters, optimizer: ScaledOptimizer, lr_scheduler: Optional[Any],
                 param_group_ids: Sequence[int], fp8: Mapping[str, Fp8LinearState], device: torch.device,
                 moe_bias: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        self.counters, self.optimizer, self.lr_scheduler = counters, optimizer, lr_scheduler
        self.param_group_ids = [int(p) for p in param_group_ids]
        self.fp8 = dict(fp8)
        self.moe_bias = dict(moe_bias or {})
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        c, sched = self.counters, self.lr_scheduler
        return {
            "counters": {"global_steps": c.global_steps, "global_samples": c.global_samples,
                         "micro_steps": c.micro_steps, "skipped_steps": self.optimizer.skipped_steps},
            # the data sampler is a pure function of (seed, step): the step is the data position
            "data_position": {"global_steps": c.global_steps, "consumed_samples": c.global_samples},
            "lr_scheduler": None if sched is None else sched.state_dict(),
            "lr_scheduler_groups": list(self.param_group_ids),
            "loss_scaler": self.optimizer.loss_scaler.state_dict(),
            "rng": capture_rng(self.device),
            "fp8": {name: st.state_dict() for name, st in self.fp8.items()} if self.fp8 else None,
            "moe_bias": {name: [float(v) for v in b.detach().cpu().tolist()] for name, b in self.moe_bias.items()}
            if self.moe_bias else None,
        }

    def moe_bias_names_missing(self, saved: Optional[Mapping[str, Any]]) -> list[str]:
        """This model's MoE routing biases that ``saved`` (a state dict's ``moe_bias``) lacks or
        holds with another number of experts."""
        return sorted(n for n, b in self.moe_bias.items()
                      if saved is None or n not in saved or len(saved[n]) != b.numel())

    def load_moe_bias(self, saved: Mapping[str, Any]) -> None:
        """Copy the saved routing biases into this model's (every one must be there: check
        with :meth:`moe_bias_names_missing` first, on every rank)."""
        missing = self.moe_bias_names_missing(saved)
        if missing:
            raise ValueError(f"the saved MoE routing biases have no entry for {missing[:8]}")
        with torch.no_grad():
            for name, b in self.moe_bias.items():
                b.copy_(torch.tensor(saved[name], dtype=torch.float64).to(b.dtype))

    def fp8_names_missing(self, saved: Optional[Mapping[str, Any]]) -> list[str]:
        """This model's FP8 layers that ``saved`` (a state dict's ``fp8``) has no state for."""
        return sorted(n for n in self.fp8 if saved is None or n not in saved)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the keys present (see the module docstring); ``fp8`` must hold every FP8
        layer of this model (check with :meth:`fp8_names_missing` before, on every rank)."""
        sd = state_dict
        if "counters" in sd:
            c = sd["counters"]
            self.counters.global_steps = int(c["global_steps"])
            self.counters.global_samples = int(c["global_samples"])
            self.counters.micro_steps = int(c["micro_steps"])
            self.optimizer.skipped_steps = int(c["skipped_steps"])
        if "loss_scaler" in sd:
            cur = self.optimizer.loss_scaler.state_dict()
            if set(cur) == set(sd["loss_scaler"]):
                self.optimizer.loss_scaler.load_state_dict(sd["loss_scaler"])
            else:
                logger.warning("the checkpoint's loss scaler (%s) does not match this run's (%s): keeping this "
                               "run's", sorted(sd["loss_scaler"]), sorted(cur))
        sched = self.lr_scheduler
        if sd.get("lr_scheduler") is not None and sched is not None:
            saved_pgs = sd.get("lr_scheduler_groups") or []
            sched.load_state_dict({k: _remap_per_group(v, saved_pgs, self.param_group_ids)
                                   for k, v in sd["lr_scheduler"].items()})
            if hasattr(sched, "get_last_lr"):  # the lr the next step uses, also when moments were not loaded
                for group, lr in zip(self.optimizer.param_groups, sched.get_last_lr()):
                    group["lr"] = lr
        if sd.get("rng") is not None:
            restore_rng(sd["rng"], self.device)
        if sd.get("fp8") is not None and self.fp8:
            missing = self.fp8_names_missing(sd["fp8"])
            if missing:
                raise ValueError(f"the saved FP8 scaling state has no entry for the FP8 layers {missing[:8]}")
            for name, st in self.fp8.items():
                st.load_state_dict(sd["fp8"][name])
