"""Activation recomputation policies train bit-identical losses (fp32) through the training
loop launch/train.py runs (engine.initialize + engine.training.trainer.train).

For each layout (one process; TP 2 with sequence parallelism; TP 2 without it, where
``partition_activations`` applies; PP 2 (1F1B); ZeRO-3 over DP 2) the per-step losses and
gradient norms of every ``activation_checkpointing`` policy equal, with ``torch.equal`` (no
tolerance), those of the same layout without recomputation: a recomputed forward is the
same kernels on the same inputs (engine.models.recompute), so nothing may differ by even
one ulp. A recomputation that used another RNG state, a stale FP8/parameter value, a
partitioned input gathered in the wrong order, or dropped a gradient contribution (e.g. the
residual's) changes the loss from the second step on.
"""

from __future__ import annotations

import os
import sysconfig

import pytest
from harness import run_ranks

STEPS = 3
STD = sysconfig.get_paths()["stdlib"]

FULL1 = {"granularity": "full"}
POLICIES = {
    "full-uniform-1": FULL1,
    "full-uniform-2": {"granularity": "full", "method": "uniform", "num_layers": 2},
    "full-block-1": {"granularity": "full", "method": "block", "num_layers": 1},
    "selective-default": {"granularity": "selective"},
    "selective-all": {"granularity": "selective", "modules": ["norm", "core_attn", "mlp_act"]},
    "selective-sublayers": {"granularity": "selective", "modules": ["attn", "mlp"]},
    "full-cpu": {"granularity": "full", "cpu_checkpointing": True},
    "selective-cpu": {"granularity": "selective", "cpu_checkpointing": True},
    "interval-1": "interval",  # pipeline.activation_checkpoint_interval 1
}
# TP without sequence parallelism only (with it: a config error)
PARTITIONED = {"full-partitioned": {"granularity": "full", "partition_activations": True},
               "full-partitioned-cpu": {"granularity": "full", "partition_activations": True,
                                        "cpu_checkpointing": True}}


def tiny_config(cache_dir: str, policy=None, dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0,
                sp: bool = False) -> dict:
    cfg = {
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "seed": 7, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "torch_adam": True}},
        "zero_optimization": {"stage": zero, "reduce_bucket_size": 5000},
        "tensor_parallel": {"autotp_size": tp, "sequence_parallel": sp},
        "pipeline": {"stages": pp, "partition": "uniform"},
        "model": {"vocab_size": 256, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                  "seq_len": 16},
        "data": {"train_files": [os.path.join(STD, "textwrap.py")], "cache_dir": cache_dir},
    }
    if policy == "interval":
        cfg["pipeline"]["activation_checkpoint_interval"] = 1
    elif policy is not None:
        cfg["activation_checkpointing"] = dict(policy)
    return cfg


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    from engine.config import load_config
    from engine.training.trainer import build_data

    d = str(tmp_path_factory.mktemp("recompute_cache"))
    build_data(load_config(tiny_config(d), world_size=1))
    return d


def _train(rank, world, configs):
    import torch

    import engine
    from engine.config import load_config
    from engine.training.trainer import build_data, train

    out = []
    for c in configs:
        cfg = load_config(c, world_size=world)
        _, sampler = build_data(cfg)
        eng, *_ = engine.initialize(config=cfg)
        recs = train(eng, sampler, STEPS, output_dir=None)
        out.append((torch.tensor([r["loss"] for r in recs], dtype=torch.float64),
                    torch.tensor([r["grad_norm"] for r in recs], dtype=torch.float64)))
        eng.destroy()
    return out


def _check(cache_dir, world, layout, names):
    known = {**POLICIES, **PARTITIONED}
    configs = [tiny_config(cache_dir, **layout)] + [tiny_config(cache_dir, known[n], **layout) for n in names]
    per_rank = run_ranks(_train, world, configs, timeout=300)
    import torch

    (ref_loss, ref_norm), *runs = per_rank[0]
    assert ref_loss[-1] < ref_loss[0], f"{layout}: the tiny model did not learn {ref_loss}"
    for name, (loss, norm) in zip(names, runs):
        assert torch.equal(loss, ref_loss), f"{layout} {name}: losses {loss.tolist()} != {ref_loss.tolist()}"
        assert torch.equal(norm, ref_norm), f"{layout} {name}: grad norms {norm.tolist()} != {ref_norm.tolist()}"


# the default suite: representative policies on one process and on TP 2 with SP
@pytest.mark.timeout(300)
def test_policies_one_process(cache_dir):
    _check(cache_dir, 1, {}, ["full-block-1", "selective-all"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_policies_tp2_sequence_parallel(cache_dir):
    _check(cache_dir, 2, {"tp": 2, "sp": True}, ["full-uniform-1", "selective-default"])


# the whole matrix (ENGINE_EXTENDED_TESTS=1)
@pytest.mark.extended
@pytest.mark.timeout(600)
def test_every_policy_one_process(cache_dir):
    _check(cache_dir, 1, {}, list(POLICIES))


@pytest.mark.extended
@pytest.mark.timeout(600)
def test_partition_activations_tp2(cache_dir):
    """Block inputs saved as 1/tp slices, all-gathered before recomputation."""
    _check(cache_dir, 2, {"tp": 2}, list(PARTITIONED))


@pytest.mark.extended
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", [{"tp": 2, "sp": True}, {"pp": 2}, {"dp": 2, "zero": 3}],
                         ids=["tp2-sp", "pp2", "zero3"])
def test_every_policy_every_layout(cache_dir, layout):
    _check(cache_dir, 2, layout, list(POLICIES))


# ------------------------------------------------------------------ activation peak (memory.json)
def _peak(rank, world, configs, out_dir):
    import engine
    from engine.config import load_config
    from engine.training.trainer import build_data, train, write_memory_report

    peaks = []
    for i, c in enumerate(configs):
        cfg = load_config(c, world_size=world)
        _, sampler = build_data(cfg)
        eng, *_ = engine.initialize(config=cfg)
        train(eng, sampler, 2, output_dir=None)
        os.makedirs(f"{out_dir}/{i}", exist_ok=True)
        report = write_memory_report(eng, f"{out_dir}/{i}")
        peaks.append(report["ranks"][0]["activation_peak_bytes"])
        eng.destroy()
    return peaks


@pytest.mark.timeout(300)
def test_full_recompute_keeps_at_most_half_the_activation_peak(cache_dir, tmp_path):
    """memory.json's activation_peak_bytes (exact live-tensor high-water mark of one step's
    forward + backward) of a 4-layer model at sequence 512: full recompute (one block per
    unit) at most half of no recompute; the default selective policy in between."""
    def long(policy):
        c = tiny_config(cache_dir, policy)
        c["model"] = dict(c["model"], seq_len=512, hidden_size=64, num_layers=4)
        c.update(train_batch_size=1, train_micro_batch_size_per_gpu=1)
        return c

    none, selective, full = run_ranks(_peak, 1, [long(None), long(POLICIES["selective-default"]), long(FULL1)],
                                      str(tmp_path), timeout=240)[0]
    print(f"activation peak: none {none}, selective {selective} ({selective / none:.3f}), "
          f"full {full} ({full / none:.3f})")
    assert 0 < full <= 0.5 * none, (none, full)
    assert full < selective < none
