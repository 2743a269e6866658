"""Expert parallelism through the training loop launch/train.py runs (engine.initialize +
engine.training.trainer.train), against one process holding every expert.

The tiny reference GPT (2 layers, hidden 32, seq 16) with an MoE MLP in every block (4
experts, top-2, the sequence-wise auxiliary loss) trains the same global batches at
``expert_parallel.size`` 2 with DP 2 (world 2) and DP 4 (world 4), ZeRO 1 and 3, and with
TP and PP: the per-step losses equal the one-process run's within 1e-5 relative and the
global gradient norm (before clipping, every parameter counted once: expert shards summed
over their expert-gradient group's distinct ZeRO shards and over the EP ranks) within 1e-6
relative on the first step (1e-5 on later ones, whose weights already carry the layouts'
rounding).

Why these tolerances: the layouts change only the order of floating-point sums (gradient
reductions over cp x dp and over the expert-gradient group, the token-count all-reduce, the
all-to-all's row order into each expert's matmul); test_train_entry.py's layouts differ by
~1e-7 over 8 steps. A wrong expert factor (summed instead of averaged, or averaged over the
EP ranks too), an expert reduced over the wrong ranks, or a norm that counts expert shards
once per replica all move the first or second step by > 1e-4.
"""

from __future__ import annotations

import os
import sysconfig

import pytest
from harness import run_ranks

STEPS = 5
LONG_STEPS = 20
RTOL = 1e-5
NORM_RTOL = 1e-6
STD = sysconfig.get_paths()["stdlib"]


# Muon on the dense matrices; the experts' stacked (E, in, out) weights stay in its AdamW group
MUON = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 3e-3, "weight_decay": 0.1, "ns_dtype": "float32"}}


def moe_config(cache_dir: str, **k) -> dict:
    """The tiny MoE GPT at a layout: ``ep``, ``dp`` (implied by the world), ``tp``, ``pp``,
    ``cp``, ``zero``, ``sp``, ``ga`` (gradient accumulation); ``schedule`` / ``virtual``
    (pipeline), ``recompute`` (activation_checkpointing.granularity), ``muon``, ``layers``."""
    ga = k.get("ga", 1)
    return {
        "train_batch_size": 8, "gradient_accumulation_steps": ga, "seed": 7, "gradient_clipping": 1.0,
        "optimizer": MUON if k.get("muon") else {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1,
                                                                             "torch_adam": True}},
        "zero_optimization": {"stage": k.get("zero", 0), "reduce_bucket_size": 5000,
                              "stage3_param_persistence_threshold": 100},
        "tensor_parallel": {"autotp_size": k.get("tp", 1), "sequence_parallel": k.get("sp", False)},
        "pipeline": {"stages": k.get("pp", 1), "partition": "uniform", "schedule": k.get("schedule", "1f1b"),
                     "virtual_stages": k.get("virtual", 1)},
        "activation_checkpointing": {"granularity": k.get("recompute", "none")},
        "context_parallel": {"size": k.get("cp", 1)},
        "expert_parallel": {"size": k.get("ep", 1)},
        "model": {"vocab_size": 256, "hidden_size": 32, "num_layers": k.get("layers", 2), "num_heads": 4, "seq_len": 16,
                  "moe": {"num_experts": 4, "top_k": 2, "expert_hidden_size": 32, "aux_loss_coef": 0.01}},
        "data": {"train_files": [os.path.join(STD, "textwrap.py"), os.path.join(STD, "argparse.py")],
                 "cache_dir": cache_dir},
    }


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """Tokenizer and token file built once, here, so the ranks only read the cache."""
    from engine.config import load_config
    from engine.training.trainer import build_data

    d = str(tmp_path_factory.mktemp("moe_cache"))
    build_data(load_config(moe_config(d), world_size=1))
    return d


def _trajectories(rank, world, configs, steps):
    """Per config: the per-step (loss, grad norm) of ``steps`` training steps."""
    import engine
    from engine.config import load_config
    from engine.training.trainer import build_data, train

    out = []
    for c in configs:
        cfg = load_config(c, world_size=world)
        _, sampler = build_data(cfg)
        eng, *_ = engine.initialize(config=cfg)
        rows = train(eng, sampler, steps, output_dir=None)
        out.append(([r["loss"] for r in rows], [r["grad_norm"] for r in rows]))
        eng.destroy()
    return out


def _reference(cache_dir, steps, **k):
    (run,) = run_ranks(_trajectories, 1, [moe_config(cache_dir, **k)], steps, timeout=180)[0]
    return run


def _check(name, got, ref):
    (losses, norms), (ref_losses, ref_norms) = got, ref
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert a == pytest.approx(b, rel=RTOL), f"{name}: step {i} loss {a} != {b}"
    assert norms[0] == pytest.approx(ref_norms[0], rel=NORM_RTOL), f"{name}: first grad norm"
    for i, (a, b) in enumerate(zip(norms, ref_norms)):
        assert a == pytest.approx(b, rel=RTOL), f"{name}: step {i} grad norm {a} != {b}"


def _run_layouts(cache_dir, world, layouts, steps, ref):
    per_rank = run_ranks(_trajectories, world, [moe_config(cache_dir, **k) for k in layouts], steps, timeout=400)
    for k, got in zip(layouts, per_rank[0]):
        _check(f"world {world} {k}", got, ref)
    for r in per_rank[1:]:  # every rank reports the same (global-batch) loss
        assert [x[0] for x in r] == [x[0] for x in per_rank[0]]


def test_ep2_dp2_zero1_and_zero3_train_as_one_process(cache_dir):
    ref = _reference(cache_dir, STEPS)
    assert ref[0][-1] < ref[0][0], f"the tiny MoE model did not learn: {ref[0]}"
    _run_layouts(cache_dir, 2, [dict(ep=2, zero=1), dict(ep=2, zero=3)], STEPS, ref)


@pytest.mark.extended
def test_ep_layouts_train_as_one_process_over_20_steps(cache_dir):
    ref = _reference(cache_dir, LONG_STEPS)
    _run_layouts(cache_dir, 2, [dict(ep=2, zero=1), dict(ep=2, zero=3), dict(ep=2, zero=0), dict(ep=1, zero=1)],
                 LONG_STEPS, ref)
    _run_layouts(cache_dir, 4, [dict(ep=2, zero=1), dict(ep=2, zero=3), dict(ep=4, zero=1), dict(ep=4, zero=3),
                                dict(ep=2, tp=2, zero=1), dict(ep=2, pp=2, zero=1), dict(ep=2, cp=2, zero=1)],
                 LONG_STEPS, ref)


@pytest.mark.slow
def test_ep_composes_with_muon_v_and_interleaved_schedules_and_recompute(cache_dir):
    """EP 2 with Muon (ZeRO 1 and 3), with the zb-v and interleaved-1f1b pipeline schedules
    (4 layers over 2 ranks x 2 chunks) and with full and selective recompute: each the losses
    of one process running the same model and optimizer (same tolerances as above)."""
    muon_ref = _reference(cache_dir, STEPS, muon=True)
    _run_layouts(cache_dir, 2, [dict(ep=2, zero=1, muon=True), dict(ep=2, zero=3, muon=True)], STEPS, muon_ref)
    deep_ref = _reference(cache_dir, STEPS, layers=4)
    _run_layouts(cache_dir, 4, [dict(ep=2, pp=2, zero=1, layers=4, schedule="zb-v", virtual=2, ga=2),
                                dict(ep=2, pp=2, zero=1, layers=4, schedule="interleaved-1f1b", virtual=2, ga=2)],
                 STEPS, deep_ref)
    # recompute needs no pipeline: on 2 ranks (EP 2 = DP 2), not 4
    _run_layouts(cache_dir, 2, [dict(ep=2, zero=3, layers=4, recompute="full"),
                                dict(ep=2, zero=1, layers=4, recompute="selective")], STEPS, deep_ref)
