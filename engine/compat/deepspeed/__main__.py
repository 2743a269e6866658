"""Run an unmodified DeepSpeed script on the engine: ``python -m engine.compat.deepspeed
SCRIPT [ARGS...]`` (or ``-m MODULE [ARGS...]``) installs :func:`engine.compat.deepspeed.alias`
(``import deepspeed`` gives this engine) and then runs the script as ``python SCRIPT ARGS``
would: ``__name__ == "__main__"``, ``sys.argv = [SCRIPT, ARGS...]``, the script's folder first
on ``sys.path``. Under a launcher every rank does this before the script starts:

    torchrun --nproc_per_node 2 -m engine.compat.deepspeed train.py ARGS
    deepspeed --num_gpus 2 --module engine.compat.deepspeed train.py ARGS

The deepspeed launcher puts ``--local_rank=N`` right after the module; it is moved behind
the script's name, where the script's own argument parser sees it as it would without the
alias.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Sequence

USAGE = "usage: python -m engine.compat.deepspeed [--local_rank=N] (SCRIPT | -m MODULE) [ARGS...]"
_LOCAL_RANK_FLAGS = ("--local_rank", "--local-rank")


def split_launcher_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(launcher_args, rest)``: the leading ``--local_rank=N`` / ``--local_rank N`` options
    the deepspeed launcher inserts, and the script (or ``-m MODULE``) with its arguments."""
    argv = list(argv)
    taken: list[str] = []
    while argv and argv[0].split("=", 1)[0] in _LOCAL_RANK_FLAGS:
        flag = argv.pop(0)
        taken.append(flag)
        if "=" not in flag and argv:
            taken.append(argv.pop(0))
    return taken, argv


def main(argv: Sequence[str]) -> None:
    launcher_args, rest = split_launcher_args(argv)
    if rest[:1] in (["-h"], ["--help"]):
        sys.stdout.write(USAGE + "\n\n" + (__doc__ or ""))
        return
    if not rest or (rest[0] == "-m" and len(rest) < 2):
        raise SystemExit(USAGE)
    if rest[0] != "-m" and not os.path.isfile(rest[0]):
        raise SystemExit(f"engine.compat.deepspeed: no such script {rest[0]!r}\n{USAGE}")
    from engine.compat.deepspeed import alias

    alias()
    try:
        _run(launcher_args, rest)
    except SystemExit as exc:  # sys.exit(main()) at the end of a script: 0 / None is success
        if exc.code in (None, 0):
            end_of_script_teardown()
        raise
    end_of_script_teardown()


def _run(launcher_args: list[str], rest: list[str]) -> None:
    """Run the script (or ``-m`` module) as ``python SCRIPT ARGS`` would."""
    if rest[0] == "-m":
        module = rest[1]
        sys.argv = [module, *launcher_args, *rest[2:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script = rest[0]
    sys.argv = [script, *launcher_args, *rest[1:]]
    # first on the path, as `python SCRIPT` puts it; the launcher's entry (the cwd, where
    # `engine` may have been found) stays behind it
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def end_of_script_teardown() -> None:
    """Drain and destroy the process groups a script that succeeded left behind.

    DeepSpeed scripts (and HF's Trainer) end without destroying their groups; gloo's worker
    threads then die during interpreter finalisation, where one that releases its last work
    item aborts the process ("terminate called without an active exception", exit -6) after
    the script's work is done: 9 of 20 two-rank runs of a script that waited on all its work,
    11 of 12 of one that left async work pending (``tests/distributed/_shutdown_repro.py
    drive --alias``; docs/launching.md, "Shutdown"). Every rank whose script returned calls
    this, so :func:`~engine.distributed.teardown.shutdown`'s barriers are matched. A peer that
    failed instead makes the barrier raise: that peer reports its own failure, so this rank
    only warns and leaves without draining.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return  # the script destroyed its groups itself, or never made any
    from engine.distributed.teardown import try_shutdown

    error = try_shutdown()
    if error is not None:
        sys.stderr.write(f"engine.compat.deepspeed: the script finished, but draining the process "
                         f"groups failed ({type(error).__name__}: {error}); a peer rank left early and "
                         f"reports its own error\n")


if __name__ == "__main__":
    main(sys.argv[1:])
