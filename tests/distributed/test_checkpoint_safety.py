"""Checkpoint atomicity and safe loading (tiny reference GPT, one process, fp32, CPU).

1. SIGKILL in the middle of a save (three moments: half-way through the shard file,
   after the metadata but before the directory is published, and after publishing but
   before ``latest`` is replaced): ``latest`` still names the previous checkpoint, which
   loads and gives exactly the weights it was saved with; the next save succeeds and
   removes the leftovers.
2. Corrupted, truncated or missing shard files, edited or truncated metadata, a dangling
   ``latest``, a checkpoint of another model, a client state that would need code to load
   (refused at save) or that was replaced by a pickle carrying code (refused at load, even
   with a re-sealed metadata file): each is a CheckpointError naming the file and what is
   wrong, and a failed load leaves the engine's weights untouched.
3. ``keep_last`` prunes old ``global_step*`` tags after publishing; saving over an existing
   tag replaces it; a directory without ``latest`` loads nothing; the entry point's
   Checkpointer saves every ``checkpoint.save_interval`` steps and once more at the end.
4. Any nn.Module under the DeepSpeed loop (no stage chunks: the module's own parameter
   names) saves at ZeRO-1 and loads at ZeRO-3 with the exact state; the next step's loss
   agrees to rtol 1e-6 (same arithmetic, another bucketing: the gradient norm is summed in
   another order).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import _ckpt_common as C
import pytest
import torch
from harness import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
PHASES = ("shard", "metadata", "latest")


def _kill_mid_save(root: str) -> dict:
    """Start one child per phase, SIGKILL each once it blocks inside the save."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = {}
    for phase in PHASES:
        d = os.path.join(root, f"killed_{phase}")
        procs[phase] = subprocess.Popen([sys.executable, os.path.join(HERE, "_ckpt_kill_child.py"), d, phase,
                                         d + ".marker"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    try:
        for phase, p in procs.items():
            marker = os.path.join(root, f"killed_{phase}.marker")
            while not os.path.exists(marker):
                if p.poll() is not None:
                    out = p.stdout.read().decode()[-3000:]
                    raise AssertionError(f"{phase} child exited with {p.returncode}: {out}")
                assert time.monotonic() < deadline, f"{phase}: the child never reached the save"
                time.sleep(0.1)
            time.sleep(0.2)
            p.send_signal(signal.SIGKILL)
            assert p.wait(30) == -signal.SIGKILL
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return {phase: sorted(os.listdir(os.path.join(root, f"killed_{phase}"))) for phase in PHASES}


def _expect_error(fn) -> str:
    from engine.checkpoint import CheckpointError

    try:
        fn()
    except CheckpointError as exc:
        return str(exc)
    raise AssertionError("no CheckpointError")


def _corrupt_variants(root: str, good: str, ckpt: str) -> dict:
    """Copies of a good save directory, each broken in one way; returns {variant: dir}."""
    from engine.checkpoint.format import read_metadata, seal_metadata

    shard = next(f for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    out = {}

    def variant(name, edit):
        d = os.path.join(root, name)
        shutil.copytree(good, d)
        edit(os.path.join(d, os.path.basename(ckpt)))
        out[name] = d

    def flip(c):
        p = os.path.join(c, shard)
        with open(p, "r+b") as f:
            f.seek(os.path.getsize(p) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x40]))

    def truncate(c):
        p = os.path.join(c, shard)
        os.truncate(p, os.path.getsize(p) // 2)

    def edit_metadata(c):
        p = os.path.join(c, "metadata.json")
        meta = json.load(open(p))
        meta["counters"]["global_steps"] += 1
        json.dump(meta, open(p, "w"))

    def truncate_metadata(c):
        p = os.path.join(c, "metadata.json")
        os.truncate(p, os.path.getsize(p) // 3)

    def evil_client_state(c):
        """A pickle that runs code when unpickled, with the metadata re-sealed to match."""
        class Evil:
            def __reduce__(self):
                return (os.system, ("touch " + os.path.join(root, "pwned"),))
        p = os.path.join(c, "client_state.pt")
        torch.save({"x": Evil()}, p)
        meta = read_metadata(c)
        import hashlib
        meta["files"]["client_state.pt"].update(sha256=hashlib.sha256(open(p, "rb").read()).hexdigest(),
                                                bytes=os.path.getsize(p))
        json.dump(seal_metadata(meta), open(os.path.join(c, "metadata.json"), "w"))

    variant("flipped", flip)
    variant("truncated", truncate)
    variant("missing", lambda c: os.remove(os.path.join(c, shard)))
    variant("metadata_edited", edit_metadata)
    variant("metadata_truncated", truncate_metadata)
    variant("evil_client_state", evil_client_state)
    variant("dangling_latest", lambda c: open(os.path.join(os.path.dirname(c), "latest"), "w").write("global_step9"))
    return out, shard


def _module_engine(stage):
    import engine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))
    cfg = {"train_batch_size": 4, "gradient_accumulation_steps": 1, "seed": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 40, "stage3_param_persistence_threshold": 12},
           "model": {"vocab_size": 8, "hidden_size": 8, "num_layers": 1, "num_heads": 2, "seq_len": 4}}
    eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return eng


def _module_steps(eng, n):
    losses = []
    for _ in range(n):
        g = torch.Generator().manual_seed(eng.global_steps)
        x, y = torch.randn(4, 7, generator=g), torch.randn(4, 5, generator=g)
        loss = torch.nn.functional.mse_loss(eng(x), y)
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    return losses


def _modules(root):
    from engine.checkpoint import save_checkpoint

    a = _module_engine(1)
    _module_steps(a, 2)
    a.save_checkpoint(os.path.join(root, "module_z1"))  # the Engine methods, as DeepSpeed names them
    b = _module_engine(3)
    path, client = b.load_checkpoint(os.path.join(root, "module_z1"))
    assert path.endswith("global_step2") and client is None
    save_checkpoint(b, os.path.join(root, "module_z3"))
    return dict(a=_module_steps(a, 1), b=_module_steps(b, 1), steps=b.global_steps)


def _safety(rank, world, root):
    from engine.checkpoint import load_checkpoint, read_latest, save_checkpoint

    cfg = C.config(layers=2)
    res = {"killed": {}}
    # 1. every killed save directory still loads its previous checkpoint, then saves again cleanly
    for phase in PHASES:
        d = os.path.join(root, f"killed_{phase}")
        eng = C.build(cfg)
        path, _ = load_checkpoint(eng, d)
        ref = torch.load(d + ".marker.ref.pt", weights_only=True)
        got = C.dense_state(eng)
        same = all(torch.equal(got[k], ref[k]) for k in ref)
        save_checkpoint(eng, d)
        res["killed"][phase] = dict(path=path, steps=eng.global_steps, same=same, latest=read_latest(d),
                                    after=sorted(os.listdir(d)))
    # 2. a good checkpoint and broken copies of it
    eng = C.build(cfg)
    C.train(eng, 1)
    good = os.path.join(root, "good")
    ckpt = save_checkpoint(eng, good, client_state={"epoch": 1})
    variants, shard = _corrupt_variants(root, good, ckpt)
    fresh = C.build(cfg)
    before = C.dense_state(fresh)
    res["errors"] = {name: _expect_error(lambda d=d: load_checkpoint(fresh, d)) for name, d in variants.items()}
    after = C.dense_state(fresh)
    res["untouched"] = all(torch.equal(before[k], after[k]) for k in before) and fresh.global_steps == 0
    res["shard"], res["ckpt"] = shard, ckpt
    res["wider"] = _expect_error(lambda: load_checkpoint(C.build(C.config(layers=2, model=dict(
        C.config()["model"], hidden_size=64, num_layers=2))), good))
    res["shallower"] = _expect_error(lambda: load_checkpoint(C.build(C.config(layers=1)), good))
    res["unsafe_client"] = _expect_error(lambda: save_checkpoint(eng, good, tag="code",
                                                                 client_state={"m": torch.nn.Linear(2, 2)}))
    res["unsafe_client_published"] = os.path.exists(os.path.join(good, "code")) or read_latest(good) != "global_step1"
    # 3. keep_last, overwriting a tag, nothing to load
    kept = os.path.join(root, "kept")
    for _ in range(4):
        C.train(eng, 1)
        save_checkpoint(eng, kept, keep_last=2)
    save_checkpoint(eng, kept, tag="custom", keep_last=2)
    res["kept"] = sorted(os.listdir(kept))
    save_checkpoint(eng, kept, tag="custom")  # overwrite an existing tag
    res["overwritten"] = sorted(os.listdir(kept))
    res["nothing"] = load_checkpoint(C.build(cfg), os.path.join(root, "empty"))
    res["module"] = _modules(root)
    res["interval"] = _interval(root)
    return res


def _interval(root):
    """The entry point's Checkpointer: every save_interval steps, keep_last, one final save."""
    from engine.checkpoint.preempt import Checkpointer

    d = os.path.join(root, "interval")
    eng = C.build(C.config(layers=2, checkpoint={"save_interval": 2, "keep_last": 2}))
    with Checkpointer(eng, d, eng.config.checkpoint.save_interval) as ck:
        calls, real = [], ck.save
        ck.save = lambda: calls.append(eng.global_steps) or real()
        stops = []
        for _ in range(4):
            C.train(eng, 1)
            stops.append(ck.after_step())
        listing = sorted(os.listdir(d))
        ck.finish()  # step 4 was just saved: not again
        C.train(eng, 1)
        stops.append(ck.after_step())
        ck.finish()
    return dict(calls=calls, stops=stops, listing=listing, final=sorted(os.listdir(d)))


@pytest.fixture(scope="module")
def safety(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt_safety"))
    listing = _kill_mid_save(root)
    return root, listing, run_ranks(_safety, 1, root, timeout=300)[0]


@pytest.mark.timeout(600)
def test_sigkill_during_a_save_leaves_latest_loadable(safety):
    root, listing, res = safety
    assert any(n.startswith(".tmp-global_step3") for n in listing["shard"]), listing["shard"]
    assert any(n.startswith(".tmp-global_step3") for n in listing["metadata"]), listing["metadata"]
    assert "global_step3" in listing["latest"]  # published, but latest not yet switched
    for phase in PHASES:
        r = res["killed"][phase]
        assert r["path"].endswith(os.path.join(f"killed_{phase}", "global_step2")), (phase, r)
        assert r["steps"] == 2 and r["same"], (phase, r)
        # the next save publishes and clears what the killed one left behind
        assert r["latest"] == "global_step2"  # saved again at the loaded step
        assert not [n for n in r["after"] if n.startswith(".") or ".tmp-" in n], r["after"]


@pytest.mark.timeout(600)
def test_broken_checkpoints_are_rejected_naming_the_file(safety):
    root, _, res = safety
    e, shard = res["errors"], res["shard"]
    assert shard in e["flipped"] and "checksum mismatch" in e["flipped"]
    assert shard in e["truncated"] and "truncated" in e["truncated"]
    assert shard in e["missing"] and "missing" in e["missing"]
    assert "metadata.json" in e["metadata_edited"] and "checksum mismatch" in e["metadata_edited"]
    assert "metadata.json" in e["metadata_truncated"] and "not valid JSON" in e["metadata_truncated"]
    assert "client_state.pt" in e["evil_client_state"] and "weights_only" in e["evil_client_state"]
    assert not os.path.exists(os.path.join(root, "pwned"))
    assert "global_step9" in e["dangling_latest"] and "does not exist" in e["dangling_latest"]
    assert res["untouched"]
    assert "layers.0.weight" in res["wider"] and "[128, 32]" in res["wider"] and "[128, 64]" in res["wider"]
    assert "model.hidden_size: checkpoint 32, this run 64" in res["wider"]
    assert "layers.2.norm.weight" in res["shallower"] and "different model" in res["shallower"]
    assert "model.num_layers: checkpoint 2, this run 1" in res["shallower"]
    assert "weights_only" in res["unsafe_client"] or "plain Python values" in res["unsafe_client"]
    assert not res["unsafe_client_published"]


@pytest.mark.timeout(600)
def test_keep_last_overwrite_interval_saves_and_empty_directory(safety):
    _, _, res = safety
    assert res["kept"] == ["custom", "global_step4", "global_step5", "latest"], res["kept"]
    assert res["overwritten"] == ["custom", "global_step4", "global_step5", "latest"], res["overwritten"]
    assert res["nothing"] == (None, None)
    iv = res["interval"]
    assert iv["calls"] == [2, 4, 5] and not any(iv["stops"])
    assert iv["listing"] == ["global_step2", "global_step4", "latest"]
    assert iv["final"] == ["global_step4", "global_step5", "latest"]


@pytest.mark.timeout(600)
def test_a_plain_module_engine_round_trips_across_zero_stages(safety):
    from engine.checkpoint import iter_full_params

    root, _, res = safety
    states = ("master", "exp_avg", "exp_avg_sq")
    z1 = list(iter_full_params(os.path.join(root, "module_z1", "global_step2"), states))
    z3 = list(iter_full_params(os.path.join(root, "module_z3", "global_step2"), states))
    assert [n for n, _, _ in z1] == ["0.weight", "0.bias", "2.weight", "2.bias"] == [n for n, _, _ in z3]
    for (_, _, s1), (_, _, s3) in zip(z1, z3):
        assert all(torch.equal(s1[k], s3[k]) for k in states)
    m = res["module"]
    assert m["steps"] == 3 and m["b"] == pytest.approx(m["a"], rel=1e-6)
