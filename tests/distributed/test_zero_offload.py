"""ZeRO-Offload (zero_optimization.offload_optimizer / offload_param) through the training
entry point's loop (engine.initialize + engine.training.trainer.train, what launch/train.py
runs) on 2 gloo ranks, and launch/train.py itself under torchrun.

1. fp32, DP 2: offload_optimizer at ZeRO 1, 2, 3 and offload_optimizer + offload_param at 3
   give the losses of the same layout without offload (rtol 1e-6; in fact bit-equal: the
   same fused CPU kernel on the same values) and of one process (rtol 1e-4).
2. bf16: the step's fp32 masters and bf16 parameters equal the step without offload bit for
   bit (the kernel writes the bf16 copy in the same pass; the device path rounds the master
   with torch: both round to nearest even).
3. Resume across offload / no offload is bit-exact (same layout, both ways), and an
   offloaded checkpoint loads into another stage (ZeRO-1 offload -> ZeRO-3 without) within
   the layout tolerance.

Tolerances: 1e-6 relative for the same layout with/without offload (the issue's bound; the
arithmetic is identical, so any real error, e.g. a gradient shard copied before its
reduction completed, a stale low-precision copy published, or clipping skipped on the host
copy, moves the loss by > 1e-4 from step 2). One process: 1e-4 relative (DP sums gradients
in another order; measured ~1e-7 over these steps). On a CPU-only machine the "device" is
the CPU: the offloaded path still keeps separate host buffers, copies and steps there
(checked below), it only cannot show device memory leaving.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig

import pytest
from harness import run_ranks

from engine.distributed.spawn import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(ROOT, "launch", "train.py")
STD = sysconfig.get_paths()["stdlib"]
STEPS = 6
SAME_LAYOUT_RTOL = 1e-6
ONE_PROCESS_RTOL = 1e-4


def config(cache_dir: str, zero: int = 0, offload: bool = False, param: bool = False, bf16: bool = False,
           steps: int = STEPS) -> dict:
    z: dict = {"stage": zero, "reduce_bucket_size": 5000, "stage3_param_persistence_threshold": 100}
    if offload:
        z["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if param:
        z["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "seed": 7, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},  # the fused kernel
        "scheduler": {"type": "cosine", "params": {"warmup_num_steps": 2, "total_num_steps": steps}},
        "zero_optimization": z, "bf16": {"enabled": bf16}, "wall_clock_breakdown": offload,
        "model": {"vocab_size": 256, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "seq_len": 16},
        "data": {"train_files": [os.path.join(STD, "textwrap.py"), os.path.join(STD, "argparse.py")],
                 "cache_dir": cache_dir},
    }


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """Tokenizer and token file built once, here, so the ranks only read the cache."""
    from engine.config import load_config
    from engine.training.trainer import build_data

    d = str(tmp_path_factory.mktemp("offload_data"))
    build_data(load_config(config(d), world_size=1))
    return d


def _build(rank, world, c):
    import engine
    from engine.config import load_config
    from engine.training.trainer import build_data

    cfg = load_config(c, world_size=world)
    _, sampler = build_data(cfg)
    eng, *_ = engine.initialize(config=cfg)
    return eng, sampler


def _offload_state(eng) -> dict:
    """Where the offloaded run keeps its state (host buffers apart from the device gradient)."""
    opt = eng.optimizer
    groups = opt.groups
    return {"separate_grad": all(g.grad is not g.master.grad for g in groups),
            "master_on_cpu": all(g.master.device.type == "cpu" for g in groups),
            "state_on_cpu": all(v.device.type == "cpu" for st in opt.optimizer.state.values()
                                for v in st.values() if hasattr(v, "device")),
            "param_on_host": all(b.compute_shard is None or b.compute_shard.device.type == "cpu"
                                 for b in opt.buckets),
            # memory_bytes counts the host state under "offloaded", not as device optimizer state
            "memory": {k: v for k, v in opt.memory_bytes().items() if k in ("offloaded", "optimizer_state")}}


def _run(rank, world, configs, steps=STEPS):
    from engine.training.trainer import train

    out = []
    for c in configs:
        eng, sampler = _build(rank, world, c)
        recs = train(eng, sampler, steps, output_dir=None)
        masters = [g.master.detach().clone() for g in eng.optimizer.groups]
        phases = sorted({k for r in recs for k in r.get("phase_ms", {})})
        where = _offload_state(eng) if eng.optimizer.offload.optimizer else None
        out.append(([r["loss"] for r in recs], masters, phases, where))
    return out


@pytest.fixture(scope="module")
def one_process(cache_dir):
    return run_ranks(_run, 1, [config(cache_dir)], timeout=120)[0][0][0]


LAYOUTS = [dict(zero=1), dict(zero=2), dict(zero=3)]
OFFLOADED = [dict(zero=1, offload=True), dict(zero=2, offload=True), dict(zero=3, offload=True),
             dict(zero=3, offload=True, param=True)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_offload_equals_no_offload_and_one_process(cache_dir, one_process):
    per_rank = run_ranks(_run, 2, [config(cache_dir, **k) for k in LAYOUTS + OFFLOADED], timeout=280)
    runs = dict(zip([str(k) for k in LAYOUTS + OFFLOADED], per_rank[0]))
    assert one_process[-1] < one_process[0] - 0.02, f"the tiny model did not learn: {one_process}"
    for k in OFFLOADED:
        losses, masters, phases, where = runs[str(k)]
        same = runs[str(dict(zero=k["zero"]))]
        assert losses == pytest.approx(same[0], rel=SAME_LAYOUT_RTOL), f"{k} vs without offload"
        assert losses == pytest.approx(one_process, rel=ONE_PROCESS_RTOL), f"{k} vs one process"
        assert where is not None and where["separate_grad"] and where["master_on_cpu"] and where["state_on_cpu"], k
        assert where["param_on_host"] or not k.get("param"), k
        assert where["memory"]["offloaded"] > 0 and where["memory"]["optimizer_state"] == 0, where["memory"]
        assert {"offload_copy_out", "offload_cpu_step", "offload_copy_back"} <= set(phases), phases
    for r in per_rank[1:]:  # every rank reports the same (global-batch) loss
        assert [x[0] for x in r] == [x[0] for x in per_rank[0]]


@pytest.mark.timeout(300)
def test_bf16_offloaded_step_is_bit_equal(cache_dir):
    import torch

    layouts = [dict(zero=1), dict(zero=2), dict(zero=3)]
    cfgs = [config(cache_dir, bf16=True, **k) for k in layouts] + \
           [config(cache_dir, bf16=True, offload=True, **k) for k in layouts] + \
           [config(cache_dir, bf16=True, offload=True, param=True, zero=3)]
    per_rank = run_ranks(_run, 2, cfgs, steps=3, timeout=280)
    for rank_out in per_rank:
        plain, offloaded = rank_out[:3], rank_out[3:6] + [rank_out[6]]
        for i, (a, b) in enumerate(zip(plain + [plain[2]], offloaded)):
            assert a[0] == b[0], f"bf16 layout {i}: losses differ {a[0]} vs {b[0]}"
            assert all(torch.equal(x, y) for x, y in zip(a[1], b[1])), f"bf16 layout {i}: masters differ"


def _resume(rank, world, cache_dir, save_dir, first, second, steps=2):
    """``steps`` steps of ``first``, a checkpoint, ``steps`` more in a fresh engine of ``second``
    loaded from it; and 2 * ``steps`` straight of ``second``."""
    from engine.training.trainer import train

    eng, sampler = _build(rank, world, config(cache_dir, steps=2 * steps, **first))
    head = [r["loss"] for r in train(eng, sampler, steps, output_dir=None)]
    eng.save_checkpoint(save_dir)
    eng2, sampler2 = _build(rank, world, config(cache_dir, steps=2 * steps, **second))
    eng2.load_checkpoint(save_dir)
    tail = [r["loss"] for r in train(eng2, sampler2, steps, output_dir=None)]
    eng3, sampler3 = _build(rank, world, config(cache_dir, steps=2 * steps, **second))
    straight = [r["loss"] for r in train(eng3, sampler3, 2 * steps, output_dir=None)]
    return head + tail, straight


@pytest.mark.timeout(300)
@pytest.mark.parametrize("first,second", [
    (dict(zero=2, offload=True), dict(zero=2)),
    (dict(zero=3), dict(zero=3, offload=True, param=True)),
])
def test_resume_across_offload_is_bit_exact(cache_dir, tmp_path, first, second):
    resumed, straight = run_ranks(_resume, 2, cache_dir, str(tmp_path / "ckpt"), first, second, timeout=280)[0]
    assert resumed == straight, f"{first} -> {second}: {resumed} vs {straight}"


@pytest.mark.timeout(300)
def test_offloaded_checkpoint_loads_into_another_stage(cache_dir, tmp_path):
    resumed, straight = run_ranks(_resume, 2, cache_dir, str(tmp_path / "ckpt"), dict(zero=1, offload=True),
                                  dict(zero=3), timeout=280)[0]
    assert resumed == pytest.approx(straight, rel=2e-6)  # another stage: the layout tolerance


def test_muon_with_offload_is_refused_with_the_reason():
    from engine.config import load_config
    from engine.errors import ConfigError

    c = {"train_batch_size": 2, "optimizer": {"type": "Muon", "params": {"lr": 1e-3}},
         "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(ConfigError, match="offload_optimizer.*Muon.*Newton-Schulz"):
        load_config(c, world_size=1)


# ------------------------------------------------------------------ launch/train.py
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launch_train_with_offload_under_torchrun(cache_dir, tmp_path):
    """launch/train.py, 2 CPU ranks, ZeRO-2 with offload_optimizer: the in-process losses of
    the same layout without offload (rtol 1e-6), and the offload phases in metrics.jsonl."""
    steps = 3
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(config(cache_dir, zero=2, offload=True, steps=steps)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), TRAIN, "--config", str(path), "--steps", str(steps),
                           "--output", str(tmp_path / "out"), "--sample-tokens", "0"],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    plain = run_ranks(_run, 2, [config(cache_dir, zero=2, steps=steps)], steps=steps, timeout=200)[0][0][0]
    assert [r["loss"] for r in recs] == pytest.approx(plain, rel=SAME_LAYOUT_RTOL)
    assert all({"offload_copy_out", "offload_cpu_step", "offload_copy_back"} <= set(r["phase_ms"]) for r in recs)
    assert all(r["offloaded_bytes"] > 0 for r in json.load(open(tmp_path / "out" / "memory.json"))["ranks"])
    resolved = json.load(open(tmp_path / "out" / "config.json"))
    assert resolved["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}


# ------------------------------------------------------------------ DeepSpeed's optimizer names
def _client_run(rank, world, which, offload, force):
    import torch

    import engine.compat.deepspeed as deepspeed
    from engine.errors import ConfigError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ref.load_state_dict(model.state_dict())
    adam = deepspeed.ops.adam
    make = {"cpu_adam": lambda ps: adam.DeepSpeedCPUAdam(ps, lr=1e-2, weight_decay=0.1),
            "fused_adam": lambda ps: adam.FusedAdam(ps, lr=1e-2, weight_decay=0.1),
            "torch": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)}[which]
    z: dict = {"stage": 2}
    if offload:
        z["offload_optimizer"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": z,
           "zero_force_ds_cpu_optimizer": force}
    try:
        eng, *_ = deepspeed.initialize(model=model, optimizer=make(list(model.parameters())), config=cfg)
    except ConfigError as exc:
        return str(exc)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)  # one process, torch's AdamW
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        eng.backward(torch.nn.functional.mse_loss(eng(x), y))
        eng.step()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    return max(float((a - b).abs().max()) for a, b in zip(model.parameters(), ref.parameters()))


@pytest.mark.timeout(200)
def test_deepspeed_adam_names_as_client_optimizers_and_zero_force_ds_cpu_optimizer():
    cases = [("cpu_adam", True, True), ("fused_adam", False, True), ("torch", True, True), ("torch", True, False)]
    got = [run_ranks(_client_run, 1, *c, timeout=120)[0] for c in cases]
    cpu_adam, fused, refused, allowed = got
    assert isinstance(cpu_adam, float) and cpu_adam < 1e-6, cpu_adam  # one process, torch AdamW: fp32 ulps
    assert isinstance(fused, float) and fused < 1e-6, fused
    # DeepSpeed's rule: with offload, a client optimizer must be DeepSpeedCPUAdam unless the switch is off
    assert isinstance(refused, str) and "zero_force_ds_cpu_optimizer" in refused and "DeepSpeedCPUAdam" in refused
    assert isinstance(allowed, float) and allowed < 1e-6, allowed
