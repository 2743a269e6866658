"""The context_parallel section and DeepSpeed's sequence_parallel_size: what they resolve to,
and every impossible combination refused by name, before any rank starts (pure)."""

from __future__ import annotations

import pytest

from engine.config import ConfigError, load_config

MODEL = {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "seq_len": 64}


def _load(world=4, model=None, **top):
    return load_config({"train_batch_size": 8, "model": dict(MODEL, **(model or {})), **top}, world_size=world)


def test_defaults_and_resolution():
    cfg = _load(world=1)
    assert cfg.cp == 1 and cfg.context_parallel.size == 1 and cfg.topology.cp == 1
    cfg = _load(context_parallel={"size": 2})
    assert (cfg.context_parallel.mode, cfg.context_parallel.ulysses_size) == ("ring", 1)
    assert (cfg.dp, cfg.cp, cfg.train_micro_batch_size_per_gpu) == (2, 2, 4)  # the batch divides over dp only
    cfg = _load(context_parallel={"size": 4, "mode": "ulysses"})
    assert cfg.context_parallel.ulysses_size == 4 and cfg.dp == 1
    cfg = _load(context_parallel={"size": 4, "mode": "hybrid", "ulysses_size": 2})
    assert cfg.context_parallel.ulysses_size == 2
    assert cfg.to_dict()["context_parallel"] == {"size": 4, "mode": "hybrid", "ulysses_size": 2}


def test_sequence_parallel_size_is_ulysses():
    cfg = _load(sequence_parallel_size=4)
    assert (cfg.cp, cfg.context_parallel.mode, cfg.context_parallel.ulysses_size) == (4, "ulysses", 4)
    same = _load(sequence_parallel_size=2, context_parallel={"size": 2, "mode": "ulysses"})
    assert same.context_parallel.mode == "ulysses"
    assert _load(world=1, sequence_parallel_size=1).cp == 1
    for cp in ({"size": 4}, {"size": 2, "mode": "ring"}, {"size": 1}):
        with pytest.raises(ConfigError, match="sequence_parallel_size = 2 .* disagrees with context_parallel"):
            _load(sequence_parallel_size=2, context_parallel=cp)


@pytest.mark.parametrize("top,world,model,match", [
    ({"context_parallel": {"size": 3}}, 4, None, "not divisible by tensor_parallel.autotp_size .* context_parallel.size"),
    ({"context_parallel": {"size": 0}}, 4, None, "context_parallel.size"),
    ({"context_parallel": {"size": 2, "mode": "zigzag"}}, 4, None, "context_parallel.mode must be one of"),
    ({"context_parallel": {"size": 2, "extra": 1}}, 4, None, "extra"),
    ({"context_parallel": {"size": 2, "ulysses_size": 2}}, 4, None, "ulysses_size is 2 but mode is \"ring\""),
    ({"context_parallel": {"size": 4, "mode": "ulysses", "ulysses_size": 2}}, 4, None, "set mode \"hybrid\""),
    ({"context_parallel": {"size": 4, "mode": "hybrid"}}, 4, None, "ulysses_size is required"),
    ({"context_parallel": {"size": 4, "mode": "hybrid", "ulysses_size": 4}}, 4, None, "strictly between 1 and 4"),
    ({"context_parallel": {"size": 1, "ulysses_size": 2}}, 4, None, "context_parallel.size is 1"),
    ({"context_parallel": {"size": 4}}, 4, {"seq_len": 36}, "seq_len = 36 is not divisible by 2 x context_parallel"),
    ({"context_parallel": {"size": 2}, "tensor_parallel": {"autotp_size": 4, "sequence_parallel": True}}, 8,
     {"seq_len": 20}, "make seq_len a multiple of 8"),
    ({"context_parallel": {"size": 4, "mode": "ulysses"}}, 4, {"num_heads": 2}, "use mode \"ring\""),
    ({"sequence_parallel_size": 4}, 4, {"num_heads": 2}, "use mode \"ring\""),
    ({"context_parallel": {"size": 4, "mode": "ulysses"}}, 4, {"num_heads": 6, "hidden_size": 48,
                                                               "num_kv_heads": 3}, "query heads|KV heads"),
])
def test_impossible_combinations_name_the_key_and_the_fix(top, world, model, match):
    with pytest.raises(ConfigError, match=match):
        _load(world=world, model=model, **top)


def test_one_kv_head_is_fine_for_ulysses():
    assert _load(context_parallel={"size": 4, "mode": "ulysses"}, model={"num_kv_heads": 1}).cp == 4
