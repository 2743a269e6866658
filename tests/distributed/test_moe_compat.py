"""``engine.compat.deepspeed.moe`` against the installed DeepSpeed 0.19.8 on CPU, fp32.

DeepSpeed's ``MoE`` runs on CPU in one process once a (1-rank gloo) group exists. Both layers get
the same weights (the engine's loads DeepSpeed's state dict: the parameter names are the same)
and the same input; output, ``l_aux``, ``exp_counts``, the input gradient and every parameter
gradient of ``sum(y^2) + l_aux`` agree for top-1 and top-2, with and without dropping, and with
the residual MoE. The random parts are off (``use_rts=False``, ``top2_2nd_expert_sampling=False``,
no noisy gate): the two draw from different random streams. Tolerance: rtol 1e-5, atol 1e-5
(fp32 values of O(10); measured max differences ~4e-6, from DeepSpeed's dense einsum dispatch vs
our gathered rows). ``split_params_into_different_moe_groups_for_optimizer`` gives DeepSpeed's groups.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn
from harness import run_ranks

H = 16
CASES = [dict(k=1, drop_tokens=False), dict(k=2, drop_tokens=False), dict(k=2, drop_tokens=True),
         dict(k=1, drop_tokens=True), dict(k=2, drop_tokens=False, use_residual=True)]


def _pair(ds_cls, ours_cls, case):
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(H, 32), nn.GELU(), nn.Linear(32, H))
    kw = dict(hidden_size=H, expert=expert, num_experts=4, use_rts=False, top2_2nd_expert_sampling=False,
              min_capacity=0, capacity_factor=1.0, **case)
    ds, ours = ds_cls(**kw), ours_cls(**kw)
    torch.manual_seed(1)
    with torch.no_grad():  # distinct experts (both libraries start them as copies of one)
        for p in ds.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    ours.load_state_dict(ds.state_dict())
    return ds, ours


def _run(m, x):
    x = x.clone().requires_grad_(True)
    y, l_aux, counts = m(x)
    (y.pow(2).sum() + l_aux).backward()
    return y, l_aux, counts, x.grad, {n: p.grad for n, p in m.named_parameters()}


def check_against_deepspeed(rank, world):
    from deepspeed.moe.layer import MoE as DSMoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as ds_split

    from engine.compat.deepspeed.moe.layer import MoE
    from engine.compat.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

    def params(f):  # names, kinds and defaults (annotations are strings here, types there)
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]

    assert params(MoE.__init__) == params(DSMoE.__init__)
    assert params(MoE.forward) == params(DSMoE.forward)
    tol = dict(rtol=1e-5, atol=1e-5)
    for case in CASES:
        ds, ours = _pair(DSMoE, MoE, case)
        x = torch.randn(2, 8, H, generator=torch.Generator().manual_seed(2))
        a, b = _run(ds, x), _run(ours, x)
        named = [("output", b[0], a[0]), ("l_aux", b[1], a[1]), ("input grad", b[3], a[3])]
        assert set(a[4]) == set(b[4])
        named += [(f"{n} grad", b[4][n], a[4][n]) for n in a[4]]
        for what, got, want in named:
            torch.testing.assert_close(got, want, **tol, msg=f"{case} {what}")
        assert torch.equal(b[2].long(), a[2].long()), (case, b[2], a[2])
    # optimizer groups: the same split, group by group
    for m in (ds, ours):
        for p in m.parameters():
            p.grad = None
    groups = [split([{"params": list(m.parameters()), "name": "p", "lr": 0.1}], max_group_size=300)
              for m in (ds, ours)]
    shape = [[(g["name"], g.get("moe", False), g["lr"], [tuple(p.shape) for p in g["params"]]) for g in gs]
             for gs in groups]
    ref = ds_split([{"params": list(ds.parameters()), "name": "p", "lr": 0.1}], max_group_size=300)
    assert shape[1] == [(g["name"], g.get("moe", False), g["lr"], [tuple(p.shape) for p in g["params"]])
                        for g in ref], shape
    assert any(g.get("moe") for g in groups[1])
    return True


def test_compat_moe_matches_deepspeed():
    assert run_ranks(check_against_deepspeed, 1, timeout=240) == [True]
