"""The V-shaped schedules zb-v and dualpipe-v through the engine and launch/train.py's loop.

1. Loss trajectories: 4 fp32 steps of the tiny reference GPT (tied embedding) through the
   loop launch/train.py runs (engine.initialize + engine.training.trainer.train) at
   (dp, tp, pp) = (1,1,2) (plain, activation checkpointing), (2,1,2) x ZeRO 1/2/3,
   (1,2,2) with sequence parallelism, (1,1,4), and on 8 ranks (2,1,4) ZeRO-3 and (1,2,4)
   ZeRO-1, against one process (1,1,1): within 1e-5 relative (the issue's bound; measured
   equal to the last bit or one ulp: V placement keeps the tied embedding and head one
   parameter on rank 0, as in one process). With an untied embedding, zb-v's losses equal
   1F1B's BIT FOR BIT at pp 2: the same micro-batch sums in the same order (each W
   accumulates its micro-batch's weight gradient in micro-batch order).
   dualpipe-v the same way at (1,1,2) (tied, and untied: bit for bit), (2,1,2) ZeRO-3,
   (1,2,2) ZeRO-2, (1,1,4) and (1,2,4) ZeRO-1 (micro-batches of 1 where it needs 2p of them).
   Then eval_batch (forward-only walk in V placement) and the weights gathered into one
   dense model on rank 0 give the same eval loss.
2. launch/train.py under torchrun with zb-v at pp 2: the per-step losses of one process,
   and a checkpoint it saves loads at 1F1B (the loop placement) and trains on.
3. Checkpoints between placements (in-process, 4 ranks): zb-v (2,1,2) ZeRO-1 saved after 2
   steps loads into 1F1B (2,1,2) ZeRO-2, interleaved 1F1B (2,1,2) v2 ZeRO-1 and (4,1,1)
   ZeRO-3, and a 1F1B save loads back into zb-v ZeRO-3: the fp32 master weights and Adam
   moments saved again right after each load are bit-identical to the saved ones, and the
   next 3 losses equal the uninterrupted zb-v run's within 2e-6 (the layouts' summation
   order; tests/distributed/test_checkpoint_layouts.py states why).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig

import _ckpt_common as C
import pytest
import torch
from harness import run_ranks
from test_train_entry import _trajectories

from engine.distributed.spawn import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(ROOT, "launch", "train.py")
STEPS = 4
RTOL = 1e-5
STD = sysconfig.get_paths()["stdlib"]


def tiny_config(cache_dir: str, dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, schedule: str = "zb-v", *,
                sp: bool = False, ckpt: int = 0, micro: int = 2, layers: int = 2, **model: bool) -> dict:
    """The tiny reference GPT with a global batch of 8 sequences (micro-batch 2; dualpipe-v needs
    2p micro-batches per replica, so some of its layouts take micro-batches of 1);
    ``tie=False``: untied embedding."""
    tie = model.get("tie", True)
    v = 2 if schedule in ("zb-v", "dualpipe-v", "interleaved-1f1b") and pp > 1 else 1
    return {
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": micro, "seed": 7, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "torch_adam": True}},
        "scheduler": {"type": "cosine", "params": {"warmup_num_steps": 2, "total_num_steps": 8}},
        "zero_optimization": {"stage": zero, "reduce_bucket_size": 5000},
        "tensor_parallel": {"autotp_size": tp, "sequence_parallel": sp},
        "pipeline": {"stages": pp, "partition": "uniform", "schedule": schedule if pp > 1 else "1f1b",
                     "virtual_stages": v, "activation_checkpoint_interval": ckpt},
        "model": {"vocab_size": 256, "hidden_size": 32, "num_layers": layers, "num_heads": 4, "seq_len": 16,
                  "tie_embeddings": tie},
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


@pytest.fixture(scope="module")
def reference(cache_dir):
    """One process: the 2-layer model (tied and untied) and the 6-layer one (pp 4: 8 pieces)."""
    cfgs = [tiny_config(cache_dir), tiny_config(cache_dir, tie=False), tiny_config(cache_dir, layers=6)]
    two, untied, six = (r[0] for r in run_ranks(_trajectories, 1, cfgs, STEPS, timeout=120)[0])
    return {"two": two, "untied": untied, "six": six}


def _check(world, layouts, cache_dir, reference):
    per_rank = run_ranks(_trajectories, world, [tiny_config(cache_dir, **k) for k in layouts], STEPS,
                         timeout=400)
    for r in per_rank[1:]:  # every rank reports the same (global-batch) loss
        assert [x[0] for x in r] == [x[0] for x in per_rank[0]]
    runs = {}
    for k, (losses, dense_loss) in zip(layouts, per_rank[0]):
        ref = reference["six" if k.get("layers") == 6 else "untied" if k.get("tie") is False else "two"]
        assert losses == pytest.approx(ref, rel=RTOL), f"{k}: {losses} vs one process {ref}"
        assert dense_loss == pytest.approx(losses[-1], rel=2e-6), f"{k}: gathered model"
        runs[json.dumps(k, sort_keys=True)] = losses
    return runs


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zb_v_trains_like_one_process_at_pp2(cache_dir, reference):
    layouts = [dict(pp=2), dict(pp=2, ckpt=1), dict(pp=2, tie=False), dict(pp=2, tie=False, schedule="1f1b"),
               dict(pp=2, schedule="dualpipe-v"), dict(pp=2, tie=False, schedule="dualpipe-v")]
    runs = _check(2, layouts, cache_dir, reference)
    untied = [runs[json.dumps(dict(pp=2, tie=False, **s), sort_keys=True)]
              for s in ({}, {"schedule": "1f1b"}, {"schedule": "dualpipe-v"})]
    assert untied[0] == untied[1] == untied[2], f"zb-v, 1F1B, dualpipe-v, bit for bit: {untied}"
    assert reference["two"][STEPS - 1] < reference["two"][0] - 0.01, f"the tiny model did not learn: {reference}"


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zb_v_with_dp_zero_tp_and_pp4(cache_dir, reference):
    _check(4, [dict(dp=2, pp=2, zero=1), dict(dp=2, pp=2, zero=2), dict(dp=2, pp=2, zero=3),
               dict(tp=2, pp=2, zero=1, sp=True), dict(pp=4, layers=6),
               dict(dp=2, pp=2, zero=3, micro=1, schedule="dualpipe-v"), dict(tp=2, pp=2, zero=2, schedule="dualpipe-v"),
               dict(pp=4, layers=6, micro=1, schedule="dualpipe-v")], cache_dir, reference)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zb_v_on_eight_ranks(cache_dir, reference):
    _check(8, [dict(dp=2, pp=4, zero=3, layers=6), dict(tp=2, pp=4, zero=1, layers=6, micro=1, schedule="dualpipe-v")],
           cache_dir, reference)


# ------------------------------------------------------------------ 2. launch/train.py
def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)  # the script must find the engine by itself
    return env


def _torchrun(tmp, cfg: dict, *extra: str) -> subprocess.CompletedProcess:
    path = tmp / f"cfg_{cfg['pipeline']['schedule']}.json"
    path.write_text(json.dumps(cfg))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), TRAIN, "--config", str(path), *extra],
                          cwd=str(tmp), env=_env(), capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_launch_train_runs_zb_v_and_its_checkpoint_loads_at_1f1b(tmp_path, cache_dir, reference):
    out, save = tmp_path / "out", tmp_path / "save"
    run = _torchrun(tmp_path, tiny_config(cache_dir, pp=2), "--steps", "2", "--output", str(out),
                    "--save", str(save), "--sample-tokens", "4")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in open(out / "metrics.jsonl")]
    assert losses == pytest.approx(reference["two"][:2], rel=RTOL)
    assert "sample (greedy):" in run.stdout
    # the zb-v checkpoint (V placement) goes on at 1F1B (loop placement)
    out2 = tmp_path / "out2"
    run = _torchrun(tmp_path, tiny_config(cache_dir, pp=2, schedule="1f1b"), "--steps", "4",
                    "--output", str(out2), "--load", str(save), "--sample-tokens", "0")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    resumed = [json.loads(line) for line in open(out2 / "metrics.jsonl")]
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == pytest.approx(reference["two"][2:STEPS], rel=RTOL)


# ------------------------------------------------------------------ 3. checkpoints between placements
BEFORE, AFTER = 2, 3
STATES = ("master", "exp_avg", "exp_avg_sq")


def _pipe(schedule: str, v: int) -> dict:
    return {"stages": 2, "partition": "uniform", "schedule": schedule, "virtual_stages": v}


ZBV = dict(dp=2, pp=2, zero=1, pipeline=_pipe("zb-v", 2))
TARGETS = {"1f1b_z2": dict(dp=2, pp=2, zero=2, pipeline=_pipe("1f1b", 1)),
           "inter_z1": dict(dp=2, pp=2, zero=1, pipeline=_pipe("interleaved-1f1b", 2)),
           "411_z3": dict(dp=4, zero=3)}


def _states(path: str) -> dict:
    """(parameter name, state) -> the full fp32 tensor of a checkpoint, whatever its layout."""
    from engine.checkpoint.reader import iter_full_params

    return {(name, s): t for name, _, states in iter_full_params(path, STATES) for s, t in states.items()}


def _move_between_placements(rank, world, root):
    from engine.checkpoint import load_checkpoint, save_checkpoint

    whole = C.train(C.build(C.config(**ZBV)), BEFORE + AFTER)
    eng = C.build(C.config(**ZBV))
    C.train(eng, BEFORE)
    save_checkpoint(eng, os.path.join(root, "zbv"), tag="s")
    eng.destroy()
    out = {"whole": whole}
    for name, layout in TARGETS.items():
        eng = C.build(C.config(**layout))
        load_checkpoint(eng, os.path.join(root, "zbv"))
        save_checkpoint(eng, os.path.join(root, name), tag="reloaded")
        out[name] = C.train(eng, AFTER)
        eng.destroy()
    # and back: the 1F1B copy into zb-v at ZeRO-3
    eng = C.build(C.config(**dict(ZBV, zero=3)))
    load_checkpoint(eng, os.path.join(root, "1f1b_z2"))
    save_checkpoint(eng, os.path.join(root, "back"), tag="reloaded")
    out["back"] = C.train(eng, AFTER)
    eng.destroy()
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoints_move_between_v_and_loop_placements(tmp_path):
    root = str(tmp_path)
    out = run_ranks(_move_between_placements, 4, root, timeout=500)[0]
    want = out["whole"][BEFORE:]
    saved = _states(os.path.join(root, "zbv", "s"))
    for name in (*TARGETS, "back"):
        assert out[name] == pytest.approx(want, rel=2e-6), f"{name}: {out[name]} vs uninterrupted zb-v {want}"
        again = _states(os.path.join(root, name, "reloaded"))
        assert again.keys() == saved.keys(), name
        for k in saved:
            assert torch.equal(again[k], saved[k]), f"{name}: {k} changed in the round trip"


# ------------------------------------------------------------------ 4. no accumulator written in flight
class _LazyReduceScatter:
    """An async reduce-scatter that snapshots its input at launch and runs (blocking, on the
    snapshot) at wait(): the slowest legal network. An input changed in between was written
    while its reduction was in flight (on a real backend, included or lost depending on timing)."""

    def __init__(self, real, out, inp, group, op, written: list):
        self.real, self.out, self.inp, self.group, self.op = real, out, inp, group, op
        self.snap, self.written, self.done = inp.clone(), written, False

    def wait(self) -> bool:
        if not self.done:
            if not torch.equal(self.inp, self.snap):
                self.written.append(tuple(self.inp.shape))
            self.real(self.out, self.snap, self.group, self.op, async_op=False, inp_is_scratch=True)
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


def _zero3_zb_v_writes_in_flight(rank, world):
    import torch.distributed as dist

    from engine.distributed import comm

    real, written = comm.reduce_scatter, []

    def lazy(out, inp, group, op=dist.ReduceOp.SUM, async_op=False, inp_is_scratch=False):
        if not async_op:
            return real(out, inp, group, op, async_op=False, inp_is_scratch=inp_is_scratch)
        return _LazyReduceScatter(real, out, inp, group, op, written)

    comm.reduce_scatter = lazy
    try:
        eng = C.build(C.config(**dict(ZBV, zero=3)))
        losses = C.train(eng, 2)
        eng.destroy()
    finally:
        comm.reduce_scatter = real
    return written, losses


@pytest.mark.timeout(300)
def test_zero3_under_zb_v_never_writes_a_gradient_bucket_in_flight():
    """zb-v's two chunks share ZeRO-3's small-parameter buckets, so a chunk's backward meets a
    bucket the other chunk's backward left incomplete and reduces it first: the new gradient
    must wait for that reduction (a regression test of the nondeterministic zb-v ZeRO-3 losses:
    the add went into the accumulator in flight)."""
    out = run_ranks(_zero3_zb_v_writes_in_flight, 4, timeout=240)
    for rank, (written, losses) in enumerate(out):
        assert written == [], f"rank {rank}: accumulators of shapes {written} written while reduced"
        assert all(torch.isfinite(torch.tensor(losses))), losses
