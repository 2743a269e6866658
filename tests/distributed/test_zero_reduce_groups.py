"""ZeRO 0-3 over two reduce groups at once: dense parameters over the grad group (DP 4), expert
shards over the expert-gradient group of Topology.expert_mesh(2) (ep = 2, edp = 2: ranks
{0, 2} hold expert 0, {1, 3} expert 1), against one process holding both experts.

This is what expert parallelism needs from ZeRO (issue "Roles, not axes", typed placement):
each flat group keeps its own reduce group, the gradient factor stays the step's 1/dp (every
expert gradient is a term of the global mean loss), and the global norm counts every element
once. Here rank r's tokens all go to expert r % 2 (a forced router), so the reference is exact.
Tolerance 1e-6 absolute on parameters after 3 AdamW steps (fp32; see test_zero.py: a wrong
factor or group gives errors of order lr = 1e-2), norms 1e-6 relative.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from harness import run_ranks

from engine.distributed.groups import AxisGroup
from engine.placement import ExpertShard, Placement, set_placement
from engine.topology import Role, Topology
from engine.zero import build_zero_optimizer

WORLD, EP, STEPS, ROWS, LR, WD = 4, 2, 3, 4, 1e-2, 0.1


class _Moeish(nn.Module):
    """A shared (dense) layer, then this rank's expert (one of ``EP``)."""

    def __init__(self, experts):
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(6, 9)
        self.experts = nn.ModuleList()
        for e in experts:
            torch.manual_seed(100 + e)
            self.experts.append(nn.Linear(9, 5))

    def forward(self, x, e=0):
        return self.experts[e](torch.tanh(self.shared(x)))


def _data(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 5, generator=g)


def _reference():
    """One process: both experts; the step's loss is the mean of the ranks' losses."""
    model = _Moeish(range(EP))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    norms = []
    for s in range(STEPS):
        losses = [nn.functional.mse_loss(model(*_data(s, r)[:1], e=r % EP), _data(s, r)[1]) for r in range(WORLD)]
        torch.stack(losses).mean().backward()
        norms.append(torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters())).item())
        opt.step()
        opt.zero_grad()
    return model, norms


def _expert_group(rank):
    """This rank's expert-gradient group; every rank creates every group in the same order."""
    mine = None
    for ranks in Topology(dp=WORLD).expert_mesh(EP).groups(["edp"]):
        handle = dist.new_group(ranks)
        if rank in ranks:
            mine = AxisGroup("expert_grad", tuple(ranks), ranks.index(rank), handle)
    return mine


def _run(rank, world, stage):
    expert = rank % EP
    model = _Moeish([expert])
    for p in model.experts.parameters():
        set_placement(p, Placement(expert=ExpertShard(first=expert, count=1, num_experts=EP)))
    kw = dict(reduce_bucket_size=32, alignment=4)
    if stage == 3:
        kw.update(stage3_param_persistence_threshold=4)
    opt = build_zero_optimizer(stage, model, lambda g: torch.optim.AdamW(g, lr=LR, weight_decay=WD),
                               AxisGroup.world(), role_groups={Role.EXPERT_GRAD: _expert_group(rank)}, **kw)
    groups_of = {tuple(g.reduce_group.ranks) for g in opt.groups}
    norms = []
    for s in range(STEPS):
        x, y = _data(s, rank)
        opt.backward(nn.functional.mse_loss(model(x), y))
        norms.append(opt.grad_norm())
        assert opt.step() is True
    if stage == 3:
        with opt.gathered_params():
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
    else:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, norms, groups_of


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_expert_flat_groups_reduce_over_their_own_group(stage):
    ref, ref_norms = _reference()
    results = run_ranks(_run, WORLD, stage, timeout=180)
    want = {n: p.detach() for n, p in ref.named_parameters()}
    for rank, (params, norms, groups_of) in enumerate(results):
        edp = tuple(r for r in range(WORLD) if r % EP == rank % EP)
        assert groups_of == {tuple(range(WORLD)), edp}, groups_of  # two reduce groups in one optimizer
        for name, got in params.items():
            ref_name = name.replace("experts.0", f"experts.{rank % EP}")
            diff = (got - want[ref_name]).abs().max().item()
            assert diff < 1e-6, (stage, rank, name, diff)
        for a, b in zip(norms, ref_norms):
            assert abs(a - b) <= 1e-6 * b, (stage, rank, norms, ref_norms)


def test_expert_group_must_be_given_and_inside_the_grad_group():
    results = run_ranks(_refusals, 2, timeout=120)
    for msgs in results:
        assert "role_groups={Role.EXPERT_GRAD" in msgs[0]
        assert "not inside the grad group" in msgs[1]


def _refusals(rank, world):
    model = _Moeish([0])
    for p in model.experts.parameters():
        set_placement(p, Placement(expert=ExpertShard(0, 1, 1)))
    msgs = []
    for extra in ({}, {Role.EXPERT_GRAD: AxisGroup.single("expert_grad", 7)}):
        try:
            build_zero_optimizer(1, model, lambda g: torch.optim.AdamW(g), AxisGroup.world(), role_groups=extra)
        except ValueError as e:
            msgs.append(str(e))
    return msgs
