"""Sharded, atomic, layout-independent checkpoints (see docs/checkpoints.md).

- :func:`save_checkpoint` / :func:`load_checkpoint`: DeepSpeed's ``engine.save_checkpoint``
  / ``engine.load_checkpoint`` as functions of the engine; a checkpoint saved at any
  (dp, tp, pp, ZeRO stage) loads at any other.
- :func:`consolidate`: one fp32 state dict and a safetensors file of the model, streamed
  (``python -m engine.checkpoint.consolidate CKPT OUT``).

The boundary (:mod:`engine.checkpoint.target`): a checkpoint uses ZeRO's shard view and the
engine's training state (``state_dict`` / ``load_state_dict``) and nothing else of either;
the metadata is :class:`~engine.checkpoint.format.CheckpointMetadata`.
"""

from engine.checkpoint.export import consolidate
from engine.checkpoint.format import CheckpointError, CheckpointMetadata, load_metadata, read_latest, read_metadata
from engine.checkpoint.load import load_checkpoint
from engine.checkpoint.reader import iter_full_params
from engine.checkpoint.save import save_checkpoint
from engine.checkpoint.target import Checkpointable

__all__ = ["save_checkpoint", "load_checkpoint", "consolidate", "iter_full_params", "CheckpointError",
           "read_latest", "read_metadata", "load_metadata", "CheckpointMetadata", "Checkpointable"]
