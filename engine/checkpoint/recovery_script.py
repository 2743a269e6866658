"""``zero_to_fp32.py`` next to the checkpoints, as DeepSpeed's ``save_checkpoint`` writes its
own: a few lines that run :func:`engine.compat.zero_to_fp32.main` (DeepSpeed's command line),
so the documented ``python SAVE_DIR/zero_to_fp32.py SAVE_DIR OUTPUT_DIR`` works in a save
directory of this engine. Here, in the checkpoint layer, because the engine writes it; the
command line it runs lives with the other DeepSpeed names (engine.compat)."""

from __future__ import annotations

import os

__all__ = ["RECOVERY_SCRIPT", "write_recovery_script"]

RECOVERY_SCRIPT = "zero_to_fp32.py"
_RECOVERY_TEXT = """#!/usr/bin/env python
# Written by the engine's save_checkpoint, as DeepSpeed writes its zero_to_fp32.py next to its
# checkpoints: the full fp32 weights of a checkpoint in this directory.
#   python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization]
import sys

from engine.compat.zero_to_fp32 import main

if __name__ == "__main__":
    main(sys.argv[1:])
"""


def write_recovery_script(save_dir: str) -> str:
    """Write ``zero_to_fp32.py`` (executable) into ``save_dir``, as DeepSpeed's
    ``save_checkpoint`` does on rank 0; returns its path. Written to a temporary name and
    renamed, so a reader never sees half a script."""
    path = os.path.join(save_dir, RECOVERY_SCRIPT)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(_RECOVERY_TEXT)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
    return path
