#!/bin/bash
# torchrun whose own exit status is 0 after a clean preemption (docs/training.md, "Exit status").
#
#   launch/torchrun_preemptible.sh --nproc_per_node 8 launch/train.py --config ... --save ckpt ...
#
# torchrun's agent turns a SIGTERM it receives into SignalException and exits 1 whatever its
# workers do, so a job whose ranks saved a checkpoint and exited 0 still ends "failed". Here
# torchrun runs with SIGTERM and SIGUSR1 ignored (--signals-to-handle keeps it from installing
# its own SIGTERM handler), and this script forwards both signals to the ranks (torchrun starts
# each in its own session, so a process-group kill does not reach them): every rank saves and
# exits 0 (launch/train.py with --save), and torchrun reports 0. SIGINT (Ctrl-C) is torchrun's as
# usual. A rank that does not stop is still killed by the scheduler's SIGKILL after its grace time.
# TORCHRUN overrides the launcher command (default: torchrun).
( trap '' TERM USR1; exec ${TORCHRUN:-torchrun} --signals-to-handle SIGINT,SIGHUP,SIGQUIT "$@" ) &
launcher=$!
forward() { pkill "-$1" -P "$launcher" 2>/dev/null || true; }
trap 'forward TERM' TERM
trap 'forward USR1' USR1
while true; do
    wait "$launcher"
    rc=$?
    kill -0 "$launcher" 2>/dev/null || break  # wait returned because a signal was trapped: wait again
done
exit "$rc"
