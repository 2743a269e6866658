"""ZeRO-3 parameters used outside their module's forward, at DP = 2 on gloo, each equal to
ZeRO-0 (every parameter whole) over 3 AdamW steps:

- a tied head ``F.linear(x, self.emb.weight)`` in the parent's forward, found automatically
  (as DeepSpeed's ZeROOrderedDict does) and registered explicitly with DeepSpeed's
  ``register_external_parameter`` (the parent then owns the weight too: it is gathered in the
  parent's forward and backward, its gradient taken per use);
- ``nn.MultiheadAttention``, whose forward hands ``self.out_proj.weight`` to its functional
  form without calling ``out_proj`` (automatic).

Before, both crashed (``mat2 must be a matrix, got 1-D tensor``: the empty placeholder).
Tolerance: 1e-6 relative on losses of O(1): ZeRO-3 reduce-scatters where ZeRO-0 all-reduces
(another summation order, ~1e-7 per step); a missing gradient contribution moves them by 1e-2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from harness import run_ranks

V, H, S = 24, 16, 6


class Tied(nn.Module):
    def __init__(self, explicit: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.mix = nn.Linear(H, H)
        if explicit:
            from engine.zero import register_external_parameter
            register_external_parameter(self, self.emb.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.emb(ids)))
        logits = nn.functional.linear(h, self.emb.weight)  # the tied head: emb.weight outside emb's forward
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


class Attention(nn.Module):
    def __init__(self, explicit: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.attn = nn.MultiheadAttention(H, 2, batch_first=True)
        self.head = nn.Linear(H, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        y, _ = self.attn(x, x, x, need_weights=False)
        return nn.functional.cross_entropy(self.head(y).flatten(0, 1), ids.flatten())


def _losses(model_cls, explicit: bool, stage: int, rank: int) -> list[float]:
    import engine
    torch.manual_seed(0)
    model = model_cls(explicit)
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    out = []
    for step in range(3):
        ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(100 * step + rank))
        loss = eng(ids)
        eng.backward(loss)
        eng.step()
        out.append(float(loss))
    eng.destroy()
    return out


CASES = {"tied_auto": (Tied, False), "tied_explicit": (Tied, True), "mha_auto": (Attention, False)}


def _all(rank: int, world: int) -> dict:
    """ZeRO-3 of every case; ZeRO-0 once per model (registration changes nothing there)."""
    dense = {cls: _losses(cls, False, 0, rank) for cls in (Tied, Attention)}
    return {name: {0: dense[cls], 3: _losses(cls, explicit, 3, rank)} for name, (cls, explicit) in CASES.items()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_all, 2, timeout=240)


@pytest.mark.parametrize("case", list(CASES))
def test_external_parameter_at_zero3_equals_zero0(results, case):
    for r in results:
        assert r[case][3] == pytest.approx(r[case][0], rel=1e-6), case


def test_register_external_parameter_api():
    from engine.zero import register_external_parameter, unregister_external_parameter
    from engine.zero.external import external_parameters

    m = Tied(explicit=False)
    register_external_parameter(m, m.emb.weight)
    assert external_parameters(m) == [m.emb.weight]
    unregister_external_parameter(m, m.emb.weight)
    assert external_parameters(m) == []
    with pytest.raises(RuntimeError, match="not a registered external parameter"):
        unregister_external_parameter(m, m.emb.weight)
    with pytest.raises(RuntimeError, match="torch.nn.Parameter"):
        register_external_parameter(m, torch.zeros(2))
