"""One rank of tests/distributed/test_bringup.py, started as a real process.

    python _bringup_worker.py SCENARIO

The environment is what a launcher would set (torchrun-style RANK, WORLD_SIZE, ...);
VICTIM names the rank that misbehaves in the failure scenarios and TIMEOUT_S / GRACE_S
the collective timeout and the check-in grace period. The rank prints one JSON line
with what it saw and exits normally, so the test also sees exit-time aborts.

Scenarios: ok (init, collectives, groups, an optimizer, shutdown), user_init (the
default group made by the caller, then torch._dynamo imported), die (victim os._exit(3)s), raise
(victim raises inside failure_guard), hang (victim sleeps past the timeout), linger (victim
raises inside failure_guard, then sleeps: its sockets stay open, so only the failure watch
can tell the survivors).
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def main(scenario: str) -> int:
    import torch
    import torch.distributed as dist

    from engine.distributed import comm
    from engine.distributed.env import PeerFailureError, failure_guard, gloo_worker_threads, init_distributed, shutdown
    from engine.distributed.groups import ParallelGroups
    from engine.topology import Topology

    torch.set_num_threads(1)
    timeout_s = float(os.environ["TIMEOUT_S"])
    if scenario == "user_init":
        return user_init()
    env = init_distributed(timeout_s=timeout_s)
    out = {"rank": env.rank, "world": env.world_size, "local_rank": env.local_rank,
           "launcher": env.launch.launcher, "device": str(env.device), "backend": env.backend,
           "dist": [dist.get_rank(), dist.get_world_size(), dist.get_backend()]}
    t = torch.tensor([float(env.rank)], dtype=torch.float64)
    dist.all_reduce(t)
    out["sum"] = t.item()

    if scenario in ("ok", "single"):
        world = env.world_size
        groups = ParallelGroups.build(Topology(dp=world // 2 or 1, tp=2 if world > 1 else 1,
                                               world_size=world), timeout_s=timeout_s)
        s = torch.tensor([float(env.rank)], dtype=torch.float64)
        comm.all_reduce(s, groups.tp_group)  # the identity on a group of one ("single")
        work = comm.all_reduce(torch.ones(8), groups.dp_group, async_op=True)
        # the first optimizer imports torch._dynamo, which would pin the default group in
        # function defaults of torch.distributed.nn.functional (docs/launching.md)
        torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()).step()
        out["tp_sum"], out["tp_ranks"] = s.item(), list(groups.tp_ranks)
        out["watching"] = env.watch is not None and env.watch._thread.is_alive()
        del groups, work  # no references may outlive shutdown (docs/launching.md)
        time.sleep(float(os.environ.get("SLEEP_S", "0")))  # let a failure watch poll a while
        shutdown()
        out["initialized_after"] = dist.is_initialized()
        out["gloo_threads_after"] = gloo_worker_threads()
        print(json.dumps(out), flush=True)
        return 0

    victim = int(os.environ["VICTIM"])
    grace_s = float(os.environ["GRACE_S"])
    if env.rank == victim:
        if scenario == "die":
            os._exit(3)
        if scenario == "hang":
            time.sleep(600)  # the test kills us
        if scenario == "raise":
            with failure_guard(env, "training step"):
                raise ValueError("bad batch on the victim")
        if scenario == "linger":  # fails, but its process (and sockets) stay, as a stuck NCCL rank's would
            try:
                with failure_guard(env, "training step"):
                    raise ValueError("bad batch on the victim")
            except ValueError:
                time.sleep(600)  # the test kills us
    if scenario == "linger":
        print(json.dumps({"blocked_at": time.time()}), flush=True)
    start = time.monotonic()
    try:
        with failure_guard(env, "gradient all-reduce", grace_s=grace_s):
            for _ in range(3):
                dist.all_reduce(t)
        out["error"] = None
    except PeerFailureError as exc:
        out["error"] = str(exc)
        out["cause_type"] = type(exc.__cause__).__name__
    out["elapsed"] = time.monotonic() - start
    print(json.dumps(out), flush=True)
    return 0


def user_init() -> int:
    """The caller creates the default group itself (not init_distributed), then imports
    torch._dynamo, which pins it in function defaults; shutdown() must release it."""
    import torch
    import torch.distributed as dist

    from engine.distributed.env import gloo_worker_threads, shutdown

    dist.init_process_group("gloo")
    import torch._dynamo  # noqa: F401

    torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    t = torch.ones(1)
    dist.all_reduce(t)
    shutdown()
    print(json.dumps({"sum": t.item(), "gloo_threads_after": gloo_worker_threads()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
