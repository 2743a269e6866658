"""Expert parallelism through ``engine.initialize`` (the DeepSpeed loop) with a stand-in MoE
module, against one process holding every expert.

What this proves about the engine side (docs/expert_parallel.md), independent of any router:
``expert_parallel.size`` builds the EP and expert-gradient groups (Topology.expert_mesh), the
initial broadcast reaches an expert's replicas only (not the other experts' ranks), ZeRO 0-3
reduce and partition expert parameters over their expert-gradient group with the step's
``1/dp`` factor, and clipping uses one global norm that counts every element once.

The stand-in: a dense layer shared by all ranks, then ``E`` stacked SwiGLU-free experts
``(E_local, H, H)`` carrying ``set_expert_placement``. Data rank ``d`` (EP rank ``d % ep``)
sends all its rows to its local expert ``(d // ep) % E_local`` (a forced router), so every
expert is fed by at most one rank (the EDP reduction must carry its gradient to its replicas)
and, at world 2, half of each rank's experts get no token at all. The reference computes the
same routing on one process; the step's loss is the mean of the ranks' losses (the DeepSpeed
loop's ``1/dp``). Clipping at 0.05 is active on every step (norms are ~0.3-1), so a norm
that counted an expert twice or missed one would change every update.

Tolerances: parameters 2e-6 absolute after 4 AdamW steps (fp32, lr 1e-2: a wrong factor or
group moves a weight by ~lr), norms 1e-6 relative (float64 sums of fp32 squares).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from harness import run_ranks

import engine
from engine.errors import ConfigError
from engine.placement import ExpertShard, set_expert_placement
from engine.topology import Role

H, ROWS, STEPS, E, LR, CLIP = 6, 4, 4, 4, 1e-2, 0.05


class _StandInMoE(nn.Module):
    """``shared`` (dense), then experts ``[first, first + count)`` stacked along dim 0."""

    def __init__(self, first: int, count: int, ep: int):
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(H, H)
        full = torch.randn(E, H, H, generator=torch.Generator().manual_seed(7)) * 0.3  # the global expert init
        self.experts = nn.Parameter(full[first:first + count].clone())
        if ep > 0:
            set_expert_placement(self.experts, ExpertShard(first, count, E), ep)

    def forward(self, x, y, local=0):
        h = torch.tanh(self.shared(x))              # (ROWS, H)
        out = h @ self.experts[local]                # (ROWS, H): every row to one local expert
        return nn.functional.mse_loss(out, y)


def _route(d, ep):
    """(EP rank, local expert, global expert) of data rank ``d``'s rows."""
    per = E // ep
    ep_rank, local = d % ep, (d // ep) % per
    return ep_rank, local, ep_rank * per + local


def _data(step, d):
    g = torch.Generator().manual_seed(1000 * step + d)
    return torch.randn(ROWS, H, generator=g), torch.randn(ROWS, H, generator=g)


def _reference(world, ep):
    model = _StandInMoE(0, E, ep=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    norms = []
    for s in range(STEPS):
        losses = [model(*_data(s, d), local=_route(d, ep)[2]) for d in range(world)]
        torch.stack(losses).mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}, norms


def _config(stage, ep):
    return {"train_micro_batch_size_per_gpu": ROWS, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 64,
                                  "stage3_param_persistence_threshold": 8},
            "expert_parallel": {"size": ep}}


def _train(rank, world, stage, ep):
    ep_rank, local, _ = _route(rank, ep)
    per = E // ep
    model = _StandInMoE(ep_rank * per, per, ep)
    with torch.no_grad():  # the broadcast must bring every replica its first replica's values:
        if rank > 0:  # rank 0 for the dense weights,
            model.shared.weight.add_(1.0)
        if rank >= ep:  # the first of the expert-gradient group for the experts (not rank 0's experts)
            model.experts.add_(1.0)
    eng, _, _, _ = engine.initialize(model=model, config=_config(stage, ep))
    groups = eng.groups
    got_groups = (groups.role(Role.EP).ranks, groups.role(Role.EXPERT_GRAD).ranks)
    norms = []
    for s in range(STEPS):
        loss = eng(*_data(s, rank), local=local)
        eng.backward(loss)
        eng.step()
        norms.append(eng.get_global_grad_norm())
    if stage == 3:
        with engine.zero.GatheredParameters(list(model.parameters())):
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
    else:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    eng.destroy()
    return params, norms, got_groups


@pytest.mark.parametrize("world,ep,stage", [
    (4, 2, 3),
    pytest.param(4, 2, 1, marks=pytest.mark.extended),
    pytest.param(2, 2, 1, marks=pytest.mark.extended),
    pytest.param(4, 4, 0, marks=pytest.mark.extended),
])
def test_expert_parallel_matches_one_process(world, ep, stage):
    ref, ref_norms = _reference(world, ep)
    per = E // ep
    for rank, (params, norms, (ep_ranks, edp_ranks)) in enumerate(run_ranks(_train, world, stage, ep, timeout=180)):
        assert ep_ranks == tuple(range(rank - rank % ep, rank - rank % ep + ep))  # neighbouring data ranks
        assert edp_ranks == tuple(r for r in range(world) if r % ep == rank % ep)  # same experts
        first = (rank % ep) * per
        want = {"shared.weight": ref["shared.weight"], "shared.bias": ref["shared.bias"],
                "experts": ref["experts"][first:first + per]}
        for name, got in params.items():
            diff = (got - want[name]).abs().max().item()
            assert diff < 2e-6, (world, ep, stage, rank, name, diff)
        for a, b in zip(norms, ref_norms):
            assert abs(a - b) <= 1e-6 * b, (rank, norms, ref_norms)


_REFUSALS = [  # (config extra, how the model marks its experts, what the error says)
    ({"expert_parallel": {"size": 3}}, 2, "does not divide the data x context ranks"),
    ({}, 0, "the model has no expert parameters"),
    ({}, 4, "holds 1 of 4 experts"),
    ({}, -1, "allreduce = False"),
]


def _refused(rank, world):
    msgs = []
    for cfg_extra, mark_ep, _ in _REFUSALS:
        model = _StandInMoE(0, E // mark_ep, mark_ep) if mark_ep > 0 else _StandInMoE(0, E, 0)
        if mark_ep == -1:
            model.experts.allreduce = False  # DeepSpeed's attribute without the placement
        try:
            engine.initialize(model=model, config={**_config(1, 2), **cfg_extra})
            msgs.append(None)
        except ConfigError as e:
            msgs.append(str(e))
    return msgs


def test_expert_parallel_refusals_on_every_rank():
    """Each refused on every rank (a rank that went on would hang its peers)."""
    for msgs in run_ranks(_refused, 2, timeout=120):
        for msg, (_, _, needle) in zip(msgs, _REFUSALS):
            assert msg is not None and needle in msg, msg


def _built_under_init(rank, world, ep):
    import torch.distributed as dist

    from engine.distributed.groups import AxisGroup
    from engine.topology import Topology
    from engine.zero import GatheredParameters, Init

    mine = None
    for ranks in Topology(dp=world).expert_mesh(ep).groups(["edp"]):  # every rank, same order
        handle = dist.new_group(ranks)
        if rank in ranks:
            mine = AxisGroup("expert_grad", tuple(ranks), ranks.index(rank), handle)
    per = E // ep
    with Init(data_parallel_group=AxisGroup.world(), expert_group=mine):
        model = _StandInMoE((rank % ep) * per, per, ep)
    sizes = {n: p.ds_process_group.size for n, p in model.named_parameters()}
    with GatheredParameters(list(model.parameters())):
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
    return sizes, values


@pytest.mark.extended
def test_zero_init_partitions_expert_shards_over_their_replicas():
    """engine.zero.Init(expert_group=): a parameter placed as an expert shard in its
    module's constructor is cut over its replicas (size dp / ep), the rest over the data group,
    and gathering gives back each rank's own experts."""
    world, ep = 4, 2
    dense = _StandInMoE(0, E, 0)
    for rank, (sizes, values) in enumerate(run_ranks(_built_under_init, world, ep, timeout=120)):
        assert sizes == {"shared.weight": world, "shared.bias": world, "experts": world // ep}
        first = (rank % ep) * (E // ep)
        assert torch.equal(values["experts"], dense.experts.detach()[first:first + E // ep])
        assert torch.equal(values["shared.weight"], dense.shared.weight.detach())
