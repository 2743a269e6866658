"""Launch detection (pure parsing), hostlists, precedence, error messages, op-build settings."""

import os
import re

import pytest

from engine.distributed.env import (
    DEFAULT_MASTER_PORT,
    SLURM_PORT_BASE,
    SLURM_PORT_SPAN,
    LaunchError,
    LaunchInfo,
    detect_launch,
    env_flag,
    expand_hostlist,
    op_build_settings,
)

ARGV = ["train.py"]


def torchrun_env(rank=1, world=4, local=1, local_world=2, **extra):
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
           "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "none",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    env.update(extra)
    return env


def deepspeed_env(rank=3, world=8, local=3, **extra):
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
           "LOCAL_SIZE": "4", "CROSS_RANK": "0", "CROSS_SIZE": "2",
           "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}
    env.update(extra)
    return env


def slurm_env(**extra):
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_JOB_ID": "123456",
           "SLURM_JOB_NODELIST": "gpu[07-10]"}
    env.update(extra)
    return env


def ompi_env(**extra):
    env = {"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "16",
           "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
           "MASTER_ADDR": "head", "MASTER_PORT": "6000"}
    env.update(extra)
    return env


def raises(launcher, *words):
    """LaunchError whose message names the launcher and every word (variable names)."""
    pattern = "".join(f"(?=.*{re.escape(w)})" for w in (f"'{launcher}'",) + words)
    return pytest.raises(LaunchError, match=re.compile(pattern, re.S))


# ------------------------------------------------------------------------ happy paths
def test_single_process_defaults():
    assert detect_launch({}, ARGV) == LaunchInfo("single", 0, 0, 1, 1, "127.0.0.1",
                                                 DEFAULT_MASTER_PORT)
    info = detect_launch({"MASTER_PORT": "1234", "MASTER_ADDR": "h"}, ARGV)
    assert (info.launcher, info.master_addr, info.master_port) == ("single", "h", 1234)


def test_torchrun():
    info = detect_launch(torchrun_env(), ARGV)
    assert info == LaunchInfo("torchrun", 1, 1, 4, 2, "10.0.0.1", 29400, agent_store=False)
    assert detect_launch(torchrun_env(TORCHELASTIC_USE_AGENT_STORE="True"), ARGV).agent_store


@pytest.mark.parametrize("marker", ["TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_WORLD_SIZE"])
def test_torchrun_any_marker(marker):
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "a",
           "MASTER_PORT": "1", marker: "1" if marker != "LOCAL_WORLD_SIZE" else "2"}
    assert detect_launch(env, ARGV).launcher == "torchrun"


def test_deepspeed_env_and_argv():
    info = detect_launch(deepspeed_env(), ["train.py", "--local_rank=3", "--deepspeed"])
    assert info == LaunchInfo("deepspeed", 3, 3, 8, 4, "node01", 29500)
    # --local_rank N form, and LOCAL_RANK taken from argv when the env lacks it
    env = deepspeed_env()
    del env["LOCAL_RANK"]
    assert detect_launch(env, ["t.py", "--local_rank", "3"]).local_rank == 3
    assert detect_launch(env, ["t.py", "--local-rank=3"]).local_rank == 3


def test_plain_env_vars_count_as_deepspeed_style():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "x",
           "MASTER_PORT": "5"}
    info = detect_launch(env, ARGV)
    assert (info.launcher, info.local_world_size) == ("deepspeed", None)


def test_slurm():
    info = detect_launch(slurm_env(), ARGV)
    assert info == LaunchInfo("slurm", 5, 1, 8, 2, "gpu07",
                              SLURM_PORT_BASE + 123456 % SLURM_PORT_SPAN)
    assert 1024 < info.master_port < 32768  # unprivileged, below the ephemeral range


def test_slurm_port_deterministic_per_job_and_env_overrides():
    a = detect_launch(slurm_env(SLURM_JOB_ID="42"), ARGV).master_port
    assert a == detect_launch(slurm_env(SLURM_JOB_ID="42", SLURM_PROCID="0"), ARGV).master_port
    assert a != detect_launch(slurm_env(SLURM_JOB_ID="43"), ARGV).master_port
    info = detect_launch(slurm_env(MASTER_PORT="7000", MASTER_ADDR="explicit"), ARGV)
    assert (info.master_addr, info.master_port) == ("explicit", 7000)


def test_slurm_nodelist_sources():
    env = slurm_env(SLURM_NODELIST="b[3-4]")
    del env["SLURM_JOB_NODELIST"]
    assert detect_launch(env, ARGV).master_addr == "b3"
    # the step's node list wins: rank 0 of the step runs on its first node
    env = slurm_env(SLURM_STEP_NODELIST="gpu[09-10]")
    assert detect_launch(env, ARGV).master_addr == "gpu09"


@pytest.mark.parametrize("spec,node,want", [("2(x4)", 2, 2), ("3(x2),1", 2, 1), ("4", 0, 4),
                                            ("1,2,3", 1, 2)])
def test_slurm_tasks_per_node(spec, node, want):
    env = slurm_env(SLURM_TASKS_PER_NODE=spec, SLURM_NODEID=str(node), SLURM_LOCALID="0",
                    SLURM_NTASKS="16")
    assert detect_launch(env, ARGV).local_world_size == want


def test_slurm_local_world_unknown_without_nodeid():
    env = slurm_env()
    del env["SLURM_NODEID"]
    assert detect_launch(env, ARGV).local_world_size is None


def test_openmpi():
    assert detect_launch(ompi_env(), ARGV) == LaunchInfo("openmpi", 6, 2, 16, 4, "head", 6000)


# ------------------------------------------------------------------------- hostlists
@pytest.mark.parametrize("spec,want", [
    ("node1", ["node1"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("gpu-[001-002]-x", ["gpu-001-x", "gpu-002-x"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("r[1-2]-n[0-1]", ["r1-n0", "r1-n1", "r2-n0", "r2-n1"]),
    ("x[5],y[009-010],z", ["x5", "y009", "y010", "z"]),
    ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
])
def test_expand_hostlist(spec, want):
    assert expand_hostlist(spec) == want


@pytest.mark.parametrize("spec", ["node[1-2", "node1-2]", "a[[1]]", "a[]", "a[x-y]", "a[3-1]",
                                  "a,,b", ""])
def test_bad_hostlist(spec):
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST"):
        expand_hostlist(spec, "SLURM_JOB_NODELIST")


def test_bad_hostlist_in_env_names_variable():
    with raises("slurm", "SLURM_JOB_NODELIST", "unbalanced"):
        detect_launch(slurm_env(SLURM_JOB_NODELIST="gpu[07-"), ARGV)


# ------------------------------------------------------------------------- precedence
def test_torchrun_inside_srun_explicit_vars_win():
    env = slurm_env(**torchrun_env())
    info = detect_launch(env, ARGV)
    assert (info.launcher, info.rank, info.world_size, info.master_addr) == \
        ("torchrun", 1, 4, "10.0.0.1")


def test_openmpi_beats_slurm():
    info = detect_launch(slurm_env(**ompi_env()), ARGV)
    assert (info.launcher, info.rank, info.world_size) == ("openmpi", 6, 16)


def test_explicit_vars_beat_openmpi():
    assert detect_launch(ompi_env(**deepspeed_env()), ARGV).launcher == "deepspeed"


# ----------------------------------------------------------------------- error paths
@pytest.mark.parametrize("var", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"])
def test_torchrun_missing(var):
    env = torchrun_env()
    del env[var]
    with raises("torchrun", var):
        detect_launch(env, ARGV)


def test_world_size_without_rank_and_vice_versa():
    with raises("deepspeed", "WORLD_SIZE", "RANK is missing"):
        detect_launch({"WORLD_SIZE": "4"}, ARGV)
    with raises("deepspeed", "RANK", "WORLD_SIZE is missing"):
        detect_launch({"RANK": "0"}, ARGV)
    # inside a Slurm allocation a half-set explicit pair is still an error, not a fallback
    with raises("deepspeed", "RANK is missing"):
        detect_launch(slurm_env(WORLD_SIZE="8"), ARGV)


def test_markers_without_rank():
    with raises("torchrun", "TORCHELASTIC_RUN_ID", "RANK and WORLD_SIZE are missing"):
        detect_launch({"TORCHELASTIC_RUN_ID": "x"}, ARGV)
    with raises("deepspeed", "--local_rank", "RANK and WORLD_SIZE are missing"):
        detect_launch({}, ["t.py", "--local_rank=0"])


@pytest.mark.parametrize("var,value", [("RANK", "one"), ("WORLD_SIZE", "4.0"), ("LOCAL_RANK", ""),
                                       ("MASTER_PORT", "http"), ("LOCAL_WORLD_SIZE", "two")])
def test_torchrun_non_integer(var, value):
    with raises("torchrun", var, "not an integer"):
        detect_launch(torchrun_env(**{var: value}), ARGV)


@pytest.mark.parametrize("kw,words", [
    (dict(rank=4, world=4), ("RANK=4", "WORLD_SIZE=4")),
    (dict(rank=-1), ("RANK=-1", ">= 0")),
    (dict(world=0, rank=0), ("WORLD_SIZE=0", ">= 1")),
    (dict(local=2, local_world=2), ("LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2")),
    (dict(local_world=8, world=4), ("LOCAL_WORLD_SIZE=8", "WORLD_SIZE=4")),
])
def test_torchrun_contradictions(kw, words):
    with raises("torchrun", *words):
        detect_launch(torchrun_env(**kw), ARGV)


@pytest.mark.parametrize("port", ["0", "70000", "-5"])
def test_bad_port(port):
    with raises("torchrun", "MASTER_PORT"):
        detect_launch(torchrun_env(MASTER_PORT=port), ARGV)


def test_deepspeed_argv_contradicts_env():
    with raises("deepspeed", "LOCAL_RANK=3", "--local_rank=1"):
        detect_launch(deepspeed_env(), ["t.py", "--local_rank=1"])
    with raises("deepspeed", "--local_rank='x'", "not a non-negative integer"):
        detect_launch(deepspeed_env(), ["t.py", "--local_rank=x"])
    with raises("deepspeed", "--local_rank=''"):
        detect_launch(deepspeed_env(), ["t.py", "--local_rank"])
    with raises("deepspeed", "--local-rank='-1'"):
        detect_launch(deepspeed_env(), ["t.py", "--local-rank", "-1"])


def test_deepspeed_local_rank_beyond_local_size():
    with raises("deepspeed", "LOCAL_RANK=5", "LOCAL_SIZE=4"):
        detect_launch(deepspeed_env(rank=5, local=5), ARGV)


def test_missing_local_rank_hint():
    env = deepspeed_env()
    del env["LOCAL_RANK"]
    with raises("deepspeed", "LOCAL_RANK is missing", "SLURM_LOCALID"):
        detect_launch(env, ARGV)


def test_local_rank_exceeds_rank_when_local_world_unknown():
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "a", "MASTER_PORT": "2"}
    with raises("deepspeed", "LOCAL_RANK=1", "RANK=0"):
        detect_launch(env, ARGV)


@pytest.mark.parametrize("var", ["SLURM_NTASKS", "SLURM_LOCALID"])
def test_slurm_missing(var):
    env = slurm_env()
    del env[var]
    with raises("slurm", var):
        detect_launch(env, ARGV)


def test_slurm_nprocs_fallback():
    env = slurm_env(SLURM_NPROCS="8")
    del env["SLURM_NTASKS"]
    assert detect_launch(env, ARGV).world_size == 8


def test_slurm_no_nodelist_no_addr():
    env = slurm_env()
    del env["SLURM_JOB_NODELIST"]
    with raises("slurm", "MASTER_ADDR", "SLURM_JOB_NODELIST"):
        detect_launch(env, ARGV)


def test_slurm_no_port_no_job_id():
    env = slurm_env()
    del env["SLURM_JOB_ID"]
    with raises("slurm", "MASTER_PORT", "SLURM_JOB_ID"):
        detect_launch(env, ARGV)
    with raises("slurm", "SLURM_JOB_ID", "not an integer"):
        detect_launch(slurm_env(SLURM_JOB_ID="12_3"), ARGV)


@pytest.mark.parametrize("kw,words", [
    (dict(SLURM_PROCID="8"), ("SLURM_PROCID=8", "SLURM_NTASKS=8")),
    (dict(SLURM_PROCID="x"), ("SLURM_PROCID", "not an integer")),
    (dict(SLURM_LOCALID="2"), ("SLURM_LOCALID=2", "SLURM_TASKS_PER_NODE=2")),
    (dict(SLURM_TASKS_PER_NODE="2(4)"), ("SLURM_TASKS_PER_NODE", "2(x3),1")),
    (dict(SLURM_NODEID="9"), ("SLURM_NODEID=9", "4 nodes")),
])
def test_slurm_contradictions(kw, words):
    with raises("slurm", *words):
        detect_launch(slurm_env(**kw), ARGV)


@pytest.mark.parametrize("var", ["MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_SIZE",
                                 "OMPI_COMM_WORLD_LOCAL_RANK"])
def test_openmpi_missing(var):
    env = ompi_env()
    del env[var]
    with raises("openmpi", var):
        detect_launch(env, ARGV)


def test_openmpi_missing_master_explains_mpirun_flags():
    env = ompi_env()
    del env["MASTER_ADDR"]
    with raises("openmpi", "MASTER_ADDR", "-x MASTER_ADDR"):
        detect_launch(env, ARGV)


def test_openmpi_rank_out_of_range():
    with raises("openmpi", "OMPI_COMM_WORLD_RANK=16", "OMPI_COMM_WORLD_SIZE=16"):
        detect_launch(ompi_env(OMPI_COMM_WORLD_RANK="16"), ARGV)


def test_single_bad_port():
    with raises("single", "MASTER_PORT"):
        detect_launch({"MASTER_PORT": "abc"}, ARGV)


def test_launch_error_is_runtime_error():
    assert issubclass(LaunchError, RuntimeError)


# --------------------------------------------------------------------- op settings
def test_op_build_settings():
    s = op_build_settings({"ENGINE_BUILD_OPS": "1", "ENGINE_EXTENSIONS_DIR": "/x",
                           "TORCH_CUDA_ARCH_LIST": "8.0;9.0"})
    assert (s.build_ops, s.extensions_dir, s.cuda_arch_list) == (True, "/x", "8.0;9.0")
    s = op_build_settings({})
    assert (s.build_ops, s.extensions_dir, s.cuda_arch_list) == (False, None, None)
    assert op_build_settings({"ENGINE_BUILD_OPS": "off"}).build_ops is False


def test_env_flag():
    for raw in ("1", "true", "YES", "On"):
        assert env_flag("F", environ={"F": raw}) is True
    for raw in ("0", "false", "no", "OFF", ""):
        assert env_flag("F", default=True, environ={"F": raw}) is False
    assert env_flag("F", default=True, environ={}) is True
    with pytest.raises(ValueError, match="ENGINE_BUILD_OPS='maybe'"):
        op_build_settings({"ENGINE_BUILD_OPS": "maybe"})


# ------------------------------------------------------------ failure diagnosis (no processes)
def test_diagnosis_names_raised_dead_and_silent_ranks():
    import socket
    import subprocess
    import sys

    import torch.distributed as dist

    from engine.distributed import env as E
    from engine.distributed import failures as F

    store = dist.HashStore()
    info = LaunchInfo("torchrun", 1, 1, 4, 4, "127.0.0.1", 1)
    denv = E.DistEnv(launch=info, device=None, backend="gloo", timeout_s=1.0, store=store)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: the pid no longer exists
    host = socket.gethostname()
    store.set("engine/proc/0", f"{host} {os.getpid()}")  # alive, but never checks in
    store.set("engine/proc/1", f"{host} {os.getpid()}")
    store.set("engine/proc/2", f"{host} {dead.pid}")
    store.set("engine/proc/3", f"elsewhere {dead.pid}")  # another host: not judged by pid
    E.record_failure(E.DistEnv(launch=LaunchInfo("torchrun", 3, 3, 4, 4, "h", 1), device=None,
                               backend="gloo", timeout_s=1.0, store=store),
                     ValueError("bad batch"))
    assert F._check_in(denv) is None
    msg = F._diagnose(denv, grace_s=0.2)
    assert "rank 3 failed with ValueError: bad batch" in msg
    assert f"rank 2 is no longer running (pid {dead.pid} on {host})" in msg
    assert "rank 0 still running, not stopped within 0.2s" in msg
    assert "rank 1" not in msg


def test_store_host_waits_for_a_reader_when_the_failed_rank_has_also_exited():
    """Rank 2 recorded its failure and exited; rank 1 checked in but has not finished reading.
    The store's host (rank 0) must keep the store up for rank 1: counting rank 2 both as failed
    and as gone used to end the wait at once, and rank 1 then saw only 'store unreachable'."""
    import socket
    import subprocess
    import sys
    import time

    import torch.distributed as dist

    from engine.distributed import env as E
    from engine.distributed import failures as F

    store = dist.HashStore()
    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for r, pid in ((0, os.getpid()), (1, os.getpid()), (2, dead.pid)):
        store.set(f"engine/proc/{r}", f"{host} {pid}")
    E.record_failure(E.DistEnv(launch=LaunchInfo("torchrun", 2, 2, 3, 3, "h", 1), device=None,
                               backend="gloo", timeout_s=1.0, store=store), ValueError("bad batch"))
    host_env = E.DistEnv(launch=LaunchInfo("torchrun", 0, 0, 3, 3, "h", 1), device=None, backend="gloo",
                         timeout_s=1.0, store=store)
    assert F._check_in(host_env) is None
    store.set("engine/checkin/1", "1")  # rank 1: checked in, still diagnosing
    store.add("engine/count/checkin", 1)
    store.add("engine/count/done", 1)  # rank 0's own diagnosis is done
    assert F._gone_silent(store, 3) == set()  # rank 2 is counted as failed, not again as gone
    start = time.monotonic()
    F._wait_for_readers(host_env, grace_s=0.6)
    assert time.monotonic() - start >= 0.5  # it waited for rank 1 (who never finished) until the grace


def test_comm_error_classification():
    from engine.distributed.failures import _is_comm_error

    assert _is_comm_error(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] "
                                       "Connection closed by peer [127.0.0.1]:1"))
    assert _is_comm_error(RuntimeError("Timed out waiting 3000ms for recv operation"))
    assert not _is_comm_error(RuntimeError("ProcessGroupGloo::allreduce: invalid tensor size"))
    assert not _is_comm_error(ValueError("Connection closed by peer"))


# ------------------------------------------------------------------ GPU choice (issue 17)
def test_cuda_index_one_gpu_per_task_binding_and_errors():
    from engine.distributed.env import LaunchError, cuda_index_for

    assert cuda_index_for(3, 8, "torchrun") == 3          # whole node visible: local rank's GPU
    assert cuda_index_for(5, 1, "slurm") == 0             # srun --gpus-per-task=1: the one bound GPU
    with pytest.raises(LaunchError, match="only 2 GPU"):
        cuda_index_for(3, 2, "slurm")                     # cannot map one-to-one
    with pytest.raises(LaunchError, match="no GPU is visible"):
        cuda_index_for(0, 0, "slurm")


def test_user_initialised_nccl_group_without_set_device_uses_the_local_rank_gpu():
    from engine.distributed.env import device_for_initialised_group

    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h",
           "MASTER_PORT": "1234", "TORCHELASTIC_RUN_ID": "x"}
    # no set_device (current device 0 everywhere): the local rank's GPU, not GPU 0
    assert device_for_initialised_group("nccl", None, 0, 4, env) == ("cuda", 1)
    assert device_for_initialised_group("nccl", 2, 0, 4, env) == ("cuda", 2)   # device_id= given at init wins
    assert device_for_initialised_group("nccl", None, 3, 4, env) == ("cuda", 3)  # the user's set_device wins
    assert device_for_initialised_group("gloo", None, 0, 0, env) == ("cpu", None)


def test_nccl_flight_recorder_defaults_do_not_override_the_user():
    from engine.distributed.env import nccl_env_defaults, strict_comm_from_env

    assert nccl_env_defaults({}) == {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                                     "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert nccl_env_defaults({"TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}) == {}
    assert strict_comm_from_env({}) is False and strict_comm_from_env({"ENGINE_STRICT_COMM": "1"}) is True
