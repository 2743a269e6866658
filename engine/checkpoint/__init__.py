"""Sharded, atomic, layout-independent checkpoints (see docs/checkpoints.md).

- :func:`save_checkpoint` / :func:`load_checkpoint`: DeepSpeed's ``engine.save_checkpoint``
  / ``engine.load_checkpoint`` as functions of the engine; a checkpoint saved at any
  (dp, tp, pp, ZeRO stage) loads at any other.
- :func:`consolidate`: one fp32 state dict and a safetensors file of the model, streamed
  (``python -m engine.checkpoint.consolidate CKPT OUT``).
"""

from engine.checkpoint.export import consolidate
from engine.checkpoint.format import CheckpointError, read_latest, read_metadata
from engine.checkpoint.load import load_checkpoint
from engine.checkpoint.reader import iter_full_params
from engine.checkpoint.save import save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "consolidate", "iter_full_params", "CheckpointError",
           "read_latest", "read_metadata"]
