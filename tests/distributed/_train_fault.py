"""launch/train.py with one injected fault, for tests/distributed/test_train_failures.py.

    python _train_fault.py RANK STEP KIND -- <launch/train.py arguments>

On global rank RANK, when optimizer step STEP has been taken: KIND ``raise`` raises
ValueError("injected fault at step STEP") from the training loop (an ordinary bug);
``hang`` sleeps (a rank that stops answering). The other ranks run unchanged.
"""

import importlib.util
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(os.path.dirname(os.path.dirname(HERE)), "launch", "train.py")


def main() -> int:
    rank, step, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    argv = sys.argv[sys.argv.index("--") + 1:]
    spec = importlib.util.spec_from_file_location("train_entry", TRAIN)
    train_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_mod)
    import engine.training.trainer as trainer

    real = trainer.step_record

    def step_record(engine, *a, **kw):
        rec = real(engine, *a, **kw)
        if engine.global_rank == rank and rec["step"] == step:
            if kind == "raise":
                raise ValueError(f"injected fault at step {step}")
            time.sleep(3600)
        return rec

    trainer.step_record = step_record
    return train_mod.main(argv)


if __name__ == "__main__":
    sys.exit(main())
