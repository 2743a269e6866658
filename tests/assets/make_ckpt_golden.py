"""Write a checkpoint with the engine version that runs this script, for
tests/distributed/test_checkpoint_compat.py: the tiny reference GPT (2 layers, hidden 16) at
dp 2, ZeRO-1, fp32, trained 2 steps on the checkpoint tests' synthetic data and saved as
``OUT/ckpt`` (tag ``global_step2``), then trained on uninterrupted to step 4; rank 0 writes
the losses of steps 3 and 4 to ``OUT/golden.json``.

    torchrun --standalone --nproc_per_node 2 tests/assets/make_ckpt_golden.py OUT

tests/assets/ckpt_golden/ was written this way by the engine at commit 8869245 (before the
"Roles, not axes" changes), so the test proves checkpoints written before load after.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "distributed"))

import torch.distributed as dist  # noqa: E402
from _ckpt_common import build, config, train  # noqa: E402

from engine.checkpoint import save_checkpoint  # noqa: E402

MODEL = {"vocab_size": 128, "hidden_size": 16, "num_layers": 2, "num_heads": 2, "seq_len": 16}


def golden_config() -> dict:
    return config(dp=2, zero=1, layers=2, model=MODEL)


def main(out: str) -> None:
    eng = build(golden_config())
    train(eng, 2)
    save_checkpoint(eng, os.path.join(out, "ckpt"), tag="global_step2")
    losses = train(eng, 2)
    if dist.get_rank() == 0:
        with open(os.path.join(out, "golden.json"), "w") as f:
            json.dump({"steps": [3, 4], "losses": losses}, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
