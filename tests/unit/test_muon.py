"""engine.optim.Muon in one process: equal to torch.optim.Muon (+ torch.optim.AdamW for the
rest) over 50 steps, the config keys, the assignment rule, owner planning, fused parts.

Tolerance of the torch comparison: none. With ``ns_dtype="bfloat16"`` (torch's only choice)
our update runs the same element-wise ops and the same matmuls in the same order on the
same tensors as torch's, so the parameters are bit-identical after 50 steps; any
deviation (a different blend, lr adjustment, weight-decay order) shows at once.
"""

import pytest
import torch
import torch.nn as nn

from engine.config import load_config
from engine.errors import ConfigError
from engine.optim.muon import Muon
from engine.optim.muon_assign import split_muon_groups, uses_muon
from engine.optim.muon_plan import MuonMatrix, assign_owners, lr_segments, matrix_of
from engine.optim.newton_schulz import newton_schulz
from engine.placement import set_placement, tp_shard


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.up = nn.Linear(8, 24)      # wide
        self.down = nn.Linear(24, 8)    # tall
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 16, bias=False)

    def forward(self, ids):
        return self.lm_head(self.norm(self.down(torch.tanh(self.up(self.embed(ids))))))


def _loss(model, step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 16, (4, 6), generator=g)
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), torch.randint(0, 16, (24,), generator=g))


@pytest.mark.parametrize("adjust,nesterov", [(None, True), ("original", False), ("match_rms_adamw", True)])
def test_equals_torch_muon_and_adamw_50_steps(adjust, nesterov):
    ref, ours = _Net(), _Net()
    muon_ref = [ref.up.weight, ref.down.weight]
    adam_ref = [p for p in ref.parameters() if all(p is not q for q in muon_ref)]
    t_muon = torch.optim.Muon(muon_ref, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov,
                              adjust_lr_fn=adjust)
    t_adam = torch.optim.AdamW(adam_ref, lr=3e-3, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.01)
    groups = split_muon_groups(ours, ours)
    assert [len(g["params"]) for g in groups] == [2, 6]
    opt = Muon(groups, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust,
               adamw_lr=3e-3, adamw_betas=(0.8, 0.95), adamw_eps=1e-10, adamw_weight_decay=0.01)
    for step in range(50):
        _loss(ref, step).backward()
        _loss(ours, step).backward()
        t_muon.step()
        t_adam.step()
        opt.step()
        ref.zero_grad()
        opt.zero_grad()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(p, q), f"{name}: max diff {(p - q).abs().max().item():.3g}"
    assert opt.ns_calls == 2 * 50
    st = opt.state_dict()
    assert sorted(st["state"][0]) == ["momentum_buffer"]
    assert sorted(st["state"][2]) == ["exp_avg", "exp_avg_sq", "step"]


def test_newton_schulz_fp32_close_to_bf16_and_orthogonal():
    g = torch.randn(12, 20, generator=torch.Generator().manual_seed(0))
    o32, o16 = newton_schulz(g, dtype=torch.float32), newton_schulz(g, dtype=torch.bfloat16)
    assert o32.dtype == torch.float32 and o16.dtype == torch.bfloat16
    assert (o32 - o16.float()).abs().max() < 0.05
    s = torch.linalg.svdvals(o32)
    assert s.min() > 0.5 and s.max() < 1.3  # Keller's iteration: singular values ~U(0.5, 1.5)
    assert torch.equal(newton_schulz(g.T, dtype=torch.float32), o32.T)  # tall = transpose of wide


def test_newton_schulz_of_a_slice_is_not_the_slice_of_newton_schulz():
    """Why the layouts must gather: orthogonalising a TP slice or a ZeRO shard of a matrix
    gives an O(1) different update (the failure the layout tests guard against)."""
    g = torch.randn(16, 24, generator=torch.Generator().manual_seed(3))
    whole = newton_schulz(g, dtype=torch.float32)
    for part, sl in ((g[:, :12], whole[:, :12]), (g[:8], whole[:8])):
        assert (newton_schulz(part, dtype=torch.float32) - sl).abs().max() > 0.1


def test_fused_parts_are_orthogonalised_separately():
    """A fused q/k/v weight (rows [q; k; v]) updates like three separate torch Muon matrices."""
    torch.manual_seed(1)
    w = torch.randn(12, 8)
    grads = [torch.randn(12, 8) for _ in range(3)]
    parts = (6, 3, 3)
    fused = nn.Parameter(w.clone())
    set_placement(fused, tp_shard(0, parts))
    sep = [nn.Parameter(x.clone()) for x in w.split(parts)]
    t = torch.optim.Muon(sep, lr=0.05, adjust_lr_fn="match_rms_adamw")
    ours = Muon([fused], lr=0.05, adjust_lr_fn="match_rms_adamw", ns_dtype="bfloat16")
    m = matrix_of(fused, (12, 8), 1, 0, 0, 0)
    assert m.part_shapes() == [(6, 8), (3, 8), (3, 8)]
    assert lr_segments(m, 1) == [(0, 48, (6, 8)), (48, 72, (3, 8)), (72, 96, (3, 8))]
    for g in grads:
        for p, gp in zip(sep, g.split(parts)):
            p.grad = gp.clone()
        fused.grad = g.clone()
        t.step()
        _plain_fused_step(ours, fused)
    assert torch.equal(fused.detach(), torch.cat([p.detach() for p in sep]))


def _plain_fused_step(opt, p):
    """The engine runs fused weights through the ZeRO path; here: its building blocks."""
    from engine.optim.muon_exchange import orthogonalize_full
    from engine.optim.newton_schulz import adjusted_lr

    group = opt.param_groups[0]
    upd = opt._blend(p, group)
    m = matrix_of(p, tuple(p.shape), 1, 0, 0, 0)
    o = orthogonalize_full(upd, m, opt._ns(group), opt._stats).reshape(-1)
    p.data.mul_(1 - group["lr"] * group["weight_decay"])
    for a, b, shape in lr_segments(m, 1):
        p.data.view(-1)[a:b].add_(o[a:b], alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], shape))


def test_owner_assignment_balances_flops_and_is_deterministic():
    mats = [MuonMatrix(0, 0, i, (r, c), (r, c), None, (r,)) for i, (r, c) in
            enumerate([(64, 64), (64, 256), (256, 64), (32, 32), (128, 128), (8, 8)])]
    a = assign_owners(mats, 2, 2, 5)
    assert a == assign_owners(mats, 2, 2, 5)
    load = [0] * 4
    for m in a:
        load[m.dp_owner * 2 + m.tp_owner] += m.flops(5)
    assert max(load) <= max(m.flops(5) for m in mats) + min(load)  # greedy bound
    assert len({(m.dp_owner, m.tp_owner) for m in a}) == 4


def test_assignment_rule_and_overrides():
    net = _Net()
    names = {id(p): n for n, p in net.named_parameters()}
    groups = split_muon_groups(net, net)
    assert sorted(names[id(p)] for p in groups[0]["params"]) == ["down.weight", "up.weight"]
    groups = split_muon_groups(net, net, adam_patterns=["down.*"])
    assert [names[id(p)] for p in groups[0]["params"]] == ["up.weight"]
    with pytest.raises(ValueError, match="both"):
        split_muon_groups(net, net, muon_patterns=["up.*"], adam_patterns=["up.weight"])
    with pytest.raises(ValueError, match="not a 2-D matrix"):
        split_muon_groups(net, net, muon_patterns=["up.bias"])
    with pytest.raises(ValueError, match="embedding"):
        uses_muon("embed.weight", net.embed.weight, net.embed, False, muon_patterns=["embed.*"])


def test_assignment_uses_the_whole_shape_of_a_zero3_partitioned_parameter():
    """ZeRO-3 builds the model under engine.zero.Init: a parameter is a 1-D shard (ds_shape
    holds its shape) when the groups are split; a matrix must still go to Muon, or a
    checkpoint's per-group states (momentum vs. AdamW moments) no longer match on reload."""
    net = _Net()
    w = net.up.weight
    shape = w.shape
    w.data = w.data.reshape(-1)[: w.numel() // 2].clone()   # what Init leaves: this rank's flat shard
    w.ds_tensor, w.ds_shape, w.ds_numel = w.data, shape, shape.numel()
    assert uses_muon("up.weight", w, net.up, False)
    assert uses_muon("up.weight", w, net.up, False, muon_patterns=["up.*"])


def _cfg(params):
    return {"train_batch_size": 2, "optimizer": {"type": "muon", "params": params}}


def test_config_keys():
    c = load_config(_cfg({"lr": 0.02, "adam_lr": 3e-4, "momentum": 0.9, "weight_decay": 0.1, "betas": [0.8, 0.95],
                          "ns_steps": 6, "adjust_lr_fn": "match_rms_adamw", "ns_dtype": "float32",
                          "ns_method": "standard", "adam_w_mode": True, "muon_params": ["layers.*"]}),
                    world_size=1)
    p = c.optimizer.params
    assert c.optimizer.type == "Muon" and p.adam_lr == 3e-4 and p.muon_lr is None and p.ns_steps == 6
    assert p.muon_params == ("layers.*",) and p.ns_dtype == "float32"
    for bad, msg in [({"lr": 0.02, "ns_method": "gram"}, "ns_method"), ({"momentum2": 0.9}, "momentum2"),
                     ({"adam_w_mode": False}, "adam_w_mode"), ({"per_head_muon": True}, "per_head_muon"),
                     ({"ns_dtype": "fp8"}, "ns_dtype"), ({"ns_coefficients": [1, 2]}, "ns_coefficients"),
                     ({"torch_adam": True}, "torch_adam")]:
        with pytest.raises(ConfigError, match=msg):
            load_config(_cfg(bad), world_size=1)


def test_muon_group_requires_matrices_in_plain_mode():
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="not a matrix"):
        Muon([p]).step()
