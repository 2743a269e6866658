"""The training entry point and its loop.

1. Loss trajectory over layouts: 8 fp32 steps of the tiny reference GPT with the same
   global batch at (dp, tp, pp) = (1,1,1), (2,1,1) x ZeRO 0-3, (1,2,1) (with and without
   sequence parallelism), (1,1,2) (1F1B, GPipe, ZB-H1, activation checkpointing; interleaved
   1F1B on a 4-layer model) and (2,2,2) (ZeRO 1; extended: ZeRO 0 with sequence parallelism,
   ZeRO 3 with GPipe), through
   the loop launch/train.py runs (engine.initialize + engine.training.trainer.train), against
   (1,1,1); then eval_batch, and the weights gathered into one dense model on rank 0 (the
   sampling path) give the same eval loss.
2. launch/train.py under the real deepspeed launcher and under torchrun (2 CPU ranks):
   identical per-step losses, equal to the in-process trajectory; the output files.
3. Ctrl-C: every rank of a Slurm-style launch stops promptly.

Tolerance of 1: rtol 2e-6 on the per-step loss (~5.5), i.e. ~20 fp32 ulp. Layouts change
only the order of floating-point sums (TP splits matmuls and the softmax normaliser,
DP/ZeRO sum gradients over ranks, PP accumulates micro-batches on another rank); the
measured difference over 8 AdamW steps is at most 8.8e-8 relative (one ulp of the loss)
for every layout here. Any real error (a gradient not averaged, a shard misplaced, a
tied gradient not summed, a wrong micro-batch, the LR schedule stepped twice) changes the
loss by more than 1e-3 from step 2 on.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time

import pytest
from harness import run_ranks, scaled

from engine.distributed.spawn import free_port, start_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(ROOT, "launch", "train.py")
STEPS = 8
RTOL = 2e-6
STD = sysconfig.get_paths()["stdlib"]


def tiny_config(cache_dir: str, dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, schedule: str = "1f1b",
                sp: bool = False, ckpt: int = 0, v: int = 1, layers: int = 2) -> dict:
    """The tiny reference GPT with a global batch of 8 sequences (micro-batch 2)."""
    return {
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "seed": 7, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "torch_adam": True}},
        "scheduler": {"type": "cosine", "params": {"warmup_num_steps": 2, "total_num_steps": 8}},
        "zero_optimization": {"stage": zero, "reduce_bucket_size": 5000},
        "tensor_parallel": {"autotp_size": tp, "sequence_parallel": sp},
        "pipeline": {"stages": pp, "partition": "uniform", "schedule": schedule, "virtual_stages": v,
                     "activation_checkpoint_interval": ckpt},
        "model": {"vocab_size": 256, "hidden_size": 32, "num_layers": layers, "num_heads": 4, "seq_len": 16},
        "data": {"train_files": [os.path.join(STD, "textwrap.py"), os.path.join(STD, "argparse.py")],
                 "cache_dir": cache_dir},
    }


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """Tokenizer and token file built once, here, so the ranks only read the cache."""
    from engine.config import load_config
    from engine.training.trainer import build_data

    d = str(tmp_path_factory.mktemp("data_cache"))
    build_data(load_config(tiny_config(d), world_size=1))
    return d



def _losses(path: str) -> list[float]:
    with open(os.path.join(path, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


# ------------------------------------------------------------------ 1. trajectories
@pytest.fixture(scope="module")
def reference(cache_dir):
    """The (1,1,1) trajectories of the 2-layer model and of a 4-layer one (for interleaving)."""
    (two, _), (four, _) = run_ranks(_trajectories, 1, [tiny_config(cache_dir), tiny_config(cache_dir, layers=4)],
                                    timeout=120)[0]
    return {2: two, 4: four}


def _trajectories(rank, world, configs, steps=STEPS):
    """Per config: the per-step losses of ``steps`` steps plus an eval loss, and the loss of the
    trained weights gathered into one dense model (rank 0; None elsewhere)."""
    import engine
    from engine.config import load_config
    from engine.generate import gather_reference_model
    from engine.training.trainer import build_data, train

    out = []
    for c in configs:
        cfg = load_config(c, world_size=world)
        _, sampler = build_data(cfg)
        eng, *_ = engine.initialize(config=cfg)
        losses = [r["loss"] for r in train(eng, sampler, steps, output_dir=None)]
        # and eval_batch afterwards (forward-only pipeline walk) on another step's batch
        g = eng.groups
        mbs = sampler.local_microbatches(100, g.dp_rank, g.dp_size, cfg.train_micro_batch_size_per_gpu)
        losses.append(eng.eval_batch(iter(mbs)).item())
        # the trained weights gathered into one dense model on rank 0 (the sampling path)
        dense = gather_reference_model(eng)
        dense_loss = None if dense is None else dense(*_pair(sampler.batch_at(100))).item()
        out.append((losses, dense_loss))
        eng.destroy()
    return out


def _pair(batch):
    return batch.inputs, batch.targets


def _check_trajectories(cache_dir, reference, worlds):
    runs = {}
    for world, layouts in worlds:
        per_rank = run_ranks(_trajectories, world, [tiny_config(cache_dir, **k) for k in layouts], timeout=240)
        for k, (losses, dense_loss) in zip(layouts, per_rank[0]):
            runs[str(k)] = losses
            # the gathered dense model computes the eval loss the distributed engine computed
            assert dense_loss == pytest.approx(losses[-1], rel=RTOL), f"{k}: gathered model"
        for r in per_rank[1:]:  # every rank reports the same (global-batch) loss
            assert [x[0] for x in r] == [x[0] for x in per_rank[0]]
    assert reference[2][STEPS - 1] < reference[2][0] - 0.1, f"the tiny model did not learn: {reference[2]}"
    for name, losses in runs.items():
        ref = reference[4 if "'layers': 4" in name else 2]
        assert losses == pytest.approx(ref, rel=RTOL), f"{name}: {losses} vs (1,1,1) {ref}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_loss_trajectory_is_the_same_for_every_layout(cache_dir, reference):
    """Every layout of 2 ranks, and (2,2,2) with ZeRO 1: each feature (ZeRO 0-3, TP with and
    without sequence parallelism, every schedule) composed in 3D at least once; the other two
    (2,2,2) layouts are test_more_3d_layouts_trace_the_same_trajectory's (extended)."""
    two = [dict(dp=2, zero=z) for z in range(4)] + [
        dict(tp=2, zero=1), dict(tp=2, zero=0, sp=True),
        dict(pp=2, zero=1), dict(pp=2, zero=0, schedule="gpipe"), dict(pp=2, zero=1, schedule="zb-h1"),
        dict(pp=2, zero=0, ckpt=1), dict(pp=2, zero=1, schedule="interleaved-1f1b", v=2, layers=4)]
    _check_trajectories(cache_dir, reference, ((2, two), (8, [dict(dp=2, tp=2, pp=2, zero=1)])))


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_more_3d_layouts_trace_the_same_trajectory(cache_dir, reference):
    eight = [dict(dp=2, tp=2, pp=2, zero=0, sp=True), dict(dp=2, tp=2, pp=2, zero=3, schedule="gpipe")]
    _check_trajectories(cache_dir, reference, ((8, eight),))


# ------------------------------------------------------------------ 2. launchers
def _write_config(tmp_path, cache_dir, **kw) -> str:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(tiny_config(cache_dir, **kw)))
    return str(path)


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)  # the script must find the engine by itself
    return env


LAUNCH_STEPS = 4


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory, cache_dir):
    """launch/train.py under torchrun on 2 CPU ranks (dp 2, ZeRO-1): (its config, output dir, process)."""
    tmp = tmp_path_factory.mktemp("torchrun")
    cfg = _write_config(tmp, cache_dir, dp=2, zero=1)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), TRAIN, "--config", cfg, "--steps", str(LAUNCH_STEPS),
                           "--output", str(tmp / "out"), "--sample-tokens", "8"],
                          cwd=str(tmp), env=_env(), capture_output=True, text=True, timeout=scaled(240))
    return cfg, tmp / "out", proc


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_trains_and_writes_its_outputs(torchrun_run, reference):
    _, out, tr = torchrun_run
    assert tr.returncode == 0, tr.stdout[-3000:] + tr.stderr[-3000:]
    # the same losses as the in-process loop (another layout: within the layout tolerance)
    assert _losses(str(out)) == pytest.approx(reference[2][:LAUNCH_STEPS], rel=RTOL)
    assert "sample (greedy):" in tr.stdout and "step 4/4: loss" in tr.stderr  # rank 0's progress line (no TTY)
    assert "\r" not in tr.stderr and tr.stderr.count("step 4/4") == 1
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    for key in ("step", "loss", "lr", "grad_norm", "loss_scale", "skipped", "tokens_per_s", "step_time_ms", "mfu"):
        assert all(key in r for r in recs), key
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and not any(r["skipped"] for r in recs)
    mem = json.load(open(out / "memory.json"))
    assert [r["rank"] for r in mem["ranks"]] == [0, 1]
    for r in mem["ranks"]:
        assert r["params_bytes"] > 0 and r["grads_bytes"] > 0 and r["optimizer_state_bytes"] > 0
        assert r["peak_bytes"] > 0
    resolved = json.load(open(out / "config.json"))
    assert resolved["zero_optimization"]["stage"] == 1 and resolved["gradient_accumulation_steps"] == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_deepspeed_launcher_gives_the_same_losses_as_torchrun(torchrun_run, tmp_path):
    if shutil.which("deepspeed") is None:
        pytest.skip("the deepspeed launcher is not installed (pip install --no-build-isolation deepspeed)")
    cfg, tr_out, tr = torchrun_run
    assert tr.returncode == 0, tr.stderr[-3000:]
    ds = subprocess.run(["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), TRAIN,
                         "--deepspeed", "--deepspeed_config", cfg, "--steps", str(LAUNCH_STEPS), "--output", str(tmp_path / "ds"),
                         "--sample-tokens", "8"],
                        cwd=str(tmp_path), env=_env(), capture_output=True, text=True, timeout=scaled(240))
    assert ds.returncode == 0, ds.stdout[-3000:] + ds.stderr[-3000:]
    a, b = _losses(str(tmp_path / "ds")), _losses(str(tr_out))
    assert len(a) == LAUNCH_STEPS and a == b  # same layout, same machine: bit-identical


# ------------------------------------------------------------------ 3. Ctrl-C
@contextlib.contextmanager
def _sigint_not_ignored():
    """Processes started inside get SIGINT's default action even when this one ignores it: a
    suite started in the background of a non-interactive shell (`pytest &` in a script, some
    CI runners) inherits SIGINT ignored, Python leaves an inherited SIG_IGN alone, and the
    ranks would never see the Ctrl-C this test sends. A Python handler here is the default
    action after the child's exec."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("who", ["all", "rank0"])
def test_ctrl_c_stops_every_rank_promptly(tmp_path, cache_dir, who):
    """Two ranks launched as srun would (SLURM_* variables), interrupted mid-training: SIGINT
    to every rank (a terminal's Ctrl-C reaches the whole process group), or to rank 0 only
    (the other rank's next collective fails as soon as rank 0's sockets close)."""
    cfg = _write_config(tmp_path, cache_dir, dp=2, zero=1)
    out = tmp_path / "run"
    with _sigint_not_ignored():
        procs = start_script([sys.executable, TRAIN, "--config", cfg, "--steps", "100000", "--output", str(out),
                              "--sample-tokens", "0"], 2, env=_env(), cwd=str(tmp_path))
    try:
        deadline = time.monotonic() + scaled(120)
        metrics = out / "metrics.jsonl"
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.2)
        assert metrics.exists(), "training did not start"
        t0 = time.monotonic()
        for p in procs if who == "all" else procs[:1]:
            p.send_signal(signal.SIGINT)
        codes = [p.wait(timeout=scaled(30)) for p in procs]
        elapsed = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    expected = [130, 130] if who == "all" else [130, 1]
    assert codes == expected, [p.stderr.read()[-2000:] for p in procs]
    assert elapsed < scaled(15), f"ranks took {elapsed:.1f}s to stop"
