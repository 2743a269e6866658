"""Child process of test_checkpoint_safety.py: trains the tiny GPT in one process, publishes
``global_step2``, trains one more step, then starts saving ``global_step3`` and blocks at
``phase`` (touching ``marker``) until the test kills it with SIGKILL.

Phases: ``shard`` (half-way through writing the shard file), ``metadata`` (metadata written,
directory not yet renamed), ``latest`` (directory renamed, new ``latest`` written to its
temporary file but not yet renamed over the old one).

    python _ckpt_kill_child.py SAVE_DIR PHASE MARKER
"""

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)


def _block(marker):
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
    raise SystemExit("not killed")


def main(save_dir, phase, marker):
    import _ckpt_common as C
    import torch
    import torch.distributed as dist

    import engine.checkpoint.format as fmt
    import engine.checkpoint.save as save_mod

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{save_dir}.store", rank=0, world_size=1)
    eng = C.build(C.config(layers=2))
    C.train(eng, 2)
    save_mod.save_checkpoint(eng, save_dir)
    torch.save(C.dense_state(eng), marker + ".ref.pt")
    C.train(eng, 1)
    if phase == "shard":
        real_write = fmt.SafetensorsWriter.write

        def write(self, tensor, chunk_numel=1 << 24):
            real_write(self, tensor, chunk_numel)
            self._f.flush()
            _block(marker)
        fmt.SafetensorsWriter.write = write
    elif phase == "metadata":
        real_meta = save_mod.write_metadata

        def write_metadata(directory, meta):
            real_meta(directory, meta)
            _block(marker)
        save_mod.write_metadata = write_metadata
    elif phase == "latest":
        real_replace = os.replace

        def replace(src, dst):
            if os.path.basename(str(dst)) == fmt.LATEST_FILE:
                _block(marker)
            real_replace(src, dst)
        fmt.os.replace = replace
    else:
        raise SystemExit(f"unknown phase {phase}")
    save_mod.save_checkpoint(eng, save_dir)
    raise SystemExit("the save finished: the phase hook did not block")


if __name__ == "__main__":
    main(*sys.argv[1:])
