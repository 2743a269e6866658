"""Preemption and resume through the entry point (launch/train.py, 2 CPU ranks launched as
srun would, tiny reference GPT, fp32).

1. SIGTERM to rank 0 only, mid-training, with ``--save``: both ranks finish the current
   step, agree to stop, save ``global_stepK`` and exit 0.
2. ``--load`` with ``--steps K+2`` on the same 2 ranks trains exactly 2 more steps; the
   per-step losses of the interrupted and the resumed run together equal an uninterrupted
   run's BIT FOR BIT (data position and LR schedule included).
3. ``--load`` of that 2-rank checkpoint in ONE process (the world size changes, so the
   checkpoint is reshaped) continues the trajectory: its step K+1 loss equals the
   uninterrupted run's within rtol 2e-6 (only the order of the DP gradient sum differs;
   see test_checkpoint_layouts.py for the tolerance).
4. The signal handler itself, in-process: SIGUSR1 and SIGTERM are recorded, not fatal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time

import pytest
from harness import scaled

from engine.distributed.spawn import start_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(ROOT, "launch", "train.py")
STD = sysconfig.get_paths()["stdlib"]
RTOL = 2e-6


def _config(cache_dir: str) -> dict:
    return {
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "seed": 5, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "torch_adam": True}},
        "scheduler": {"type": "cosine", "params": {"warmup_num_steps": 2, "total_num_steps": 20}},
        "zero_optimization": {"stage": 1},
        "model": {"vocab_size": 256, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "seq_len": 16},
        "data": {"train_files": [os.path.join(STD, "textwrap.py")], "cache_dir": cache_dir},
    }


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    from engine.config import load_config
    from engine.training.trainer import build_data

    d = tmp_path_factory.mktemp("preempt")
    cfg = _config(str(d / "cache"))
    build_data(load_config(cfg, world_size=1))  # tokenizer and tokens once, here
    path = d / "cfg.json"
    path.write_text(json.dumps(cfg))
    return str(path)



def _launch(world: int, args: list[str], cwd: str) -> list[subprocess.Popen]:
    base = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    base.pop("PYTHONPATH", None)
    return start_script([sys.executable, TRAIN, *args, "--sample-tokens", "0"], world, env=base, cwd=cwd,
                        job_id="7")


def _finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=scaled(timeout))
        finally:
            if p.poll() is None:
                p.kill()
        out.append((p.returncode, o + e))
    return out


def _losses(output: str, first_step: int = 1) -> list[float]:
    with open(os.path.join(output, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    assert [r["step"] for r in recs] == list(range(first_step, first_step + len(recs)))
    return [r["loss"] for r in recs]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_saves_exits_zero_and_the_resumed_run_matches(tmp_path, config_path):
    from engine.checkpoint import read_latest

    run, ref, one, ckpt, ckpt2 = (str(tmp_path / n) for n in ("run", "ref", "one", "ckpt", "ckpt2"))
    cwd = str(tmp_path)
    # the interrupted run and an uninterrupted reference, side by side
    victim = _launch(2, ["--config", config_path, "--steps", "100000", "--output", run, "--save", ckpt], cwd)
    reference = _launch(2, ["--config", config_path, "--steps", "8", "--output", ref], cwd)
    try:
        deadline = time.monotonic() + scaled(240)
        metrics = os.path.join(run, "metrics.jsonl")
        while not (os.path.exists(metrics) and open(metrics).read().count("\n") >= 2):
            assert all(p.poll() is None for p in victim), _finish(victim, 5)
            assert time.monotonic() < deadline, "the run never took 2 steps"
            time.sleep(0.05)
        victim[0].send_signal(signal.SIGTERM)  # rank 0 only: the ranks must agree to stop
        results = _finish(victim)
    finally:
        for p in victim:
            if p.poll() is None:
                p.kill()
    for rc, log in results:
        assert rc == 0, log[-3000:]
    k = len(_losses(run))
    assert 2 <= k <= 6, k
    assert f"preempted at step {k}" in results[0][1]
    assert read_latest(ckpt) == f"global_step{k}"

    resumed = _launch(2, ["--config", config_path, "--steps", str(k + 2), "--output", run, "--load", ckpt,
                          "--save", ckpt2], cwd)
    reshaped = _launch(1, ["--config", config_path, "--steps", str(k + 1), "--output", one, "--load", ckpt], cwd)
    for rc, log in _finish(resumed) + _finish(reshaped) + _finish(reference):
        assert rc == 0, log[-3000:]
    full = _losses(ref)
    assert _losses(run) == full[:k + 2]  # interrupted + resumed == uninterrupted, bit for bit
    assert read_latest(ckpt2) == f"global_step{k + 2}"  # saved at the end
    one_losses = _losses(one, first_step=k + 1)
    assert len(one_losses) == 1 and one_losses[0] == pytest.approx(full[k], rel=RTOL)


def test_preemption_handler_records_signals_instead_of_dying():
    import torch

    from engine.checkpoint.preempt import PreemptionHandler

    for sig in (signal.SIGUSR1, signal.SIGTERM):
        before = signal.getsignal(sig)
        with PreemptionHandler() as h:
            assert not h.stop_requested(torch.device("cpu"))
            os.kill(os.getpid(), sig)
            time.sleep(0.05)
            assert h.received == sig and h.stop_requested(torch.device("cpu"))
        assert signal.getsignal(sig) is before
