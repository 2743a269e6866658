"""``expert_parallel`` in the config (engine.config.expert_parallel) and the expert folding's
rank order (Topology.expert_mesh, what ParallelGroups.build makes the EP and expert-gradient
groups from): pure, no processes."""

from __future__ import annotations

import pytest

from engine.config import ConfigError, load_config
from engine.topology import Topology


def _cfg(ep=None, moe=True, experts=4, **extra):
    model = {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "seq_len": 16}
    if moe:
        model["moe"] = {"num_experts": experts, "expert_hidden_size": 16}
    cfg = {"train_micro_batch_size_per_gpu": 1, "model": model, **extra}
    if ep is not None:
        cfg["expert_parallel"] = {"size": ep}
    return cfg


def test_default_is_one_and_round_trips():
    cfg = load_config(_cfg(), world_size=4)
    assert cfg.ep == 1
    cfg = load_config(_cfg(ep=2), world_size=4)
    assert cfg.ep == 2 and cfg.expert_parallel.size == 2
    assert load_config(cfg.to_dict(), world_size=4) == cfg
    assert load_config(_cfg(ep=2, context_parallel={"size": 2}), world_size=2).ep == 2  # dp 1 x cp 2


@pytest.mark.parametrize("cfg,world,needle", [
    (_cfg(ep=3), 4, "expert_parallel.size = 3 does not divide the data x context ranks = 4"),
    (_cfg(ep=4, tensor_parallel={"autotp_size": 2}), 4, "does not divide the data x context ranks = 2"),
    (_cfg(ep=2, experts=5), 8, "model.moe.num_experts = 5 is not divisible by expert_parallel.size = 2"),
    (_cfg(ep=4, experts=6), 4, "model.moe.num_experts = 6 is not divisible by expert_parallel.size = 4"),
    (_cfg(ep=2, moe=False), 2, "has no mixture-of-experts layers (model.moe)"),
    (_cfg(ep=0), 2, "expert_parallel.size"),
    ({**_cfg(), "expert_parallel": {"size": 2, "mode": "x"}}, 2, "expert_parallel"),
])
def test_refusals_name_the_key_and_the_fix(cfg, world, needle):
    with pytest.raises(ConfigError, match="expert_parallel|num_experts") as e:
        load_config(cfg, world_size=world)
    assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize("dp,cp,tp,pp,ep", [(4, 1, 1, 1, 2), (2, 2, 1, 1, 2), (2, 2, 2, 2, 4), (4, 1, 2, 1, 4)])
def test_expert_groups_are_neighbouring_data_ranks_and_their_replicas(dp, cp, tp, pp, ep):
    """EP group: ``ep`` consecutive data ranks (grad-role order, CP innermost) of one (tp, pp);
    expert-gradient group: the data ranks with the same index mod ``ep`` (the same experts)."""
    topo = Topology(dp=dp, tp=tp, pp=pp, cp=cp)
    mesh = topo.expert_mesh(ep)
    for r in range(topo.world_size):
        c = topo.coord(r)
        data = c.cp + cp * c.dp  # the rank's index in its grad-role group
        grad = topo.ranks_along(("cp", "dp"), r)
        assert grad[data] == r
        ep_group, edp_group = mesh.ranks_along(["ep"], r), mesh.ranks_along(["edp"], r)
        first = data - data % ep
        assert ep_group == [grad[d] for d in range(first, first + ep)]
        assert edp_group == [grad[d] for d in range(data % ep, dp * cp, ep)]
