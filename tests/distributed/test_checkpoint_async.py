"""Asynchronous checkpoints (``checkpoint.async_save``; engine/checkpoint/async_save.py), on
the tiny reference GPT in fp32 on CPU.

1. Exact resume at DP 2 / ZeRO-3, PP 2, Muon (DP 2 / ZeRO-1) and bf16 + FP8 delayed scaling
   at TP 2 (the scaling state is in the snapshot): train 2 steps, save
   asynchronously, train 3 more at once while it is written, wait; the losses are the
   uninterrupted run's, and a fresh engine loading the checkpoint continues with the
   uninterrupted run's 3 losses BIT FOR BIT.
2. The checkpoint is the state at the call: the writer is held until every master weight
   and moment has been changed in place and one more step taken; the checkpoint equals,
   parameter by parameter and bit for bit, a synchronous one taken at the call.
3. SIGKILL at 9 moments while the background write of step 3 runs (from its start to after
   its commit) with training going on: ``latest`` always names a complete checkpoint
   (step 2 before the commit, step 3 after) that loads with exactly its saved weights.
4. A background write that fails on one rank (ENOSPC) stops the loop at the next step
   boundary with a CheckpointError naming rank 1 and the error, on both ranks; ``latest``
   still names the previous checkpoint, which loads; nothing is left behind; the next save
   works.
5. The Checkpointer: on preemption it waits for the save in flight, saves, waits again (the
   checkpoint is published when ``after_step`` returns True); ``step_metrics`` carries
   ``save_blocked_s`` on the steps that saved and ``save_write_s`` when a write is committed.
6. launch/train.py with ``async_save`` and ``save_interval`` 2: the rows of the steps that
   saved carry ``save_blocked_s``, a later row ``save_write_s``; the end of the run waits for
   its save; resuming gives the uninterrupted (synchronous-save) run's losses bit for bit.
"""

from __future__ import annotations

import os
import signal
import time

import _ckpt_common as C
import _muon_common as M
import pytest
import torch
from harness import run_ranks, scaled, start_method
from test_checkpoint_preemption import config_path  # noqa: F401 - the fixture (tokenized data once)

from engine.distributed.spawn import process_context

HERE = os.path.dirname(os.path.abspath(__file__))
STATES = ("master", "exp_avg", "exp_avg_sq")
ASYNC = {"async_save": True}
FP8 = {"enabled": True, "recipe": "delayed", "amax_history_len": 4}
LAYOUTS = {"dp2_z3": (C, dict(dp=2, zero=3, micro=1)), "pp2": (C, dict(pp=2)), "muon_dp2_z1": (M, dict(dp=2, zero=1)),
           "fp8_tp2": (C, dict(tp=2, layers=2, bf16={"enabled": True}, fp8=FP8))}


def _full_states(path, states=STATES):
    from engine.checkpoint import iter_full_params

    return {name: st for name, _, st in iter_full_params(path, states)}


def _resume(rank, world, root):
    from engine.checkpoint import load_checkpoint

    out = {}
    for name, (mod, layout) in LAYOUTS.items():
        cfg = mod.config(**layout, checkpoint=ASYNC)
        full = mod.train(mod.build(cfg), 5)
        eng = mod.build(cfg)
        first = mod.train(eng, 2)
        path = eng.save_checkpoint(os.path.join(root, name))
        during = mod.train(eng, 3)  # the state changes while the write runs
        published = eng.wait_for_checkpoint()
        again = mod.build(cfg)
        loaded, _ = load_checkpoint(again, os.path.join(root, name))
        out[name] = dict(full=full, trained=first + during, resumed=mod.train(again, 3), path=path,
                         published=published, loaded=loaded, steps=again.global_steps - 3)
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_async_resume_is_bit_identical_at_zero3_pp2_muon_and_fp8(tmp_path):
    res = run_ranks(_resume, 2, str(tmp_path), timeout=380)
    for r in res:
        for name, o in r.items():
            assert o["trained"] == o["full"], name  # saving does not disturb training
            assert o["resumed"] == o["full"][2:], name  # bit for bit
            assert o["path"] == o["published"] == o["loaded"] == str(tmp_path / name / "global_step2"), name
            assert o["steps"] == 2


def _mutate(rank, world, root):
    import threading

    import engine.checkpoint.async_save as A
    from engine.checkpoint import save_checkpoint

    eng = C.build(C.config(layers=2, checkpoint=ASYNC))
    C.train(eng, 2)
    save_checkpoint(eng, os.path.join(root, "sync"))  # the reference: the state at the call
    gate, real = threading.Event(), A.write_shard

    def held_write(*args):
        assert gate.wait(60), "the test never released the writer"
        return real(*args)
    A.write_shard = held_write
    eng.save_checkpoint(os.path.join(root, "async"))
    view = eng.optimizer.shard_view()
    for gi in range(len(view.groups)):  # every saved tensor changes under the held writer
        st = view.group_state(gi)
        st.master.add_(1.0)
        for v in st.elementwise.values():
            v.mul_(3.0).add_(0.5)
    C.train(eng, 1)
    gate.set()
    eng.wait_for_checkpoint()
    return eng.global_steps


def test_the_checkpoint_is_the_state_at_the_call_although_training_changes_it(tmp_path):
    from engine.checkpoint import read_metadata

    assert run_ranks(_mutate, 1, str(tmp_path), timeout=120) == [3]
    ref, got = (str(tmp_path / d / "global_step2") for d in ("sync", "async"))
    a, b = _full_states(ref), _full_states(got)
    assert list(a) == list(b)
    for name in a:
        for s in STATES:
            assert torch.equal(a[name][s], b[name][s]), (name, s)
    ma, mb = read_metadata(ref), read_metadata(got)
    for k in ("counters", "optimizer", "lr_scheduler", "loss_scaler", "rng"):
        assert ma[k] == mb[k], k


def _wait_for(p, marker: str, deadline: float) -> None:
    while not os.path.exists(marker):
        if p.exitcode is not None:
            with open(marker.rsplit(".", 1)[0] + ".log", errors="replace") as f:
                raise AssertionError(f"{marker}: the child exited with {p.exitcode}: {f.read()[-3000:]}")
        assert time.monotonic() < deadline, f"the child never reached {marker}"
        time.sleep(0.005)


def _kill_child(save_dir: str) -> None:
    """One child of _kill_points, its output in SAVE_DIR.log."""
    import _ckpt_async_kill_child

    fd = os.open(save_dir + ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    _ckpt_async_kill_child.main(save_dir)


def _kill_points(root: str, delays: list[float]) -> list[dict]:
    """One child per delay: SIGKILL ``delay`` s after its asynchronous save started (None:
    once it has committed). The children are forked from the harness's fork server (torch and
    the engine imported once), not fresh interpreters: a SIGKILL ends either the same way."""
    ctx = process_context(start_method() or "forkserver")
    procs = []
    for i, _ in enumerate(delays):
        procs.append(ctx.Process(target=_kill_child, args=(os.path.join(root, f"k{i}"),), daemon=True))
        procs[-1].start()
    out, deadline = [], time.monotonic() + scaled(300)
    try:
        for i, (p, delay) in enumerate(zip(procs, delays)):
            d = os.path.join(root, f"k{i}")
            _wait_for(p, d + ".ready", deadline)
            open(d + ".go", "w").close()
            _wait_for(p, d + (".committed" if delay is None else ".started"), deadline)
            time.sleep(delay or 0.0)
            os.kill(p.pid, signal.SIGKILL)
            p.join(scaled(30))
            assert p.exitcode == -signal.SIGKILL, p.exitcode
            out.append(dict(dir=d, committed=os.path.exists(d + ".committed")))
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join()
    return out


def _load_killed(rank, world, dirs):
    from engine.checkpoint import load_checkpoint, read_latest

    res = []
    for d in dirs:
        eng = C.build(C.config(layers=2))
        latest = read_latest(d)
        load_checkpoint(eng, d)
        ref = torch.load(f"{d}.ref{eng.global_steps}.pt", weights_only=True)
        got = C.dense_state(eng)
        res.append(dict(latest=latest, steps=eng.global_steps, same=all(torch.equal(got[k], ref[k]) for k in ref)))
    return res


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_at_any_moment_of_a_background_write_leaves_latest_loadable(tmp_path):
    delays = [0.0, 0.05, 0.15, 0.3, 0.5, 0.7, 1.0, 1.5, None]
    killed = _kill_points(str(tmp_path), delays)
    loaded = run_ranks(_load_killed, 1, [k["dir"] for k in killed], timeout=300)[0]
    for k, got in zip(killed, loaded):
        assert got["same"], (k, got)
        # before the commit the previous checkpoint; a commit seen by the child is durable
        assert got["latest"] == f"global_step{got['steps']}", got
        assert got["steps"] == 3 if k["committed"] else got["steps"] in (2, 3), (k, got)
    # both sides of the commit were hit, most kills inside the write
    assert sum(not k["committed"] for k in killed) >= 4 and killed[-1]["committed"], killed


def _fail(rank, world, root):
    import errno

    import engine.checkpoint.async_save as A
    from engine.checkpoint import CheckpointError, load_checkpoint, read_latest
    from engine.checkpoint.preempt import Checkpointer

    d = os.path.join(root, "ck")
    eng = C.build(C.config(dp=2, layers=2, checkpoint=ASYNC))
    real = A.write_shard
    with Checkpointer(eng, d, interval=2, saver=eng.checkpoint_saver()) as ckpt:
        error, failed_at = None, None
        for _ in range(6):
            C.train(eng, 1)
            if eng.global_steps == 4 and rank == 1:  # the save of step 4 fails on rank 1 only
                def full(*args):
                    raise OSError(errno.ENOSPC, "No space left on device")
                A.write_shard = full
            try:
                ckpt.after_step()
            except CheckpointError as exc:
                error, failed_at = str(exc), eng.global_steps
                break
            finally:
                A.write_shard = real
        leftovers = sorted(os.listdir(d))
        latest_after_failure = read_latest(d)
        ckpt.save()  # nothing is lost: the next save works
        final = ckpt.finish()
    again = C.build(C.config(dp=2, layers=2))
    load_checkpoint(again, d, "global_step2")
    return dict(error=error, failed_at=failed_at, leftovers=leftovers, latest=latest_after_failure, final=final,
                final_latest=read_latest(d), loaded_steps=again.global_steps)


def test_a_failed_background_write_stops_the_run_on_every_rank_and_loses_nothing(tmp_path):
    res = run_ranks(_fail, 2, str(tmp_path), timeout=200)
    for r in res:
        assert r["failed_at"] in (5, 6), r  # at the next step boundary (or the one after, if a writer was slow)
        assert "global_step4" in r["error"] and "rank 1: OSError" in r["error"], r["error"]
        assert "No space left on device" in r["error"] and "nothing was published" in r["error"]
        assert r["latest"] == "global_step2"
        assert r["leftovers"] == [".lock", "global_step2", "latest"] or r["leftovers"] == ["global_step2", "latest"]
        assert r["final"] == str(tmp_path / "ck" / f"global_step{r['failed_at']}")
        assert r["final_latest"] == f"global_step{r['failed_at']}"
        assert r["loaded_steps"] == 2
    assert res[0]["error"] == res[1]["error"]


def _preempt(rank, world, root):
    from engine.checkpoint import read_latest
    from engine.checkpoint.preempt import Checkpointer

    d = os.path.join(root, "ck")
    eng = C.build(C.config(layers=2, checkpoint=ASYNC))
    metrics = []
    with Checkpointer(eng, d, interval=1, saver=eng.checkpoint_saver()) as ckpt:
        for _ in range(3):
            C.train(eng, 1)
            if eng.global_steps == 3:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
            stop = ckpt.after_step()
            metrics.append(dict(ckpt.step_metrics))
        latest = read_latest(d)
        pending = ckpt.saver.pending
        final = ckpt.finish()
    return dict(stop=stop, latest=latest, pending=pending, final=final, metrics=metrics)


def test_preemption_waits_for_the_save_in_flight_and_publishes_before_stopping(tmp_path):
    r = run_ranks(_preempt, 1, str(tmp_path), timeout=120)[0]
    assert r["stop"] and r["latest"] == "global_step3" and not r["pending"]
    assert r["final"] == str(tmp_path / "ck" / "global_step3")
    assert all("save_blocked_s" in m for m in r["metrics"]), r["metrics"]  # every step saved
    assert "save_write_s" in r["metrics"][2]  # the preemption save is committed before stopping


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_entry_point_async_saves_report_blocked_time_and_resume_bit_for_bit(tmp_path, config_path):  # noqa: F811
    import json

    from test_checkpoint_preemption import _finish, _launch, _losses

    from engine.checkpoint import read_latest

    cfg = json.load(open(config_path))
    cfg["checkpoint"] = {"async_save": True, "save_interval": 2}
    async_cfg = str(tmp_path / "async.json")
    json.dump(cfg, open(async_cfg, "w"))
    run, ref, ckpt = (str(tmp_path / n) for n in ("run", "ref", "ckpt"))
    cwd = str(tmp_path)
    first = _launch(2, ["--config", async_cfg, "--steps", "5", "--output", run, "--save", ckpt], cwd)
    reference = _launch(2, ["--config", config_path, "--steps", "7", "--output", ref], cwd)
    for rc, log in _finish(first) + _finish(reference):
        assert rc == 0, log[-3000:]
    assert read_latest(ckpt) == "global_step5"  # the end of the run waited for its save
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert [("save_blocked_s" in r) for r in rows] == [False, True, False, True, False]
    assert all(r["save_blocked_s"] >= 0 for r in rows if "save_blocked_s" in r)
    assert any("save_write_s" in r for r in rows[2:])  # the write of step 2 committed at a later step
    resumed = _launch(2, ["--config", async_cfg, "--steps", "7", "--output", run, "--load", ckpt, "--save", ckpt],
                      cwd)
    for rc, log in _finish(resumed):
        assert rc == 0, log[-3000:]
    assert _losses(run) == _losses(ref)  # async saves + resume == uninterrupted, bit for bit
    assert read_latest(ckpt) == "global_step7"
