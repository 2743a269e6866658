"""AutoTP on Hugging Face decoders: the sharded model's logits equal the unsharded
model's at TP = 2 and 4, fp32, on gloo (one spawned group per TP size, every family in it).

Tolerance 1e-6 absolute on logits of magnitude ~0.1-1: the only difference is the order
of the row-parallel sums (a few ulp); a wrong fused-part order, a missed transpose, a
wrong head count or KV-head choice changes logits at the 1e-2 level.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

pytest.importorskip("transformers")

FAMILIES = ("llama", "qwen2", "gpt2", "gpt_neox", "phi3")


def _logits_worker(rank, world):
    """TP 4 over the 4 ranks, then TP 2 over ranks {0, 1} and {2, 3}: one spawn for both."""
    from _autotp_models import batch, build

    from engine.distributed.groups import AxisGroup
    from engine.tensor_parallel.auto import autotp
    from engine.tensor_parallel.auto_rules import specs_for

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out = {}
    for tp, group in ((4, AxisGroup.world()), (2, AxisGroup.of(pairs[rank // 2], "tp"))):
        for fam in FAMILIES:
            ref = build(fam).eval()
            model = build(fam).eval()
            res = autotp(model, group, specs_for(model.config.model_type, None, (), True))
            ids = batch(0)
            with torch.no_grad():
                err = (model(ids).logits - ref(ids).logits).abs().max().item()
            smaller = sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in ref.parameters())
            out[tp, fam] = (err, sorted(set(res.replaced.values())), smaller)
            if fam == "gpt2":  # the tied embedding stays tied
                out[tp, "gpt2_tied"] = model.lm_head.weight is model.transformer.wte.weight
    out["user"] = _user_patterns(AxisGroup.of(pairs[rank // 2], "tp"))
    return out


class _Custom(torch.nn.Module):
    """A model no rule knows: a two-layer MLP block with a gated (fused) input layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.fc_in = torch.nn.Linear(16, 2 * 24)   # packed [gate; up]
        self.fc_out = torch.nn.Linear(24, 16)

    def forward(self, x):
        gate, up = self.fc_in(x).chunk(2, dim=-1)
        return self.fc_out(torch.nn.functional.silu(gate) * up)


def _user_patterns(group):
    """User specs (DeepSpeed's partition_config form): a custom model split by regex with a
    fused shape, and a Llama whose MLP is kept replicated by a 'skip' spec before the preset."""
    from _autotp_models import batch, build

    from engine.tensor_parallel.auto import AutoTPLinear, autotp
    from engine.tensor_parallel.auto_rules import parse_layer_specs, specs_for

    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0))
    ref, model = _Custom(), _Custom()
    specs = parse_layer_specs([{"patterns": [r"fc_in\.weight$"], "partition_type": "column", "shape": [2, -1]},
                               {"patterns": [r"fc_out\.weight$"], "partition_type": "row"}])
    autotp(model, group, specs_for(None, None, specs, False))
    with torch.no_grad():
        custom_err = (model(x) - ref(x)).abs().max().item()
    ref, llama = build("llama").eval(), build("llama").eval()
    skip = parse_layer_specs([{"patterns": [r".*\.mlp\..*"], "partition_type": "replicate"}])
    res = autotp(llama, group, specs_for("llama", None, skip, True))
    with torch.no_grad():
        llama_err = (llama(batch(0)).logits - ref(batch(0)).logits).abs().max().item()
    mlp_whole = not any(isinstance(m, AutoTPLinear) for n, m in llama.named_modules() if ".mlp." in n)
    return custom_err, llama_err, mlp_whole, sorted(res.replaced)[:1]


def test_autotp_logits_equal_unsharded_tp2_tp4():
    results = run_ranks(_logits_worker, 4, timeout=300)
    for r in results:
        for tp in (2, 4):
            for fam in FAMILIES:
                err, modes, smaller = r[tp, fam]
                assert err <= 1e-6, (fam, tp, err)
                assert smaller and "column" in modes and "row" in modes, (fam, tp, modes)
            assert r[tp, "gpt2_tied"]
            # Llama has 2 KV heads: split at TP 2, replicated (one KV head per rank) at TP 4
            assert ("kv_replicated" in r[tp, "llama"][1]) == (tp == 4)
        custom_err, llama_err, mlp_whole, first = r["user"]
        assert custom_err <= 1e-6 and llama_err <= 1e-6 and mlp_whole, r["user"]
        assert first == ["model.layers.0.self_attn.k_proj"]
