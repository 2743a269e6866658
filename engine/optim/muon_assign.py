"""Which parameters Muon updates and which AdamW does: one documented rule, overridable.

The rule (Moonlight / Kimi, and DeepSpeed's keyword test), for a trainable parameter
named ``name`` (the single-process reference model's name, e.g. ``layers.3.attn.qkv.weight``):

1. ``adam_params`` patterns (``fnmatch`` globs on the name) -> AdamW; ``muon_params``
   patterns -> Muon (then it must be a 2-D matrix that is not tied or vocabulary-padded).
   A name matching both lists is an error.
2. Otherwise Muon iff the parameter is 2-D AND is not an embedding or LM head, i.e. not
   the weight of an ``nn.Embedding`` / ``VocabParallelEmbedding`` / ``FinalNormAndHead``,
   not a tied weight (reachable under two names, or a pipeline copy), not a padded
   vocabulary partition, and its name contains neither ``embed`` nor ``lm_head``.
   Everything else (norms, biases, embeddings, LM head) -> AdamW.
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

from engine.pipeline.names import parameter_names  # names as the reference model has them
from engine.placement import placement_of
from engine.zero.init import param_shape

__all__ = ["uses_muon", "split_muon_groups", "EMBEDDING_MODULES"]

logger = logging.getLogger(__name__)

EMBEDDING_MODULES = ("Embedding", "VocabParallelEmbedding", "FinalNormAndHead")
_KEYWORDS = ("embed", "lm_head")


def uses_muon(name: str, param: torch.Tensor, owner: Optional[nn.Module], tied: bool,
              muon_patterns: Sequence[str] = (), adam_patterns: Sequence[str] = ()) -> bool:
    """The rule of the module docstring for one parameter."""
    to_adam = [p for p in adam_patterns if fnmatch.fnmatchcase(name, p)]
    to_muon = [p for p in muon_patterns if fnmatch.fnmatchcase(name, p)]
    if to_adam and to_muon:
        raise ValueError(f"parameter {name} matches both optimizer.params.muon_params {to_muon} and adam_params "
                         f"{to_adam}: make the patterns exclusive")
    if to_adam:
        return False
    placement = placement_of(param)
    padded = placement.tp is not None and placement.tp.unpadded_size is not None  # a vocabulary table
    embedding_like = (tied or placement.tied_copy or padded
                      or (owner is not None and type(owner).__name__ in EMBEDDING_MODULES)
                      or any(k in name.lower() for k in _KEYWORDS))
    # the parameter's own shape: under ZeRO-3 the model is built by engine.zero.Init, whose
    # parameters are 1-D shards until the optimizer takes them (ds_shape is the real one)
    shape = tuple(param_shape(param))
    if to_muon:
        if len(shape) != 2 or embedding_like:
            why = "is not a 2-D matrix" if len(shape) != 2 else "is an embedding, LM head or tied weight"
            raise ValueError(f"parameter {name} of shape {shape} matches optimizer.params.muon_params "
                             f"{to_muon} but {why}: Muon cannot update it; narrow the pattern")
        return True
    return len(shape) == 2 and not embedding_like


def _owners(module: nn.Module) -> dict[int, nn.Module]:
    out: dict[int, nn.Module] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            out.setdefault(id(p), m)
    return out


def split_muon_groups(params: Any, module: Optional[nn.Module], muon_patterns: Sequence[str] = (),
                      adam_patterns: Sequence[str] = ()) -> list[dict[str, Any]]:
    """``[{"params": muon, "use_muon": True}, {"params": others, "use_muon": False}]`` per
    incoming group (a module, a parameter list, or torch-style group dicts whose other keys
    are kept on both halves). Both halves are always returned, empty or not, so the user
    param-group indices are the same on every pipeline stage and layout (checkpoints key
    their state by them)."""
    if isinstance(params, nn.Module):
        module = params if module is None else module
        params = [p for p in params.parameters()]
    items = list(params)
    groups = [dict(g) for g in items] if items and all(isinstance(g, dict) for g in items) else [{"params": items}]
    names: dict[int, str] = {}
    tied: set[int] = set()
    owners: dict[int, nn.Module] = {}
    if module is not None:
        names, aliases = parameter_names(module)
        by_name = {v: k for k, v in names.items()}
        tied = {by_name[v] for v in aliases.values() if v in by_name}
        owners = _owners(module)
    out: list[dict[str, Any]] = []
    counts = [0, 0]
    for g in groups:
        ps = g.pop("params")
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        halves: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for i, p in enumerate(ps):
            if not p.requires_grad:
                continue
            name = names.get(id(p), f"param{i}")
            use = uses_muon(name, p, owners.get(id(p)), id(p) in tied, muon_patterns, adam_patterns)
            halves[0 if use else 1].append(p)
        counts[0] += len(halves[0])
        counts[1] += len(halves[1])
        out.append({**g, "params": halves[0], "use_muon": True})
        out.append({**g, "params": halves[1], "use_muon": False})
    logger.info("Muon: %d matrices with Muon, %d parameters with AdamW", counts[0], counts[1])
    return out
