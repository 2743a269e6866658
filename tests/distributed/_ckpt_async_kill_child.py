"""Child process of test_checkpoint_async.py: trains the tiny GPT in one process with
``checkpoint.async_save``, publishes ``global_step2`` (waited for), trains one more step,
then starts the asynchronous save of ``global_step3`` with a writer slowed down (a short
sleep per 1024 elements, about a second in all) and keeps training, polling for the commit
at every step boundary as the entry point does, until the test kills it with SIGKILL.

Files next to SAVE_DIR: ``.ref2.pt`` / ``.ref3.pt`` (the dense weights at steps 2 and 3),
``.ready`` (waiting for the test's ``.go``), ``.started`` (the save of step 3 has returned: its write runs), ``.committed`` (it is
published).

    python _ckpt_async_kill_child.py SAVE_DIR
"""

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)


def _touch(path):
    with open(path, "w") as f:
        f.write(str(os.getpid()))


def main(save_dir):
    import _ckpt_common as C
    import torch
    import torch.distributed as dist

    import engine.checkpoint.format as fmt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{save_dir}.store", rank=0, world_size=1)
    eng = C.build(C.config(layers=2, checkpoint={"async_save": True}))
    C.train(eng, 2)
    eng.save_checkpoint(save_dir)
    eng.wait_for_checkpoint()
    torch.save(C.dense_state(eng), save_dir + ".ref2.pt")
    C.train(eng, 1)
    torch.save(C.dense_state(eng), save_dir + ".ref3.pt")
    real_write, real_emit = fmt.SafetensorsWriter.write, fmt.SafetensorsWriter._emit

    def write(self, tensor, chunk_numel=1 << 24):
        real_write(self, tensor, 1024)

    def emit(self, b):
        real_emit(self, b)
        time.sleep(0.01)
    fmt.SafetensorsWriter.write, fmt.SafetensorsWriter._emit = write, emit
    _touch(save_dir + ".ready")
    while not os.path.exists(save_dir + ".go"):  # the test starts the clock of each child itself
        time.sleep(0.005)
    eng.save_checkpoint(save_dir)
    _touch(save_dir + ".started")
    saver = eng.checkpoint_saver()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        C.train(eng, 1)  # the parameters change while the write runs
        if saver.pending and saver.poll() is not None:
            _touch(save_dir + ".committed")
    raise SystemExit("not killed")


if __name__ == "__main__":
    main(*sys.argv[1:])
