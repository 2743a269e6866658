"""Memory accounting for the ZeRO stages: what a rank holds, and what the ZeRO paper says
it should hold.

The paper (Rajbhandari et al., 2020, sec. 5) counts, for ``Psi`` parameters trained with
mixed-precision Adam on ``N_d`` data-parallel ranks: 2 Psi bytes of fp16 parameters, 2 Psi
of fp16 gradients and K Psi (K = 12: fp32 master weights, momentum, variance) of optimizer
state, and divides by ``N_d``:

    stage 0: (2 + 2 + K) Psi        stage 2: 2 Psi + (2 + K) Psi / N_d
    stage 1: 2 Psi + 2 Psi + K Psi / N_d        stage 3: (2 + 2 + K) Psi / N_d

Our optimizers accumulate and reduce gradients in fp32, so the gradient term uses 4 bytes
per element by default (``grad_bytes``); stage 1 additionally holds its fp32 master-gradient
shard (``4 Psi / N_d``) next to the full accumulator.

The paper's terms are what a rank holds BETWEEN steps. :func:`zero_peak_formula` adds what
exists only DURING a step, which decides whether a run fits:

- ``buckets`` (stages 2/3, and 1 without accumulation): two bucket-sized fp32 accumulators (one filling, one being
  reduce-scattered; the pooled buffers of :mod:`engine.zero.base`);
- ``grad_in_flight``: the compute-dtype gradient autograd produces for a parameter before
  the hook moves it into the accumulator, the largest one; a tied weight (used twice)
  holds both contributions and their sum until its last use in backward: three copies;
- ``gathered`` (stage 3): the unit in use, the prefetch window in flight, and a tied
  weight, which stays gathered from its last use in forward to its first in backward
  when both ends are on one rank;
- ``activations``: one micro-batch's activations (given by the caller; measured or
  estimated), since every stage keeps them alike.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.metrics import peak_memory_bytes

__all__ = ["zero_memory_formula", "zero_peak_formula", "optimizer_peak_inputs", "memory_report"]


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


def zero_peak_formula(num_params: int, stage: int, dp: int, *, param_bytes: int = 2,
                      bucket_numel: int = 0, largest_param_numel: int = 0, unit_numel: int = 0,
                      prefetch_numel: int = 0, tied_numel: int = 0, activation_bytes: float = 0.0,
                      accumulating: bool = True, torch_adam: bool = False, grad_bytes: int = 4,
                      optimizer_bytes: int = 12) -> dict[str, float]:
    """Per-rank peak bytes during a step, by term (see the module docstring) and ``peak``.

    ``bucket_numel``: the largest bucket (padded elements); ``largest_param_numel``: the
    largest parameter; ``unit_numel`` / ``prefetch_numel``: stage 3's largest gathered unit
    and its prefetch window (``stage3_prefetch_bucket_size``); ``tied_numel``: a tied
    weight held whole on this rank (0 if none); ``accumulating``: gradients accumulate over
    several micro-batches (GA > 1 or a pipeline), the case in which stage 1 holds full
    gradients (otherwise it reduces through two buckets as stage 2). ``states`` is the
    paper's formula with our fp32 gradients (and stage 1's master-gradient shard; at stage 0
    fp32 parameters ARE the master). The backward terms and the optimizer step's temporary
    (``torch_adam``: torch's AdamW allocates one master-sized sqrt temporary; the fused kernel
    none) do not coexist: ``peak = states + max(backward, step)``."""
    f = zero_memory_formula(num_params, stage, dp, param_bytes=param_bytes, grad_bytes=grad_bytes,
                            optimizer_bytes=optimizer_bytes)
    states = sum(f.values()) + (4.0 * num_params / dp if stage == 1 else 0.0)
    pooled = stage >= 2 or (stage == 1 and not accumulating)
    if stage == 1 and not accumulating:
        states -= f["grads"]  # no full gradient: only the master-gradient shard
    if stage == 0 and param_bytes == 4:
        states -= 4.0 * num_params  # fp32 parameters are the master weights
    out = {
        "states": states,
        "buckets": 2.0 * 4 * bucket_numel if pooled else 0.0,
        "grad_in_flight": float(param_bytes * max(largest_param_numel, 3 * tied_numel)),
        "gathered": float(param_bytes * (unit_numel + prefetch_numel + tied_numel)) if stage == 3 else 0.0,
        "activations": float(activation_bytes),
    }
    out["backward"] = out["buckets"] + out["grad_in_flight"] + out["gathered"] + out["activations"]
    out["step"] = 4.0 * num_params / (dp if stage >= 1 else 1) if torch_adam else 0.0
    out["peak"] = states + max(out["backward"], out["step"])
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


def memory_report(optimizer: Any, device: torch.device) -> dict[str, int]:
    """``optimizer.memory_bytes()`` (params, grads, optimizer_state counted from the
    optimizer's own tensors) plus ``peak``: max RSS of this process on CPU, max allocated
    on CUDA."""
    out = dict(optimizer.memory_bytes())
    out["peak"] = peak_memory_bytes(device)
    return out
