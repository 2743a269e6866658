"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` over this engine's checkpoints (any ZeRO
stage, DP / TP / PP layout): the full fp32 master weights, by DeepSpeed's function names.

- :func:`get_fp32_state_dict_from_zero_checkpoint` ``(checkpoint_dir, tag=None)`` -> ``{name: fp32 tensor}``
  (bf16 for bf16 master weights, as DeepSpeed's);
- :func:`convert_zero_checkpoint_to_fp32_state_dict` ``(checkpoint_dir, output_dir,
  safe_serialization=False, tag=None)``: writes ``pytorch_model.bin`` (or
  ``model.safetensors``) into ``output_dir``, streamed one parameter at a time
  (:func:`engine.checkpoint.consolidate`);
- :func:`load_state_dict_from_zero_checkpoint` ``(model, checkpoint_dir, tag=None)``.

``checkpoint_dir`` is the save directory (``tag`` or its ``latest`` file picks the
checkpoint) or a checkpoint itself. Names are the trained module's (``fc1.weight``), or
``layers.{i}.<name>`` for a layer list / PipelineModule. Frozen parameters
(``requires_grad=False``) are included, as DeepSpeed's: in their saved dtype from
:func:`get_fp32_state_dict_from_zero_checkpoint` (as DeepSpeed gives them), in fp32 in the
files :func:`convert_zero_checkpoint_to_fp32_state_dict` writes; ``exclude_frozen_parameters``
leaves them out. Not under tensor parallelism, where checkpoints do not hold them (a warning
at save names them); nor in checkpoints saved before 2026-11.

From the command line, as DeepSpeed's script (and the ``zero_to_fp32.py`` that
``engine.save_checkpoint`` writes next to its checkpoints, as DeepSpeed's does)::

    python -m engine.compat.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization]
                                         [--max_shard_size 5GB] [--exclude_frozen_parameters]
"""

from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

import torch
import torch.nn as nn

from engine.checkpoint.export import TORCH_FILE, consolidate, resolve_checkpoint
from engine.checkpoint.format import read_metadata
from engine.checkpoint.reader import iter_frozen_params, iter_full_params
from engine.checkpoint.recovery_script import RECOVERY_SCRIPT, write_recovery_script  # re-exported

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "load_state_dict_from_zero_checkpoint", "main", "write_recovery_script", "RECOVERY_SCRIPT"]


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter once, whole, in its master dtype (fp32; bf16 from a checkpoint with
    ``bf16.bf16_master_weights_and_grads``, as DeepSpeed 0.19.8 gives them: checked by running
    it; :func:`convert_zero_checkpoint_to_fp32_state_dict` writes fp32 either way); a tied
    alias (a pipeline copy of a tied weight) shares its source's tensor, as in the model's own
    ``state_dict``."""
    if lazy_mode:
        raise ValueError("lazy_mode is not supported: the state dict is built whole (engine.checkpoint.consolidate "
                         "streams to a file without holding it)")
    path = resolve_checkpoint(checkpoint_dir, tag)
    out = {name: _master_dtype(full["master"]) for name, _, full in iter_full_params(path, ("master",))}
    if not exclude_frozen_parameters:
        out.update(iter_frozen_params(path))
    for alias, source in read_metadata(path).get("aliases", {}).items():
        if source in out:
            out[alias] = out[source]
    return out


def _master_dtype(t: torch.Tensor) -> torch.Tensor:
    """fp32, or bf16 as saved (bf16 masters); anything else (an old checkpoint's) to fp32."""
    return t if t.dtype == torch.bfloat16 else t.to(torch.float32)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str, max_shard_size: str = "5GB",
                                               safe_serialization: bool = False, tag: Optional[str] = None,
                                               exclude_frozen_parameters: bool = False) -> str:
    """Write the fp32 model as DeepSpeed names it: ``pytorch_model.bin`` (``torch.load``-able
    state dict) or, with ``safe_serialization``, ``model.safetensors``; one file
    (``max_shard_size`` is not used). Returns its path."""
    paths = consolidate(checkpoint_dir, output_dir, tag=tag, write_torch=not safe_serialization,
                        write_safetensors=safe_serialization, frozen=not exclude_frozen_parameters)
    if safe_serialization:
        return paths["safetensors"]
    final = os.path.join(output_dir, "pytorch_model.bin")
    os.replace(os.path.join(output_dir, TORCH_FILE), final)
    return final


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str, tag: Optional[str] = None) -> nn.Module:
    """Load the fp32 weights into ``model`` (moved to the CPU, as DeepSpeed) and return it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def main(argv: Optional[Sequence[str]] = None) -> None:
    """DeepSpeed's ``zero_to_fp32.py`` command line: ``CHECKPOINT_DIR OUTPUT_DIR`` and its options."""
    p = argparse.ArgumentParser(prog="zero_to_fp32", description="write the fp32 weights of a checkpoint of this "
                                "engine (DeepSpeed's zero_to_fp32 command line)")
    p.add_argument("checkpoint_dir", help="the save directory (its `latest` picks the tag) or a checkpoint")
    p.add_argument("output_dir", help="where pytorch_model.bin (or model.safetensors) is written")
    p.add_argument("--max_shard_size", default="5GB", help="accepted for DeepSpeed's command line; one file is written")
    p.add_argument("--safe_serialization", action="store_true", help="write model.safetensors")
    p.add_argument("-t", "--tag", default=None, help="the checkpoint tag (default: the `latest` file)")
    p.add_argument("--exclude_frozen_parameters", action="store_true", help="leave out frozen parameters")
    p.add_argument("-d", "--debug", action="store_true", help="accepted for DeepSpeed's command line")
    args = p.parse_args(argv)
    path = convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir,
                                                      max_shard_size=args.max_shard_size,
                                                      safe_serialization=args.safe_serialization, tag=args.tag,
                                                      exclude_frozen_parameters=args.exclude_frozen_parameters)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
