#!/bin/bash
# torchrun whose own exit status is 0 after a clean preemption (docs/training.md, "Exit status").
#
#   launch/torchrun_preemptible.sh --nproc_per_node 8 launch/train.py --config ... --save ckpt ...
#
# torchrun's agent turns SIGTERM into SignalException and exits 1 whatever its workers do, so a
# job whose ranks saved a checkpoint and exited 0 still ends "failed". Here the launcher ignores
# SIGTERM and SIGUSR1 (inherited dispositions; --signals-to-handle keeps torchrun from
# installing its own SIGTERM handler): the signal reaches the ranks (Slurm and `kill -- -PGID`
# signal every process of the job), launch/train.py re-enables it on each rank, every rank saves
# and exits 0, and torchrun reports 0. Ctrl-C (SIGINT) still stops everything at once. A rank
# that does not stop is still killed by the scheduler's SIGKILL after its grace period.
trap '' TERM USR1
exec ${TORCHRUN:-torchrun} --signals-to-handle SIGINT,SIGHUP,SIGQUIT "$@"
