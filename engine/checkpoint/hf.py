"""Hugging Face weights in and out of an engine (AutoTP or plain DP).

- :func:`load_hf_weights`: a full HF state dict (safetensors files or a CPU state dict)
  into a built engine, each rank reading only its TP slice of each weight (of an expert
  weight under expert parallelism, only its own experts' rows) and writing it
  straight into its fp32 master shard (the model's parameters are then published from the
  masters, as after a step). Build the model on the meta device so that no rank ever
  holds the whole model: ``with torch.device("meta"): model = AutoModelForCausalLM.from_config(cfg)``,
  ``engine.initialize(model=model, ...)``, then ``load_hf_weights(engine, path)``.
  Collective (the publish all-gathers over DP): every rank calls it.
- :func:`export_hf`: the engine's model as one HF-format ``model.safetensors`` (full,
  unsharded, HF names; a tied LM head is not repeated, HF re-ties it) plus the model's
  ``config.json``, which ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads.
  Collective over each TP group of DP rank 0 (the TP gathers); rank 0 writes.

At ZeRO-3, :func:`load_hf_weights` streams the source into the partitioned model: each
rank reads one tensor at a time (its TP slice) and copies only the elements of its own DP
shard into its fp32 master shard, so no rank ever holds more than its shards plus one
tensor (tests/distributed/test_zero_peak.py). :func:`export_hf` refuses ZeRO-3 (save with
``engine.save_checkpoint`` and consolidate, docs/autotp.md) and expert parallelism
(``engine.save_16bit_model`` gathers the experts into the HF layout: engine/weights16.py).
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import torch.distributed as dist

from engine.checkpoint.format import SafetensorsWriter
from engine.checkpoint.layout import LocalPiece, local_pieces, parameter_names
from engine.checkpoint.target import Checkpointable
from engine.distributed.groups import ParallelGroups
from engine.tensor_parallel.hf_load import LoadReport, SourceArg, full_shape_of, load_sharded_weights
from engine.tensor_parallel.layers import gather_full_tensor
from engine.topology import Role
from engine.zero.shard_view import ShardView

__all__ = ["load_hf_weights", "export_hf"]


def _refuse_zero3(engine: Checkpointable, what: str) -> None:
    if engine.config.zero.stage == 3:
        raise ValueError(f"{what} at ZeRO stage 3 is not supported (parameters are partitioned over DP): use "
                         f"ZeRO 0-2, or engine.save_checkpoint + engine.checkpoint.consolidate")


def _groups(engine: Checkpointable) -> ParallelGroups:
    if engine.groups is None:
        raise RuntimeError("the engine has no process groups (destroyed?): build it with engine.initialize")
    return engine.groups


@torch.no_grad()
def load_hf_weights(engine: Checkpointable, source: SourceArg, *, strict: bool = True) -> LoadReport:
    """See the module docstring. Returns what this rank read."""
    groups = _groups(engine)
    view = engine.optimizer.shard_view()
    names, _ = parameter_names(engine.module)
    pieces: dict[int, list[LocalPiece]] = {}
    for pc in local_pieces(view, names):
        pieces.setdefault(id(pc.param), []).append(pc)
    shape_of = _zero3_shapes(view) if engine.config.zero.stage == 3 else None
    masters = view.masters()  # live (shard,) fp32 views

    def sink(name: str, param: torch.nn.Parameter, local: torch.Tensor) -> None:
        flat = local.reshape(-1)
        for pc in pieces.get(id(param), []):
            masters[pc.group][pc.offset:pc.offset + pc.numel].copy_(flat[pc.start:pc.start + pc.numel])
        if not param.requires_grad:   # frozen parameters are not in the optimizer: set them here
            param.copy_(local)

    report = load_sharded_weights(engine.module, source, groups.tp_rank, groups.tp_size, strict=strict, sink=sink,
                                  shape_of=shape_of)
    view.load(masters)   # publishes the masters into the parameters (all-gather over DP); state kept
    return report


def _zero3_shapes(view: ShardView) -> Callable[[torch.nn.Parameter], tuple[int, ...]]:
    """TP-local shape of each optimized parameter from ZeRO's shard view (under ZeRO-3 a
    parameter's ``.data`` is an empty placeholder); a frozen one keeps its own."""
    shapes = {id(s.param): s.shape for g in view.groups for b in g.buckets for s in b.params}
    return lambda p: shapes.get(id(p), tuple(p.shape))


def export_hf(engine: Checkpointable, out_dir: str, *, dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """See the module docstring. ``dtype``: of the saved tensors (default: the
    parameters'). Returns the safetensors path on rank 0, None elsewhere."""
    _refuse_zero3(engine, "export_hf")
    groups = _groups(engine)
    if groups.ep_size > 1:
        raise ValueError(f"export_hf at expert_parallel.size = {groups.ep_size} is not supported (each rank holds "
                         "its own experts): use engine.save_16bit_model, which gathers the experts by global index "
                         "into the Hugging Face layout, or engine.save_checkpoint + engine.checkpoint.consolidate")
    model = engine.module
    if not groups.speaks_for(Role.GRAD):   # the other replicas of the weights have nothing to add
        dist.barrier()
        return None
    writer = None
    path = os.path.join(out_dir, "model.safetensors")
    params = list(model.named_parameters())
    if dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        specs = [(n, dtype or p.dtype, full_shape_of(p, groups.tp_size)) for n, p in params]
        writer = SafetensorsWriter(path + ".tmp", specs, metadata={"format": "pt"})
    try:
        for _, p in params:
            full = gather_full_tensor(p.data, p, groups.tp_group)   # collective over the TP group
            if writer is not None:
                writer.write(full.to(dtype or p.dtype))
        if writer is not None:
            writer.close()
            os.replace(path + ".tmp", path)
            config = getattr(model, "config", None)
            if config is not None and hasattr(config, "save_pretrained"):
                config.save_pretrained(out_dir)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    dist.barrier()
    return path if writer is not None else None
