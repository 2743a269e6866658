"""Where data enters under context parallelism: a micro-batch cut to this rank's head-tail
shard of the sequence (:mod:`engine.context_parallel.sharding`).

Every CP rank of a data-parallel replica reads the same rows (the batch role is ``dp``
alone); each keeps only its ``S/C`` positions ``chunk i ++ chunk 2C-1-i`` of:

- the input tokens and their targets (B, S) -> (B, S/C) (the targets are the next tokens of
  the whole row, so nothing is shifted across a shard boundary);
- ``positions`` (B, S/C): the global position of each kept token (the causal mask compares
  these; without document masking rotary uses them too);
- with document masking, the document ids (B, S/C) and ``position_ids`` (B, S/C): the
  per-document positions computed on the WHOLE row first (a document may start on another
  rank), then cut like the rest.

The loss's denominator is the count of kept targets summed over the loss role (cp x dp):
:class:`engine.zero.step.TokenMean` needs nothing else. Nothing here communicates.
"""

from __future__ import annotations

import torch

from engine.context_parallel.layout import CPLayout
from engine.context_parallel.sharding import head_tail_indices
from engine.data.microbatch import MicroBatch
from engine.data.packing import position_ids_from_doc_ids

__all__ = ["shard_microbatch", "SEQUENCE_KWARGS"]

# The keyword inputs a sharded micro-batch carries to the model (besides ids and targets).
SEQUENCE_KWARGS = ("doc_ids", "positions", "position_ids")


def shard_microbatch(mb: MicroBatch, layout: CPLayout) -> MicroBatch:
    """``mb`` (ids and targets (B, S), optional ``doc_ids`` (B, S)) cut to this rank's shard
    (module docstring)."""
    extra = sorted(set(mb.kwargs) - {"doc_ids", "input_ids", "labels"})  # inputs/targets come from mb.split()
    if extra:
        raise ValueError(f"context parallelism shards token ids, targets and doc_ids only; this micro-batch also "
                         f"has {extra}: feed engine.data batches, (inputs, targets) pairs or dicts of input_ids, "
                         "labels and doc_ids")
    inputs, targets = mb.split()
    if not (isinstance(inputs, torch.Tensor) and isinstance(targets, torch.Tensor)) or inputs.dim() != 2 \
            or targets.shape != inputs.shape:
        raise ValueError("context parallelism needs token ids and targets of one shape (B, S); got "
                         f"{getattr(inputs, 'shape', type(inputs))} and {getattr(targets, 'shape', type(targets))}")
    b, s = inputs.shape
    try:
        idx = head_tail_indices(s, layout.size, layout.rank, device=inputs.device)      # (S/C,)
    except ValueError as exc:
        raise ValueError(f"{exc} (this micro-batch's sequence length; model.seq_len must match the data)") from None
    kwargs = {"positions": idx.expand(b, -1).contiguous()}                              # (B, S/C) int64
    doc_ids = mb.doc_ids
    if doc_ids is not None:
        if doc_ids.shape != inputs.shape:
            raise ValueError(f"doc_ids {tuple(doc_ids.shape)} must have the token ids' shape {tuple(inputs.shape)}")
        kwargs["doc_ids"] = doc_ids.index_select(1, idx)
        kwargs["position_ids"] = position_ids_from_doc_ids(doc_ids).index_select(1, idx)
    return MicroBatch((inputs.index_select(1, idx), targets.index_select(1, idx)), kwargs)
