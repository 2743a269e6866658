"""ZeRO-3 builds the reference MoE GPT inside ``zero.Init`` at ``expert_parallel.size`` > 1.

The experts (engine.moe.experts.GroupedSwiGLU) are placed as expert shards in their own
constructor, so ``zero.Init`` cuts them over the expert-gradient group (dp / ep ranks holding
the same experts) and everything else over the grad group, while the model is built: no rank
ever holds its whole stage. At world 4 (dp 4, ep 2) the run built that way (``model=None``)
trains the same per-step losses and gradient norms as the same run with ``zero.Init``
switched off in the builder (the model built whole, then partitioned by the stage-3
optimizer: what expert parallelism did before).

Tolerance: 1e-6 relative on losses and norms: the two runs hold the same values in the same
ZeRO-3 layout, so only the flat buckets' order may differ (measured: bit-identical).
"""

from __future__ import annotations

import pytest
from _ckpt_common import config, train
from harness import run_ranks

STEPS, RTOL = 3, 1e-6


def _cfg() -> dict:
    cfg = config(dp=4, zero=3, layers=2, expert_parallel={"size": 2})
    cfg["model"]["moe"] = {"num_experts": 4, "top_k": 2, "expert_hidden_size": 32, "aux_loss_coef": 0.01}
    return cfg


def _run(rank, world, use_init: bool):
    import engine
    import engine.assembly.builders as builders
    from engine.config import load_config
    from engine.moe.stats import moe_layers
    from engine.zero.init import Init, is_partitioned

    built = []  # (module class, partitioned, group size) of each parameter zero.Init saw
    orig = Init._partition_module

    def spy(self, module):
        orig(self, module)
        for p in module.parameters(recurse=False):
            built.append((type(module).__name__, is_partitioned(p), p.ds_process_group.size if is_partitioned(p) else 0))

    Init._partition_module = spy  # type: ignore[method-assign]
    if not use_init:  # the same build with zero.Init switched off: the optimizer partitions after
        builders.zero_init = lambda **kw: Init(**{**kw, "enabled": False})  # type: ignore[assignment]
    eng, *_ = engine.initialize(config=load_config(_cfg(), world_size=world))
    assert len(moe_layers(eng.module)) == 2
    losses, norms = [], []
    for _ in range(STEPS):
        losses += train(eng, 1)
        norms.append(eng.get_global_grad_norm())
    eng.destroy()
    return built, losses, norms


def test_zero_init_at_ep2_trains_as_the_unpartitioned_build():
    init = run_ranks(_run, 4, True, timeout=300)
    plain = run_ranks(_run, 4, False, timeout=300)
    for built, _, _ in init:  # built partitioned: experts over dp / ep = 2 replicas, the rest over 4
        assert built and all(part for _, part, _ in built), built
        sizes = {(cls, size) for cls, _, size in built}
        assert ("GroupedSwiGLU", 2) in sizes and ("TopKRouter", 4) in sizes, sizes
        assert all(size == 2 for cls, _, size in built if cls == "GroupedSwiGLU"), built
        assert all(size == 4 for cls, _, size in built if cls != "GroupedSwiGLU"), built
    assert all(built == [] for built, _, _ in plain)
    for (_, a, na), (_, b, nb) in zip(init, plain):
        assert a == pytest.approx(b, rel=RTOL), (a, b)
        assert na == pytest.approx(nb, rel=RTOL), (na, nb)
