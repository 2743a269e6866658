"""The distributed smoke subset once more as on an older torch: every newer-only API that
:mod:`engine.torch_api` knows is removed from torch inside the ranks (as on the GPU
image's torch 2.11, which lacks ``dist.reduce_scatter_single`` / ``dist.all_gather_single``),
so a call that bypasses the fallbacks fails here instead of on a GPU machine.

Covered: ZeRO 0-3 at DP 4 (reduce-scatter over 4 ranks, the non-owner path), TP 2 with
sequence parallelism under ZeRO-3, PP 2 with ZeRO-1, Muon with ZeRO-1, and a
checkpoint save/resume. Each layout's per-step losses equal one process's within the
same tolerance as test_train_entry.py (fp32 summation order only: 2e-6 relative).
"""

from __future__ import annotations

import copy
import os
import re

import pytest
from harness import run_ranks
from test_train_entry import RTOL, cache_dir, tiny_config  # noqa: F401 (fixture)

from engine import torch_api

pytestmark = pytest.mark.slow  # two 4-rank runs on 2 cores

# Steps per layout: step 1 already runs every collective and fallback of a layout, step 2 the
# optimizer with state (and, in the first layout, a resume from the checkpoint after step 2);
# 4 keep the run short (test_train_entry.py runs the same layouts 8 steps against one process)
STEPS = 4


def test_newer_only_apis_are_hidden_by_the_environment(monkeypatch):
    monkeypatch.setenv("ENGINE_HIDE_NEWER_TORCH", "1")
    assert not any(torch_api.available(n) for n in torch_api.NEWER_ONLY)
    monkeypatch.setenv("ENGINE_HIDE_NEWER_TORCH", "0")
    for name, (module, attr) in torch_api.NEWER_ONLY.items():
        assert torch_api.available(name) == hasattr(module, attr)


def test_engine_calls_newer_only_apis_only_through_torch_api():
    """Static guard: no module but engine/torch_api.py names a newer-only attribute."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "engine")
    offenders = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py") and f != "torch_api.py":
                text = open(os.path.join(dirpath, f)).read()
                offenders += [f"{f}: {attr}" for _, attr in torch_api.NEWER_ONLY.values()
                              if re.search(rf"(?<!torch_api)\.{attr}\b", text)]
    assert not offenders, offenders


def _muon(c: dict) -> dict:
    c = copy.deepcopy(c)
    c["optimizer"] = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 3e-3, "weight_decay": 0.1, "ns_dtype": "float32"}}
    return c


def _run(rank, world, configs, hide, save_dir=None):
    import torch.distributed as dist

    import engine
    from engine.config import load_config
    from engine.training.trainer import build_data, train

    if hide:  # as on torch 2.11: the attributes do not exist at all
        for module, attr in torch_api.NEWER_ONLY.values():
            if hasattr(module, attr):
                delattr(module, attr)
    assert dist.is_initialized()
    out = []
    for i, c in enumerate(configs):
        cfg = load_config(c, world_size=world)
        _, sampler = build_data(cfg)
        eng, *_ = engine.initialize(config=cfg)
        if save_dir is not None and i == 0:  # half the steps, save, resume in a fresh engine
            first = [r["loss"] for r in train(eng, sampler, STEPS // 2, output_dir=None)]
            eng.save_checkpoint(save_dir, tag="half")
            eng, *_ = engine.initialize(config=cfg)
            eng.load_checkpoint(save_dir, tag="half")
            out.append(first + [r["loss"] for r in train(eng, sampler, STEPS - STEPS // 2, output_dir=None)])
            continue
        out.append([r["loss"] for r in train(eng, sampler, STEPS, output_dir=None)])
    return out


@pytest.mark.timeout(900)
def test_smoke_subset_without_newer_torch_apis(cache_dir, tmp_path):  # noqa: F811
    base = [tiny_config(cache_dir, dp=4, zero=z) for z in range(4)]
    more = [tiny_config(cache_dir, dp=2, tp=2, sp=True, zero=3), tiny_config(cache_dir, dp=2, pp=2, zero=1),
            _muon(tiny_config(cache_dir, dp=4, zero=1))]
    ref, ref_muon = run_ranks(_run, 1, [tiny_config(cache_dir), _muon(tiny_config(cache_dir))], False,
                              timeout=300)[0]
    got = run_ranks(_run, 4, base + more, True, str(tmp_path / "ck"), timeout=900,
                    env={"ENGINE_HIDE_NEWER_TORCH": "1"})[0]
    for losses, want in zip(got, [ref] * 6 + [ref_muon]):
        assert len(losses) == len(want) == STEPS
        for a, b in zip(losses, want):
            assert abs(a - b) <= RTOL * abs(b), (losses, want)
