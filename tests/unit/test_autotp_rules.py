"""AutoTP's rule table and refusals, without processes: spec parsing (DeepSpeed's
``partition_config`` form), family lookup, and the grouped-query attention policy."""

import pytest

from engine.tensor_parallel.auto import HeadCounts, _check_heads
from engine.tensor_parallel.auto_rules import FAMILY_OF, PRESETS, parse_layer_specs, specs_for
from engine.tensor_parallel.hf_load import local_ranges


def test_every_family_has_column_and_row_rules():
    for model_type, preset in FAMILY_OF.items():
        kinds = {s.partition_type for s in PRESETS[preset]}
        assert kinds == {"column", "row"}, model_type


def test_user_specs_come_first_and_replicate_is_skip():
    user = parse_layer_specs([{"patterns": [r".*\.mlp\..*"], "partition_type": "replicate"}])
    specs = specs_for("qwen2", None, user, True)
    first = next(s for s in specs if s.matches("model.layers.0.mlp.down_proj.weight"))
    assert first.partition_type == "skip"
    assert next(s for s in specs if s.matches("model.layers.3.self_attn.o_proj.weight")).partition_type == "row"
    assert parse_layer_specs([{"patterns": "x", "shape": [[4, 2, 2], -1]}])[0].fused == (4, 2, 2)


@pytest.mark.parametrize("raw, msg", [
    ({"patterns": ["(x"]}, "not a valid regex"),
    ({"patterns": ["x"], "partition_type": "diagonal"}, "column, row or skip"),
    ({"patterns": ["x"], "partition_type": "row", "shape": [2, -1]}, "column-parallel layers only"),
    ({"patterns": ["x"], "shape": [2, 3, -1]}, "only [k, -1]"),
    ({"patterns": ["x"], "bogus": 1}, "unknown keys"),
])
def test_bad_layer_specs_are_named(raw, msg):
    with pytest.raises(ValueError, match=msg.replace("[", r"\[")):
        parse_layer_specs([raw])


def test_unknown_family_without_specs_is_refused():
    with pytest.raises(ValueError, match="no rules for model_type 'bloom'"):
        specs_for("bloom", None, (), True)
    with pytest.raises(ValueError, match="not one of"):
        specs_for("llama", "nope", (), True)


def test_gqa_policy():
    assert _check_heads(HeadCounts(8, 4, 16), 2, []) is False          # KV heads split
    assert _check_heads(HeadCounts(8, 2, 16), 4, []) is True           # replicated: one KV head per rank
    with pytest.raises(ValueError, match="neither split"):
        _check_heads(HeadCounts(12, 3, 16), 2, [])
    with pytest.raises(ValueError, match="not divisible"):
        _check_heads(HeadCounts(6, 6, 16), 4, [])
    fused = parse_layer_specs([{"patterns": "x"}])[0].__class__((("x",)), "column", "qkv")
    with pytest.raises(ValueError, match="fused qkv"):
        _check_heads(HeadCounts(8, 2, 16), 4, [fused])


def test_local_ranges_follow_fused_parts():
    assert local_ranges(12, 1, 2, None) == [(6, 12)]
    assert local_ranges(16, 1, 2, (8, 4, 4)) == [(4, 8), (10, 12), (14, 16)]
    with pytest.raises(ValueError, match="not divisible"):
        local_ranges(10, 0, 4, None)


def test_config_specs_reach_the_engine_and_unknown_models_are_a_config_error():
    import torch.nn as nn

    from engine.assembly.autotp import layer_specs_of
    from engine.config import load_config
    from engine.errors import ConfigError

    base = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    cfg = load_config({**base, "tensor_parallel": {"autotp_size": 2, "partition_config": {
        "layer_specs": [{"patterns": [r".*\.fc\.weight$"], "partition_type": "row"}]}}}, world_size=2)
    specs = layer_specs_of(cfg, nn.Linear(2, 2))            # no model_type: user specs only
    assert [s.partition_type for s in specs] == ["row"]
    bare = load_config({**base, "tensor_parallel": {"autotp_size": 2}}, world_size=2)
    with pytest.raises(ConfigError, match="no rules for model_type None"):
        layer_specs_of(bare, nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="vocab_parallel_lm_head"):
        load_config({**base, "tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": True}}, world_size=2)
