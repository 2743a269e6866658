"""Global parameter names of a model, as the single-process reference model has them.

With stage chunks (the reference GPT or a layer list) a parameter of layer ``j`` of a chunk
starting at layer ``s`` is ``layers.{s + j}.{name}`` (``engine.models.GPT`` indexing, whatever
stage holds it); otherwise the module's own ``named_parameters`` names. Used by the
checkpoint layout (:mod:`engine.checkpoint.layout`) and by Muon's parameter assignment,
which key state by these names.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from engine.pipeline.stages import ReferenceModel, StageChunk

__all__ = ["stage_chunks", "parameter_names"]


def stage_chunks(module: nn.Module) -> Optional[list[StageChunk]]:
    """The StageChunks behind an engine's module (pipeline list, ReferenceModel or one
    chunk), or None for a plain module."""
    if isinstance(module, StageChunk):
        return [module]
    if isinstance(module, ReferenceModel):
        return [module.chunk]
    if isinstance(module, nn.ModuleList) and len(module) and all(isinstance(m, StageChunk) for m in module):
        return [m for m in module if isinstance(m, StageChunk)]  # all of them (checked above)
    return None


def parameter_names(module: nn.Module) -> tuple[dict[int, str], dict[str, str]]:
    """``({id(param): name}, {alias: name})`` for every parameter of ``module``."""
    names: dict[int, str] = {}
    aliases: dict[str, str] = {}

    def add(full: str, p: torch.Tensor) -> None:
        if id(p) in names:
            aliases[full] = names[id(p)]
        else:
            names[id(p)] = full

    chunks = stage_chunks(module)
    if chunks is None:
        for n, p in module.named_parameters(remove_duplicate=False):
            add(n, p)
    else:
        for ch in chunks:
            for j, layer in enumerate(ch.layers):
                for n, p in layer.named_parameters(remove_duplicate=False):
                    add(f"layers.{ch.start + j}.{n}", p)
    return names, aliases
