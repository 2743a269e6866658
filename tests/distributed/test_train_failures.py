"""launch/train.py as a user meets it when something is wrong (issue 19): real processes,
the tiny model, a few steps each.

1. ``--load``: a tag directory (as a save prints it) resumes bit-exact; a path with no
   checkpoint is exit 2 unless ``--load-if-exists``; a fresh or fine-tuning run never
   saves into a directory of checkpoints it did not load; ``--finetune``,
   ``--no-load-optim`` and a changed global batch size. (Before: a tag directory or an
   empty one trained from step 0 with exit 0 and overwrote the checkpoint.)
2. One job per folder: a second job on the same ``--output`` or ``--save`` exits 2 naming
   the first, which finishes unharmed (its metrics carry one run id). (Before: both ran
   and mixed their metrics and checkpoints.)
3. An unwritable ``--save`` is exit 2 before step 1. (Before: found at the first save.)
4. Failure attribution: rank 0 raising is named with its exception by every survivor,
   which says it only stopped; a SIGKILLed rank is the only one called killed; one line
   per rank, no Python or C++ traceback, no teardown warning.
5. A corrupt checkpoint: one line per rank, exit 1.
6. torchrun: bad input is one line from rank 0 only; SIGTERM under
   launch/torchrun_preemptible.sh ends with the checkpoint and launcher exit 0.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from harness import scaled
from test_train_entry import TRAIN, _env, tiny_config

from engine.distributed.spawn import free_port, start_script

HERE = os.path.dirname(os.path.abspath(__file__))
FAULT = os.path.join(HERE, "_train_fault.py")
TORCHRUN_PREEMPTIBLE = os.path.join(os.path.dirname(TRAIN), "torchrun_preemptible.sh")
NOISE = ("Traceback", "frame #", "outlive shutdown", "ChildFailedError")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """Tokenizer and token file built once, here, so the ranks only read the cache."""
    from engine.config import load_config
    from engine.training.trainer import build_data

    d = str(tmp_path_factory.mktemp("data_cache"))
    build_data(load_config(tiny_config(d), world_size=1))
    return d


def _cfg(tmp_path, cache_dir, name="cfg.json", **kw) -> str:
    over = kw.pop("over", {})
    path = tmp_path / name
    path.write_text(json.dumps({**tiny_config(cache_dir, **kw), **over}))
    return str(path)


def _train(tmp_path, *argv, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TRAIN, "--sample-tokens", "0", *argv], cwd=str(tmp_path), env=_env(),
                          capture_output=True, text=True, timeout=scaled(timeout))


def _records(out) -> list[dict]:
    with open(os.path.join(str(out), "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(out)}


def _lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.strip()]


def _slurm(tmp_path, n: int, argv: list[str], prefix: list[str] | None = None) -> list[subprocess.Popen]:
    """n ranks started as srun would (SLURM_* variables), each its own process."""
    return start_script([sys.executable, *(prefix or [TRAIN]), "--sample-tokens", "0", *argv], n, env=_env(),
                        cwd=str(tmp_path))


def _finish(procs, timeout=120) -> list[tuple[int, str]]:
    try:
        return [(p.wait(timeout=scaled(timeout)), p.communicate()[1]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _wait_for_steps(procs, out, steps: int, timeout=120) -> None:
    deadline, metrics = time.monotonic() + scaled(timeout), os.path.join(str(out), "metrics.jsonl")
    while not (os.path.exists(metrics) and open(metrics).read().count("\n") >= steps):
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)


# ------------------------------------------------------------------ 1. --load and --save
@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir):
    """One 8-step run saving at steps 4 and 8: its process, output and checkpoint directory.
    The --load tests and the corrupt-checkpoint test start from copies of it (one launch)."""
    tmp = tmp_path_factory.mktemp("trained")
    ck = tmp / "ck"
    a = _train(tmp, "--config", _cfg(tmp, cache_dir), "--steps", "8", "--save", str(ck), "--save-interval", "4",
               "--output", str(tmp / "a"))
    return a, tmp / "a", ck


def _copy_checkpoints(trained, tmp_path):
    import shutil

    a, _, ck = trained
    assert a.returncode == 0, a.stderr[-3000:]
    shutil.copytree(ck, tmp_path / "ck")
    return tmp_path / "ck"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_load_paths_finetune_and_the_save_guard(tmp_path, cache_dir, trained):
    cfg = _cfg(tmp_path, cache_dir)
    ck, empty = _copy_checkpoints(trained, tmp_path), tmp_path / "empty"
    empty.mkdir()
    ref = _losses(trained[1])
    # the tag directory a save prints resumes from that tag, bit-exact (same layout)
    b = _train(tmp_path, "--config", cfg, "--steps", "8", "--load", str(ck / "global_step4"), "--save", str(ck),
               "--output", str(tmp_path / "b"))
    assert b.returncode == 0, b.stderr[-3000:]
    assert "resuming at step 4" in b.stderr and "not from the newest checkpoint" in b.stderr
    assert [r["step"] for r in _records(tmp_path / "b")] == [5, 6, 7, 8]
    assert all(_losses(tmp_path / "b")[s] == ref[s] for s in (5, 6, 7, 8))
    # nothing to load: exit 2, one line (was: a warning, step 0, exit 0); --load-if-exists starts fresh
    c = _train(tmp_path, "--config", cfg, "--steps", "2", "--load", str(empty), "--output", str(tmp_path / "c"))
    assert c.returncode == 2 and _lines(c.stderr) == [c.stderr.strip()], c.stderr
    assert c.stderr.startswith("argument error: --load") and "holds no checkpoint" in c.stderr
    d = _train(tmp_path, "--config", cfg, "--steps", "2", "--load", str(empty), "--load-if-exists",
               "--save", str(empty), "--output", str(tmp_path / "d"))
    assert d.returncode == 0 and "nothing to resume" in d.stderr, d.stderr[-3000:]
    assert _losses(tmp_path / "d") == {1: ref[1], 2: ref[2]} and (empty / "global_step2").is_dir()
    # a fresh run, or a fine-tune, must not save over checkpoints it did not load
    latest = (ck / "latest").read_text()
    for extra, why in (([], "already holds checkpoints"), (["--load", str(ck), "--finetune"], "--finetune restarts")):
        e = _train(tmp_path, "--config", cfg, "--steps", "2", "--save", str(ck), *extra, "--output",
                   str(tmp_path / "e"))
        assert e.returncode == 2 and e.stderr.startswith("argument error: ") and why in e.stderr, e.stderr
        assert (ck / "latest").read_text() == latest and (ck / "global_step8").is_dir()
    # --finetune: the trained weights, step 1 again (a lower loss on step 1's batch than a fresh start)
    f = _train(tmp_path, "--config", cfg, "--steps", "2", "--load", str(ck), "--finetune", "--output",
               str(tmp_path / "f"))
    assert f.returncode == 0, f.stderr[-3000:]
    assert sorted(_losses(tmp_path / "f")) == [1, 2] and _losses(tmp_path / "f")[1] < ref[1] - 0.05
    # --no-load-optim: weights and step loaded (step 5's loss is a function of the weights),
    # fresh Adam moments (step 6 differs); a changed global batch size is a warning naming both
    g = _train(tmp_path, "--config", _cfg(tmp_path, cache_dir, "cfg16.json", over={"train_batch_size": 16}),
               "--steps", "6", "--load", str(ck / "global_step4"), "--no-load-optim", "--output", str(tmp_path / "g"))
    assert g.returncode == 0, g.stderr[-3000:]
    assert re.search(r"global batch of 8 sequences .* this run uses 16", g.stderr), g.stderr
    h = _train(tmp_path, "--config", cfg, "--steps", "6", "--load", str(ck / "global_step4"), "--no-load-optim",
               "--no-load-rng", "--output", str(tmp_path / "h"))
    assert h.returncode == 0, h.stderr[-3000:]
    assert _losses(tmp_path / "h")[5] == ref[5] and _losses(tmp_path / "h")[6] != ref[6]


# ------------------------------------------------------------------ 2. one job per folder
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_second_job_on_the_same_folders_is_refused_and_the_first_finishes(tmp_path, cache_dir):
    cfg = _cfg(tmp_path, cache_dir)
    out, ck = tmp_path / "out", tmp_path / "ck"
    first = subprocess.Popen([sys.executable, TRAIN, "--sample-tokens", "0", "--config", cfg, "--steps", "100000",
                              "--output", str(out), "--save", str(ck), "--save-interval", "3"],
                             cwd=str(tmp_path), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_steps([first], out, 4)
        same_out = _train(tmp_path, "--config", cfg, "--steps", "4", "--output", str(out))
        same_save = _train(tmp_path, "--config", cfg, "--steps", "4", "--output", str(tmp_path / "o2"),
                           "--save", str(ck), "--load", str(ck))
        first.send_signal(signal.SIGTERM)  # preemption: saves, exits 0
        code, (stdout, err) = first.wait(timeout=scaled(60)), first.communicate()
    finally:
        if first.poll() is None:
            first.kill()
    for second, what in ((same_out, "--output"), (same_save, "--save")):
        assert second.returncode == 2, second.stderr[-3000:]
        assert second.stderr.startswith(f"argument error: {what}") and "in use by another job" in second.stderr
        assert f"pid {first.pid} on host" in second.stderr and _lines(second.stderr) == [second.stderr.strip()]
    assert code == 0 and "preempted at step" in stdout, err[-3000:]
    recs = _records(out)
    assert [r["step"] for r in recs] == list(range(1, len(recs) + 1)) and len({r["run_id"] for r in recs}) == 1
    assert (ck / f"global_step{len(recs)}").is_dir() and not [n for n in os.listdir(ck) if n.startswith(".tmp-")]


# ------------------------------------------------------------------ 3. unwritable --save
def _unwritable(tmp_path) -> str:
    if os.geteuid() != 0:
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o500)
        return str(d)
    return "/sys/kernel"  # an existing directory that even root cannot create files in


@pytest.mark.timeout(180)
def test_unwritable_save_is_exit_2_before_step_1(tmp_path, cache_dir):
    r = _train(tmp_path, "--config", _cfg(tmp_path, cache_dir), "--steps", "30", "--save", _unwritable(tmp_path),
               "--output", str(tmp_path / "out"))
    assert r.returncode == 2 and r.stderr.startswith("argument error: cannot write to --save"), r.stderr
    assert _lines(r.stderr) == [r.stderr.strip()] and not (tmp_path / "out" / "metrics.jsonl").exists()


# ------------------------------------------------------------------ 4. failure attribution
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rank_0_raising_is_named_by_every_survivor(tmp_path, cache_dir):
    """Rank 0 hosts the rendezvous store and takes it with it; its record under --output
    is how the survivors still name it (was: 'store unreachable' and a 12-frame C++ stack)."""
    cfg = _cfg(tmp_path, cache_dir, dp=3, zero=1, over={"train_batch_size": 6})
    procs = _slurm(tmp_path, 3, ["--config", cfg, "--steps", "50", "--output", str(tmp_path / "out")],
                   prefix=[FAULT, "0", "3", "raise", "--", ])
    results = _finish(procs)
    assert [c for c, _ in results] == [1, 1, 1], results
    err0 = results[0][1]
    assert _lines(err0) == [f"error: rank 0: ValueError: injected fault at step 3 (traceback: "
                            f"{os.path.join(str(tmp_path / 'out'), 'logs', 'rank0.log')}; or run with --debug)"]
    assert "injected fault" in (tmp_path / "out" / "logs" / "rank0.log").read_text()
    for rank, (_, err) in enumerate(results[1:], start=1):
        assert _lines(err) == [err.strip()] and not any(n in err for n in NOISE), err
        assert err.startswith(f"error: rank {rank}: training stopped because a peer failed: rank 0 failed with "
                              "ValueError: injected fault at step 3"), err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sigkilled_rank_is_the_only_one_named_killed(tmp_path, cache_dir):
    cfg = _cfg(tmp_path, cache_dir, dp=3, zero=1, over={"train_batch_size": 6})
    out = tmp_path / "out"
    procs = _slurm(tmp_path, 3, ["--config", cfg, "--steps", "100000", "--output", str(out)])
    try:
        _wait_for_steps(procs, out, 2)
    except BaseException:
        _finish([p for p in procs if p.kill() or True])
        raise
    procs[1].send_signal(signal.SIGKILL)
    results = _finish(procs)
    assert [c for c, _ in results] == [1, -signal.SIGKILL, 1], results
    for rank in (0, 2):
        err = "\n".join(ln for ln in _lines(results[rank][1]) if not ln.startswith("step "))  # progress lines
        assert _lines(err) == [err.strip()] and not any(n in err for n in NOISE), err
        assert err.startswith(f"error: rank {rank}: training stopped because a peer failed: rank 1 is no longer "
                              f"running (pid {procs[1].pid} on "), err
        assert err.count("no longer running") == 1 and "killed" in err and "rank 0 is" not in err, err


# ------------------------------------------------------------------ 5. corrupt checkpoint
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_corrupt_checkpoint_is_one_line_per_rank(tmp_path, cache_dir, trained):
    ck = _copy_checkpoints(trained, tmp_path)
    shard = next((ck / "global_step8").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    cfg2 = _cfg(tmp_path, cache_dir, "cfg2.json", dp=2, zero=1)
    results = _finish(_slurm(tmp_path, 2, ["--config", cfg2, "--steps", "10", "--load", str(ck), "--output",
                                           str(tmp_path / "b")]))
    for rank, (code, err) in enumerate(results):
        assert code == 1 and _lines(err) == [err.strip()] and not any(n in err for n in NOISE), err
        assert err.startswith(f"error: rank {rank}: CheckpointError: ") and "sha256" in err, err


# ------------------------------------------------------------------ 6. under torchrun
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_bad_input_and_preemption(tmp_path, cache_dir):
    cfg = _cfg(tmp_path, cache_dir, dp=2, zero=1)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    bad = subprocess.run([*torchrun, "--master_port", str(free_port()), TRAIN, "--config", cfg, "--steps", "1",
                          "--timeout", "0"], cwd=str(tmp_path), env=_env(), capture_output=True, text=True, timeout=scaled(120))
    assert bad.stderr.count("argument error: --timeout") == 1, bad.stderr  # rank 0 only
    # SIGTERM to the launcher's process group (`kill -- -PGID`; torchrun's ranks have their own
    # sessions): the wrapper forwards it, the ranks save and exit 0, and so does the launcher
    # (plain torchrun exits 1: its agent raises SignalException)
    out, ck = tmp_path / "out", tmp_path / "ck"
    job = subprocess.Popen([TORCHRUN_PREEMPTIBLE, "--nproc_per_node", "2", "--master_port", str(free_port()), TRAIN,
                            "--config", cfg, "--steps", "100000", "--output", str(out), "--save", str(ck),
                            "--sample-tokens", "0"], cwd=str(tmp_path), env=dict(_env(), TORCHRUN=" ".join(torchrun[:3])),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for_steps([job], out, 11)
        os.killpg(job.pid, signal.SIGTERM)
        code, (stdout, stderr) = job.wait(timeout=scaled(90)), job.communicate()
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert code == 0, stderr[-3000:]
    step = len(_records(out))
    assert f"preempted at step {step}: checkpoint" in stdout and (ck / "latest").read_text().strip() == \
        f"global_step{step}"
    assert "\r" not in stderr and re.search(r"^step \d+/100000: loss", stderr, re.M)  # non-TTY progress lines
