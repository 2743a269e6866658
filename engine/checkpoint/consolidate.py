"""``python -m engine.checkpoint.consolidate CKPT OUT [--tag TAG]``: write the fp32 model of a
sharded checkpoint as ``OUT/model.safetensors`` and ``OUT/pytorch_model_fp32.pt``.

``CKPT`` is a checkpoint directory (holding ``metadata.json``) or a save directory (the
tag ``latest`` names, or ``--tag``). Streams parameter by parameter; no process group,
no GPU. Exits 2 with one ``checkpoint error: ...`` line on a bad checkpoint.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from engine.checkpoint.export import consolidate
from engine.checkpoint.format import CheckpointError

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m engine.checkpoint.consolidate",
                                description="Consolidate a sharded checkpoint into one fp32 model.")
    p.add_argument("checkpoint", help="checkpoint directory, or a save directory with a 'latest' file")
    p.add_argument("out", help="output directory")
    p.add_argument("--tag", default=None, help="tag inside a save directory (default: the one 'latest' names)")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the shard files")
    p.add_argument("--no-torch", action="store_true", help="write only the safetensors file")
    args = p.parse_args(argv)
    try:
        paths = consolidate(args.checkpoint, args.out, tag=args.tag, verify=not args.no_verify,
                            write_torch=not args.no_torch)
    except (CheckpointError, OSError) as exc:
        sys.stderr.write(f"checkpoint error: {' '.join(str(exc).split())}\n")
        return 2
    for kind, path in paths.items():
        sys.stdout.write(f"{kind}: {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
