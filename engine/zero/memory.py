"""Memory accounting for the ZeRO stages: what a rank holds, and what the ZeRO paper says
it should hold.

The paper (Rajbhandari et al., 2020, sec. 5) counts, for ``Psi`` parameters trained with
mixed-precision Adam on ``N_d`` data-parallel ranks: 2 Psi bytes of fp16 parameters, 2 Psi
of fp16 gradients and K Psi (K = 12: fp32 master weights, momentum, variance) of optimizer
state, and divides by ``N_d``:

    stage 0: (2 + 2 + K) Psi        stage 2: 2 Psi + (2 + K) Psi / N_d
    stage 1: 2 Psi + 2 Psi + K Psi / N_d        stage 3: (2 + 2 + K) Psi / N_d

Our optimizers accumulate and reduce gradients in fp32, so the gradient term uses 4 bytes
per element by default (``grad_bytes``); :func:`zero_state_bytes` adds this engine's
corrections (stage 1's master-gradient shard; fp32 parameters that are the master).

The paper's terms are what a rank holds BETWEEN steps. :func:`zero_peak_formula` adds what
exists only DURING a step, which decides whether a run fits:

- ``buckets`` (stages 2/3, and 1 without accumulation): three bucket-sized fp32
  accumulators (one filling, two being reduce-scattered) and two ``(shard,)`` receive
  buffers: the pooled buffers of :mod:`engine.zero.base`, kept from step to step;
- ``grad_in_flight``: the compute-dtype gradient autograd produces for a parameter before
  the hook moves it into the accumulator, the largest one; at stages 0-2 a tied weight
  (used twice) holds both contributions and their sum until its last use in backward:
  three copies; stage 3 takes each use's contribution as it is computed
  (:mod:`engine.zero.stage3`): two copies (a transposed contribution and its contiguous copy);
- ``gathered`` (stage 3): the unit in use (a tied weight's owner included: it is released
  after its own use's backward), and the prefetch window in flight;
- ``activations``: one micro-batch's activations (given by the caller; measured or
  estimated), since every stage keeps them alike.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

__all__ = ["zero_memory_formula", "zero_state_bytes", "zero_peak_formula", "optimizer_peak_inputs"]


def zero_memory_formula(num_params: int, stage: int, dp: int, *, param_bytes: int = 2,
                        grad_bytes: int = 4, optimizer_bytes: int = 12) -> dict[str, float]:
    """Bytes per rank in parameters, gradients and optimizer state by the ZeRO paper's
    formula (see the module docstring), for ``num_params`` elements on ``dp`` ranks."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {stage}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    n = float(num_params)
    return {
        "params": param_bytes * n / (dp if stage >= 3 else 1),
        "grads": grad_bytes * n / (dp if stage >= 2 else 1),
        "optimizer_state": optimizer_bytes * n / (dp if stage >= 1 else 1),
    }


def zero_state_bytes(num_params: float, stage: int, dp: int, *, param_bytes: float = 2,
                     accumulating: bool = True, accum_bytes: Optional[float] = None) -> dict[str, float]:
    """Bytes per rank in ``params`` / ``grads`` / ``optimizer_state`` that OUR ZeRO
    optimizers hold for ``num_params`` elements on ``dp`` ranks: the paper's formula
    (:func:`zero_memory_formula`, fp32 gradients, K = 12) with this engine's corrections,
    written once here (the planner and the peak formula call it):

    - stage 1 holds its fp32 master-gradient shard (``4 Psi / N_d``) next to the full
      accumulator (``accum_bytes`` per element: ``data_types.grad_accum_dtype``, by default the
      compute dtype's ``param_bytes`` as DeepSpeed), which exists only while gradients
      accumulate (``accumulating``: GA > 1 or a pipeline; otherwise only the shard, the
      buckets being pooled as at stage 2);
    - in fp32 (``param_bytes`` 4) the parameters ARE the fp32 master weights where they are
      not a separate copy: the whole model at stage 0, the compute shard at stage 3.
    """
    n = float(num_params)
    f = zero_memory_formula(int(num_params), stage, dp, param_bytes=int(param_bytes), grad_bytes=4,
                            optimizer_bytes=12)
    f["params"] = param_bytes * n / (dp if stage >= 3 else 1)  # fractional param_bytes kept
    if stage == 1:
        full = (param_bytes if accum_bytes is None else accum_bytes) * n
        f["grads"] = (full if accumulating else 0.0) + 4.0 * n / dp
    if param_bytes == 4 and stage in (0, 3):
        f["optimizer_state"] -= 4.0 * n / (dp if stage == 3 else 1)
    return f


def zero_peak_formula(num_params: int, stage: int, dp: int, *, param_bytes: int = 2,  # noqa: PLR0913 (keyword-only terms of one formula, each defaulted)
                      bucket_numel: int = 0, largest_param_numel: int = 0, unit_numel: int = 0,
                      prefetch_numel: int = 0, tied_numel: int = 0, activation_bytes: float = 0.0,
                      accumulating: bool = True, torch_adam: bool = False, grad_bytes: int = 4,
                      optimizer_bytes: int = 12, first_step: bool = False,
                      accum_bytes: Optional[float] = None) -> dict[str, float]:
    """Per-rank peak bytes during a step, by term (see the module docstring) and ``peak``.

    ``bucket_numel``: the largest bucket (padded elements); ``largest_param_numel``: the
    largest parameter; ``unit_numel`` / ``prefetch_numel``: stage 3's largest gathered unit
    and its prefetch window (``stage3_prefetch_bucket_size``); ``tied_numel``: a tied
    weight held whole on this rank (0 if none); ``accumulating``: gradients accumulate over
    several micro-batches (GA > 1 or a pipeline), the case in which stage 1 holds full
    gradients (otherwise it reduces through pooled buckets as stage 2), ``accum_bytes`` per
    element (default ``param_bytes``: DeepSpeed's default ``grad_accum_dtype``). ``states`` is the
    engine's (:func:`zero_state_bytes`). The backward transients and the optimizer step's
    temporaries (``torch_adam``: torch's update stepped in chunks, two chunk-sized
    temporaries; the fused kernel none) do not coexist; the pooled buckets are in both, stage
    1's full accumulator only in backward: ``peak = max(states + backward, states - full + step)``. ``first_step``: the peak of a run's FIRST
    optimizer step, in which Adam's moments (``8 Psi / N_d`` bytes) are created by the
    update, after backward: ``max(states - moments + backward, states + step)``."""
    if (grad_bytes, optimizer_bytes) != (4, 12):
        raise ValueError("zero_peak_formula models this engine's optimizers: fp32 gradients (grad_bytes 4) "
                         "and Adam's K = 12 (optimizer_bytes 12)")
    accum = float(param_bytes if accum_bytes is None else accum_bytes)
    states = sum(zero_state_bytes(num_params, stage, dp, param_bytes=param_bytes,
                                  accumulating=accumulating, accum_bytes=accum).values())
    # stage 1 reduces through the pooled buckets without accumulation, and with a
    # low-precision accumulator (copied to a pooled fp32 bucket to be reduced)
    pooled = stage >= 2 or (stage == 1 and (not accumulating or accum < 4))
    # three pooled accumulators (two reductions in flight, one filling) + two receive shards,
    # fewer when the model has fewer buckets
    held = min(3, math.ceil(num_params / bucket_numel)) if bucket_numel > 0 else 0
    out = {
        "states": states,
        "buckets": (held * 4.0 * bucket_numel + min(2, held) * 4.0 * bucket_numel / dp) if pooled else 0.0,
        "grad_in_flight": float(param_bytes * max(largest_param_numel, (2 if stage == 3 else 3) * tied_numel)),
        "gathered": float(param_bytes * (max(unit_numel, tied_numel) + prefetch_numel)) if stage == 3 else 0.0,
        "activations": float(activation_bytes),
    }
    out["backward"] = out["buckets"] + out["grad_in_flight"] + out["gathered"] + out["activations"]
    from engine.optim.chunked_adam import DEFAULT_CHUNK_NUMEL

    # the pooled buffers stay allocated through the step; torch's update is stepped in
    # chunks (engine.optim.chunked_adam): two chunk-sized temporaries; the fused kernel none
    master = num_params / (dp if stage >= 1 else 1)
    out["step"] = out["buckets"] + (2.0 * 4 * min(master, DEFAULT_CHUNK_NUMEL) if torch_adam else 0.0)
    moments = 8.0 * num_params / (dp if stage >= 1 else 1) if first_step else 0.0
    # stage 1 frees its full accumulator after the step's reduce-scatter, before the update
    full_acc = accum * num_params if (stage == 1 and accumulating) else 0.0
    out["peak"] = max(states - moments + out["backward"], states - full_acc + out["step"])
    return out


def optimizer_peak_inputs(optimizer: Any, module: torch.nn.Module) -> dict[str, int]:
    """The sizes :func:`zero_peak_formula` needs, read from a built ZeRO optimizer and the
    module it trains: ``num_params`` (this rank's model elements), ``bucket_numel``,
    ``largest_param_numel``, ``unit_numel``, ``prefetch_numel`` and ``tied_numel`` (the
    largest parameter registered in several modules here, e.g. a tied embedding and head)."""
    buckets = optimizer.buckets
    pooled = buckets if getattr(optimizer, "stage", 0) >= 1 else []
    units = getattr(optimizer, "_units", {})
    unit_sizes = [sum(b.layout.padded_numel for b in bs) for bs in units.values()]
    owners: dict[int, int] = {}
    sizes: dict[int, int] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
            sizes[id(p)] = max(sizes.get(id(p), 0), sum(b.layout.numels[i] for b in buckets
                                                         for i, q in enumerate(b.params) if q is p))
    return {
        "num_params": sum(b.layout.numel for b in buckets),
        "bucket_numel": max([b.layout.padded_numel for b in pooled] + [0]),
        "largest_param_numel": max([n for b in buckets for n in b.layout.numels] + [0]),
        "unit_numel": max(unit_sizes + [0]),
        "prefetch_numel": int(getattr(optimizer, "prefetch_bucket_size", 0)) if units else 0,
        "tied_numel": max([sizes[k] for k, n in owners.items() if n > 1] + [0]),
    }
