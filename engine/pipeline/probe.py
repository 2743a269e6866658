"""The boundary shape of a model whose shapes are not in the config (DeepSpeed's
:class:`~engine.pipe.PipelineModule`: there is no ``model`` section), measured once, on the
first micro-batch, before the first step.

:func:`probe_boundary` walks the chain of virtual stages in order: each chunk receives
the shape and dtype of its input (a small int64 header, no activation), runs itself on
zeros of that shape (no grad, RNG state restored, so training is unaffected) and passes
its output's shape on. The boundary shapes are then all-gathered over the pipeline group
and must all be equal (the executor posts fixed-shape receives), which every rank checks
on the same data, so every rank raises the same error. The engine runs the probe through
:meth:`engine.pipeline.runner.PipelineRunner.prepare` before it enters the step, so reading the headers on the
host (once per job) is not a sync inside the executor's step.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from engine.distributed.groups import ParallelGroups
from engine.errors import ConfigError
from engine.pipeline.actions import next_hop, prev_hop

__all__ = ["probe_boundary"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
_MAX_DIMS = 6
_HEADER = 2 + _MAX_DIMS  # dtype code, ndim, dims


def _header(t: Any, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"a pipeline stage must output one tensor (DeepSpeed's tuples of tensors between stages are "
                        f"not supported here), got {type(t).__name__}")
    if t.dtype not in _DTYPES or t.dim() > _MAX_DIMS:
        raise TypeError(f"a stage output of dtype {t.dtype} with {t.dim()} dims cannot cross a stage boundary: "
                        f"use one of {[str(d) for d in _DTYPES]} and at most {_MAX_DIMS} dims")
    h = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    h[0], h[1] = _DTYPES.index(t.dtype), t.dim()
    h[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def _decode(h: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    v = h.tolist()
    return tuple(int(x) for x in v[2:2 + int(v[1])]), _DTYPES[int(v[0])]


@torch.no_grad()
def probe_boundary(chunks: Sequence[nn.Module], inputs: torch.Tensor, groups: ParallelGroups, num_stages: int,
                   device: torch.device, placement: str = "loop") -> tuple[tuple[int, ...], torch.dtype]:
    """The one (shape, dtype) every stage boundary carries, measured on ``inputs`` (the first
    micro-batch's inputs; used by the first virtual stage only). ``placement``: the
    schedule's (a hop between two chunks of one rank, V placement's turn, is handed over here)."""
    stage, v = groups.pp_rank, len(chunks)
    ranks = list(groups.pp_ranks)
    mine = torch.full((v, _HEADER), -1, dtype=torch.int64, device=device)  # output header of each local chunk
    local: Any = None  # the output handed to this rank's next chunk (V placement's turn)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for c in range(v):
            prev = prev_hop(stage, c, num_stages, placement)
            if prev is None:
                x = inputs.to(device, copy=True)  # a first layer working in place must not change the batch
            elif prev[0] == stage:
                x = torch.zeros_like(local)
            else:
                h = torch.empty(_HEADER, dtype=torch.int64, device=device)
                dist.recv(h, ranks[prev[0]], group=groups.pp_group.process_group)
                shape, dtype = _decode(h)
                x = torch.zeros(shape, dtype=dtype, device=device)
            out = chunks[c](x)
            nxt = next_hop(stage, c, num_stages, v, placement)
            if nxt is not None:
                mine[c] = _header(out, device)
                if nxt[0] == stage:
                    local = out
                else:
                    dist.send(mine[c], ranks[nxt[0]], group=groups.pp_group.process_group)
    everyone = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(everyone, mine, group=groups.pp_group.process_group)
    found = {_decode(h) for t in everyone for h in t if int(h[0]) >= 0}
    if len(found) != 1:
        raise ConfigError(f"the PipelineModule's stage boundaries carry different shapes {sorted(map(str, found))}: "
                          "the engine's schedules send one fixed shape between every pair of stages; choose "
                          "partition_method / num_stages so that every cut falls where the activations have the "
                          "same shape (e.g. between transformer blocks)")
    return found.pop()
