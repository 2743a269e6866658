"""ZeRO-Offload: the fp32 master shard and the optimizer state in host memory.

DeepSpeed's ``zero_optimization.offload_optimizer: {"device": "cpu"}`` (stages 1-3) and
``offload_param`` (stage 3). What lives where, per rank, with ``N`` the DP size and ``Psi``
the parameter count:

- device: the compute-dtype parameters (stages 1/2: all of them; stage 3: the gathered
  units), the pooled reduction buckets and the fp32 gradient SHARD ``(shard,)`` (4 Psi / N,
  the reduce-scatter's target: :attr:`FlatGroup.grad`);
- host (page-locked when ``pin_memory`` and CUDA are there): the fp32 master shard, its
  gradient copy and the optimizer moments (12 Psi / N for Adam, plus the 4 Psi / N gradient
  copy), and with ``offload_param`` the stage-3 compute-dtype parameter shards, which are
  copied to the device just before each all-gather.

The step (:meth:`HostStep.copy_out`, the inner optimizer's ``step`` on the host,
:meth:`HostStep.send_buffer` as parameters are published):

1. the reduction, global norm, overflow vote and clipping run on the device exactly as
   without offload (the norm the step computes anyway; no extra pass over the gradients);
2. copy out: each group's reduced fp32 gradient shard -> its host copy (a side stream and
   non-blocking copies into pinned memory on CUDA; one synchronisation before the step);
3. the inner optimizer steps on the host: for Adam/AdamW the fused C++ CPU kernel
   (csrc/adam, engine.ops.adam; the PyTorch reference when it cannot be built), which also
   writes the bf16/fp16 copy of the updated master in the same pass (mixed precision);
4. copy back: each bucket's updated shard (that low-precision copy, or the fp32 master)
   goes to the device and is all-gathered into the parameters as without offload.

The same kernel on the same values gives the same bits as the step without offload
(``FusedAdamW`` runs that kernel on a CPU device too), so runs, checkpoints and resumes move
between offloaded and not offloaded freely: the state dict is the same (host tensors).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from engine.timers import PhaseTimers

__all__ = ["OffloadOptions", "NO_OFFLOAD", "HostStep", "host_zeros", "pinned"]


@dataclass(frozen=True)
class OffloadOptions:
    """``optimizer``: master shards and optimizer state on the host (stages 1-3);
    ``param``: ZeRO-3 parameter shards on the host; ``pin_memory``: page-locked host buffers
    (CUDA only: on a CPU-only run pinning has no meaning and is skipped)."""

    optimizer: bool = False
    param: bool = False
    pin_memory: bool = False

    @property
    def enabled(self) -> bool:
        return self.optimizer or self.param


NO_OFFLOAD = OffloadOptions()  # everything on the device


def pinned(pin_memory: bool) -> bool:
    """Whether host buffers are page-locked: asked for, and CUDA present (pinning is a CUDA
    host-allocator feature; never called on a CPU-only run)."""
    return bool(pin_memory) and torch.cuda.is_available()


def host_zeros(numel: int, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
    """A ``(numel,)`` host tensor of zeros, page-locked when :func:`pinned`."""
    return torch.zeros(numel, dtype=dtype, device="cpu", pin_memory=pinned(pin_memory))


class HostStep:
    """The offloaded step's transfers and their timings (``wall_clock_breakdown`` phases
    ``offload_copy_out``, ``offload_cpu_step``, ``offload_copy_back``)."""

    def __init__(self, device: torch.device, options: OffloadOptions) -> None:
        self.device = device
        self.options = options
        # CUDA: a side stream for the device -> host copies so they do not queue behind
        # the compute stream's next work; none on CPU (a plain copy)
        self.stream: Optional[Any] = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.timers = PhaseTimers(False)

    def copy_out(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``host.copy_(device)`` for each (host, device) pair of fp32 gradient shards."""
        with self.timers.phase("offload_copy_out"):
            if self.stream is None:
                for host, dev in pairs:
                    host.copy_(dev)
                return
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the reductions/clipping
            with torch.cuda.stream(self.stream):
                for host, dev in pairs:
                    host.copy_(dev, non_blocking=True)
            self.stream.synchronize()  # the host step reads them next

    def cpu_step(self, step: Any) -> Any:
        """Run ``step()`` (the inner optimizer's) as the ``offload_cpu_step`` phase."""
        with self.timers.phase("offload_cpu_step"):
            return step()

    def copy_back_phase(self) -> contextlib.AbstractContextManager[None]:
        return self.timers.phase("offload_copy_back")

    def to_device(self, host: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A device copy of a host shard in ``dtype`` (the all-gather's send buffer);
        non-blocking from pinned memory on CUDA."""
        if host.dtype != dtype:
            host = host.to(dtype)  # round to nearest even, as on the device
        return host.to(self.device, non_blocking=host.is_pinned(), copy=True)
