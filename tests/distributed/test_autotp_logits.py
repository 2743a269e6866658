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
    from _autotp_models import batch, build

    from engine.tensor_parallel.auto import autotp
    from engine.tensor_parallel.auto_rules import specs_for

    out = {}
    for fam in FAMILIES:
        ref = build(fam).eval()
        model = build(fam).eval()
        specs = specs_for(model.config.model_type, None, (), True)
        res = autotp(model, dist.group.WORLD, specs)
        ids = batch(0)
        with torch.no_grad():
            want = ref(ids).logits
            got = model(ids).logits
        out[fam] = ((got - want).abs().max().item(), sorted(set(res.replaced.values())),
                    sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in ref.parameters()))
        if fam == "gpt2":  # the tied embedding stays tied
            out["gpt2_tied"] = model.lm_head.weight is model.transformer.wte.weight
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_autotp_logits_equal_unsharded(tp):
    results = run_ranks(_logits_worker, tp, timeout=240)
    for r in results:
        for fam in FAMILIES:
            err, modes, smaller = r[fam]
            assert err <= 1e-6, (fam, tp, err)
            assert smaller and "column" in modes and "row" in modes, (fam, modes)
        assert r["gpt2_tied"]
    # Llama has 2 KV heads: split at TP 2, replicated (one KV head per rank) at TP 4
    assert ("kv_replicated" in results[0]["llama"][1]) == (tp == 4)
