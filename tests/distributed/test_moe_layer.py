"""The MoE layer at expert parallelism 2 and 4 vs one process holding every expert, on gloo, fp32.

Every rank builds the one-process reference layer (all experts, EP 1, same seed) next to its
expert-parallel layer and compares the output, the input gradient and every parameter
gradient. The loss is ``sum(y * g)`` plus the balancing loss, injected by the layer.

Layouts: ``dp``: rank r holds sequences ``[r*B, (r+1)*B)`` of the global batch (EP ranks are
data ranks); the reference sees all of them and its balancing loss, the MEAN over sequences,
gets ``loss_factor = world`` (each EP rank's loss holds the mean of its own sequences: their
sum is ``world`` times the global mean). ``cp``: rank r holds the r-th slice of EVERY sequence
(EP over the context-parallel ranks): the balancing counts are all-reduced over the group
(``seq_groups``) and the parts of the loss sum to the reference's.

Router grads are summed over the ranks (a dense weight's gradient reduction); expert
grads are compared per rank with the reference's slice of this rank's experts (EP's
all-to-all brings every token's gradient back to its expert). ``starve``: the router is
forced onto experts 0 and 1, so the other ranks' experts receive no token at all; they
must neither hang nor produce NaN, and get zero gradients.

TP 2 x EP 2 (4 ranks, extended): experts replicated over TP, dispatched over EP subgroups;
with sequence parallelism each TP rank routes half of every sequence and the router and
expert gradients are summed over TP (copy-to-region), without it both route the same tokens.

With ``capacity_factor`` (each expert capped per rank and micro-batch) the reference runs the
ranks' batches as its gradient-accumulation micro-batches: it must drop exactly what they
drop (and the test checks that something is dropped).

Tolerance: 1e-6 relative to each tensor's largest magnitude (fp32; the sums over tokens
run in another order than in one process: measured differences are ~1e-8).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

from engine.distributed.groups import AxisGroup
from engine.models.config import ModelConfig
from engine.moe.context import MoEContext
from engine.moe.layer import MoELayer
from engine.placement import placement_of

B, S, H, E = 2, 16, 32, 4


def _cfg(**moe):
    spec = {"num_experts": E, "expert_hidden_size": 16, "top_k": 2, "z_loss_coef": 1e-3, **moe}
    return ModelConfig(vocab_size=64, hidden_size=H, num_layers=2, num_heads=4, seq_len=S, moe=spec)


def _close(actual, expected, what):
    scale = max(float(expected.abs().max()), 1e-30)
    diff = float((actual - expected).abs().max())
    assert torch.isfinite(actual).all(), f"{what}: not finite"
    assert diff <= 1e-6 * scale, f"{what}: max diff {diff:.3g} > 1e-6 x {scale:.3g}"


def _inputs(world, starve):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(B * world, S, H, generator=g)
    if starve:
        x[..., 0] = 1.0  # a constant feature the forced router reads
    return x, torch.randn(B * world, S, H, generator=torch.Generator().manual_seed(8))


def _force(layer, starve):
    if starve:  # experts 0 and 1 win for every token
        with torch.no_grad():
            layer.router.weight[:, 0] = torch.tensor([40.0, 40.0, -40.0, -40.0])


def _run(layer, x, g, chunks=1):
    """Output and input gradient of ``sum(y * g)`` (+ the injected balancing loss), the batch
    run as ``chunks`` micro-batches (one backward each, as gradient accumulation does)."""
    x = x.clone().requires_grad_(True)
    ys = []
    for xc, gc in zip(x.chunk(chunks), g.chunk(chunks)):
        y = layer(xc)
        (y * gc).sum().backward()
        ys.append(y.detach())
    return torch.cat(ys), x.grad


def check_layout(rank, world, layout, starve, moe):
    cfg = _cfg(**moe)
    group = AxisGroup.world()
    x, g = _inputs(world, starve)
    # a capacity caps each expert per rank and micro-batch: the reference runs the ranks'
    # batches as its micro-batches (the layout-free statement: it drops what they drop)
    chunks = world if "capacity_factor" in moe else 1
    factor = float(world) if layout == "dp" and chunks == 1 else 1.0
    ref = MoELayer(cfg, cfg.moe, 0, 1234, MoEContext(loss_factor=factor))
    ctx = MoEContext(ep_group=group, seq_groups=(group,) if layout == "cp" else ())
    ep = MoELayer(cfg, cfg.moe, 0, 1234, ctx)
    for layer in (ref, ep):
        layer.train()
        _force(layer, starve)
    n = E // world
    assert ep.experts.gate_up.shape == (n, H, 32) and ep.first_expert == rank * n
    assert placement_of(ep.experts.down).expert.first == rank * n and ep.experts.down.group_name == f"ep_size_{world}"
    assert torch.equal(ep.experts.gate_up.detach(), ref.experts.gate_up.detach()[rank * n:(rank + 1) * n])
    if layout == "dp":
        mine = slice(rank * B, (rank + 1) * B)
        xs, gs = x[mine], g[mine]
    else:
        cut = S // world
        mine = (slice(None), slice(rank * cut, (rank + 1) * cut))
        xs, gs = x[mine], g[mine]
    y_ref, dx_ref = _run(ref, x, g, chunks)
    y, dx = _run(ep, xs, gs)
    _close(y, y_ref[mine], "output")
    _close(dx, dx_ref[mine], "input gradient")
    router = ep.router.weight.grad.clone()
    dist.all_reduce(router)
    _close(router, ref.router.weight.grad, "router gradient (summed over ranks)")
    for name in ("gate_up", "down"):
        got = getattr(ep.experts, name).grad
        want = getattr(ref.experts, name).grad[rank * n:(rank + 1) * n]
        _close(got, want, f"expert {name} gradient")
        if starve and rank * n >= 2:
            assert torch.equal(got, torch.zeros_like(got)), "a starved rank's experts must get zero gradients"
    counts = ep.stats.counts.clone()
    dist.all_reduce(counts)
    if layout == "dp":  # per-rank counts of whole sequences sum to the reference's
        _close(counts, ref.stats.counts, "expert counts")
    if "capacity_factor" in moe:
        dropped = ep.stats.dropped.clone()
        dist.all_reduce(dropped)
        assert dropped > 0 and torch.equal(dropped, ref.stats.dropped), (dropped, ref.stats.dropped)
    return True


CASES = [("dp", False, {}), ("dp", True, {}), ("cp", False, {"shared_experts": 1}),
         ("dp", False, {"capacity_factor": 1.0}), ("cp", True, {"load_balancing": "aux_free"})]


def check_all(rank, world):
    for layout, starve, moe in CASES:
        check_layout(rank, world, layout, starve, moe)
    return True


def test_moe_layer_ep2_equals_one_process():
    assert run_ranks(check_all, 2) == [True, True]


@pytest.mark.extended
def test_moe_layer_ep4_equals_one_process():
    assert run_ranks(check_all, 4) == [True] * 4


def check_tp2_ep2(rank, world, sp):
    """4 ranks = TP 2 (inner) x EP 2: experts replicated over TP, dispatched over EP. Without
    sequence parallelism both TP ranks hold their EP rank's whole sequences; with it each holds
    half of every sequence (the router and expert gradients are summed over TP)."""
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ep_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    e_rank, t_rank = rank // 2, rank % 2
    tp = AxisGroup(f"tp{e_rank}", (2 * e_rank, 2 * e_rank + 1), t_rank, tp_groups[e_rank])
    ep = AxisGroup(f"ep{t_rank}", (t_rank, t_rank + 2), e_rank, ep_groups[t_rank])
    cfg = _cfg(shared_experts=1)
    x, g = _inputs(2, False)
    ref = MoELayer(cfg, cfg.moe, 0, 1234, MoEContext(loss_factor=2.0))
    layer = MoELayer(cfg, cfg.moe, 0, 1234, MoEContext(ep_group=ep).with_tp(tp, sp))
    if layer.shared is not None:  # the shared experts are TP-sharded: compare the MoE part only
        layer.shared = ref.shared = None
    ref.train()
    layer.train()
    rows = slice(e_rank * B, (e_rank + 1) * B)
    cols = slice(t_rank * S // 2, (t_rank + 1) * S // 2) if sp else slice(None)
    y_ref, dx_ref = _run(ref, x, g)
    y, dx = _run(layer, x[rows, cols], g[rows, cols])
    _close(y, y_ref[rows, cols], "output")
    _close(dx, dx_ref[rows, cols], "input gradient")
    router = layer.router.weight.grad.clone()
    dist.all_reduce(router, group=ep_groups[t_rank])  # the dense reduction over data (= EP) ranks
    _close(router, ref.router.weight.grad, "router gradient")
    for name in ("gate_up", "down"):
        _close(getattr(layer.experts, name).grad, getattr(ref.experts, name).grad[e_rank * 2:(e_rank + 1) * 2],
               f"expert {name} gradient")
    return True


@pytest.mark.extended
@pytest.mark.parametrize("sp", [False, True])
def test_moe_layer_tp2_ep2_equals_one_process(sp):
    assert run_ranks(check_tp2_ep2, 4, sp) == [True] * 4
