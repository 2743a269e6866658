"""The checkpoint boundary's pure parts (no processes):

- :class:`CheckpointMetadata` round-trips through its JSON exactly, reads a version-1
  document (no ``fp8`` entry) and names a missing entry;
- an FP8 layer's scaling state round-trips exactly through ``state_dict`` /
  ``load_state_dict`` (after real updates, so histories and scales are non-trivial), and a
  history of another length keeps its most recent entries;
- engine/checkpoint/ takes no ``engine: Any``, writes no engine counter and reaches into no
  private state of ZeRO or the engine (a source scan, so a regression is caught here).
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from engine.checkpoint.format import (
    CheckpointError,
    CheckpointMetadata,
    FileRecord,
    Fragment,
    OptimizerRecord,
    ParamRecord,
    SavedTopology,
    TPSlice,
)
from engine.precision.fp8 import Fp8LinearState, Fp8Recipe, update_fp8_scales

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _meta(version: int = 2) -> CheckpointMetadata:
    frag = Fragment("shard_pp000_tp000_dp0000.safetensors", 0, 8, 24, 0, (4, 6), TPSlice(0, 0, 2, None, None))
    return CheckpointMetadata(
        tag="global_step3", topology=SavedTopology(2, 2, 1, 4, 1, 1), config={"model": {"hidden_size": 6}},
        training={"counters": {"global_steps": 3, "global_samples": 24, "micro_steps": 12, "skipped_steps": 0},
                  "data_position": {"global_steps": 3, "consumed_samples": 24}, "lr_scheduler": {"last_epoch": 3},
                  "lr_scheduler_groups": [0, 0], "loss_scaler": {"scale": 1.0}},
        optimizer=OptimizerRecord("AdamW", {"0": {"lr": 1e-3, "betas": [0.9, 0.95]}}, ["exp_avg", "exp_avg_sq"],
                                  {"0": {"step": {"value": 3.0, "dtype": "float32"}}}),
        params={"layers.0.w": ParamRecord((8, 6), (frag,))}, aliases={"layers.2.w": "layers.0.w"},
        files={frag.file: FileRecord("ab" * 32, 1234, 0, {"pp": 0, "tp": 0, "dp": 0})},
        rng={"0": {"python": [3]}}, fp8={"layers.1.attn": {"input": {"scale": 2.0, "amax_history": [1.0]}}}
        if version >= 2 else None,
        engine_version="0.1", torch_version="2", time=1.5, format_version=version)


def test_metadata_round_trips_through_json():
    meta = _meta()
    doc = json.loads(json.dumps(meta.to_json()))
    assert CheckpointMetadata.from_json(doc) == meta
    assert doc["counters"]["global_steps"] == 3 and doc["optimizer"]["class"] == "AdamW"   # the version-1 keys
    assert meta.global_steps == 3


def test_a_version_1_document_has_no_fp8_state():
    doc = _meta(1).to_json()
    assert "fp8" not in doc
    assert CheckpointMetadata.from_json(doc).fp8 is None


def test_a_missing_entry_is_named():
    doc = _meta().to_json()
    del doc["params"]
    with pytest.raises(CheckpointError, match="'params'"):
        CheckpointMetadata.from_json(doc, "ckpt/metadata.json")


def _trained_state(history: int) -> Fp8LinearState:
    st = Fp8LinearState(Fp8Recipe(amax_history_len=history))
    for step in range(3):
        for m in st.metas():
            m.record_amax(torch.tensor(0.5 + step + m.amax_history.numel() * 0.01))
        update_fp8_scales([st])
    return st


def test_fp8_state_round_trips_exactly():
    st = _trained_state(4)
    sd = json.loads(json.dumps(st.state_dict()))
    fresh = Fp8LinearState(Fp8Recipe(amax_history_len=4))
    fresh.load_state_dict(sd)
    for a, b in zip(st.metas(), fresh.metas()):
        assert torch.equal(a.scale, b.scale) and torch.equal(a.amax_history, b.amax_history)
        assert a.scale.item() != 1.0 and bool((a.amax_history[1:] > 0).any())


def test_fp8_history_of_another_length_keeps_the_most_recent():
    sd = _trained_state(4).state_dict()
    short = Fp8LinearState(Fp8Recipe(amax_history_len=2))
    short.load_state_dict(sd)
    long = Fp8LinearState(Fp8Recipe(amax_history_len=6))
    long.load_state_dict(sd)
    saved = sd["input"]["amax_history"]
    assert short.input.amax_history.tolist() == saved[:2]
    assert long.input.amax_history.tolist() == saved + [0.0, 0.0]
    with pytest.raises(ValueError, match="grad_output"):
        short.load_state_dict({"input": sd["input"], "weight": sd["weight"]})


def test_the_checkpoint_package_touches_only_typed_boundaries():
    folder = os.path.join(ROOT, "engine", "checkpoint")
    bad = {
        "engine: Any": re.compile(r"\bengine\s*:\s*Any\b"),
        "the inner optimizer": re.compile(r"\.optimizer\.(optimizer|groups|buckets|state)\b"),
        "an engine counter written": re.compile(r"\bengine\.(global_steps|global_samples|micro_steps)\s*=[^=]"),
        "a private attribute of another object": re.compile(r"\b(?!self\b)[a-z_]\w*\._[a-z]\w*"),
    }
    found = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                code = line.split("#", 1)[0]
                for what, rx in bad.items():
                    m = rx.search(code)
                    if m and not m.group(0).startswith(("torch._", "_engine_pkg")):
                        found.append(f"{name}:{i}: {what}: {line.strip()}")
    assert not found, "\n".join(found)
