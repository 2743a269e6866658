"""Our DeepSpeed-named sections use DeepSpeed's key names and defaults (checked against DeepSpeed's own
pydantic models, which forbid unknown keys)."""

from __future__ import annotations

import pytest

from engine.config import BF16Config, FP16Config, ZeroConfig, load_config

ds_zero = pytest.importorskip("deepspeed.runtime.zero.config", reason="deepspeed is an optional test dependency")
ds_precision = pytest.importorskip("deepspeed.runtime.precision_config")

MODEL = {"vocab_size": 256, "hidden_size": 64, "num_layers": 4, "num_heads": 4, "seq_len": 32}


def _ds_default(model_cls, json_key: str):
    for name, field in model_cls.model_fields.items():
        if json_key in (name, field.alias):
            return field.default
    raise AssertionError(f"DeepSpeed has no key {json_key}")


def test_zero_keys_and_defaults_match_deepspeed():
    # the one deliberate difference (docs/config.md): DeepSpeed's 1e9 keeps every parameter of a
    # model under 1e9 elements gathered from its forward to its backward; ours releases after use
    different = {"stage3_max_reuse_distance": (1_000_000_000, 0)}
    for key, ours in ZeroConfig().to_dict().items():
        if key == "overlap_comm":
            continue  # DeepSpeed's default is dynamic (stage 3: true); checked below
        if key in different:
            assert (_ds_default(ds_zero.DeepSpeedZeroConfig, key), ours) == different[key], key
            continue
        assert _ds_default(ds_zero.DeepSpeedZeroConfig, key) == ours, key
    for stage in range(4):
        ds = ds_zero.DeepSpeedZeroConfig(stage=stage)
        cfg = load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam"}, "model": MODEL,
                           "zero_optimization": {"stage": stage}}, world_size=1)
        assert cfg.zero.overlap_comm == ds.overlap_comm
        # DeepSpeed accepts the resolved section as it is (its models forbid unknown keys).
        ds_zero.DeepSpeedZeroConfig(**cfg.zero.to_dict())


def test_fp16_keys_and_defaults_match_deepspeed():
    for key, ours in FP16Config().to_dict().items():
        assert _ds_default(ds_precision.DeepSpeedFP16Config, key) == ours, key
    ds_precision.DeepSpeedFP16Config(**FP16Config(enabled=True, loss_scale=8.0).to_dict())
    for key, ours in BF16Config().to_dict().items():
        assert _ds_default(ds_precision.DeepSpeedBF16Config, key) == ours, key
    ds_precision.DeepSpeedBF16Config(**BF16Config(enabled=True, check_grad_overflow=False).to_dict())
