"""The Hugging Face context-parallel adapter's refusals (engine/context_parallel/hf.py), without
processes: at initialize (engine.assembly.initialize._check_cp_model, a ConfigError naming the
key) and at the forward (the pre-hook, a ValueError naming the input)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

pytest.importorskip("transformers")

from engine.assembly.initialize import _check_cp_model  # noqa: E402
from engine.config import load_config  # noqa: E402
from engine.context_parallel.hf import _Adapter, is_hf_model  # noqa: E402
from engine.context_parallel.layout import CPLayout  # noqa: E402
from engine.distributed.groups import AxisGroup  # noqa: E402
from engine.errors import ConfigError  # noqa: E402


def _llama(heads: int = 4, kv: int = 2, dropout: float = 0.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=8 * heads, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv,
                                        attention_dropout=dropout))


def _cfg(world: int, **top):
    return load_config({"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, **top}, world_size=world)


def test_supported_models_pass_and_others_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    _check_cp_model(_cfg(2, sequence_parallel_size=2), _llama(), None)
    _check_cp_model(_cfg(4, context_parallel={"size": 4, "mode": "ring"}), _llama(heads=3, kv=1), None)
    assert is_hf_model(_llama()) and not is_hf_model(nn.Linear(2, 2))
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(ConfigError, match="sequence_parallel_size.*'gpt2'.*not supported.*llama"):
        _check_cp_model(_cfg(2, sequence_parallel_size=2), gpt2, None)
    with pytest.raises(ConfigError, match="Linear has its own attention"):
        _check_cp_model(_cfg(2, sequence_parallel_size=2), nn.Linear(2, 2), None)


def test_impossible_layouts_name_the_key_and_the_fix():
    with pytest.raises(ConfigError, match="num_attention_heads = 3, not divisible by 2.*\"ring\""):
        _check_cp_model(_cfg(2, sequence_parallel_size=2), _llama(heads=3, kv=1), None)
    with pytest.raises(ConfigError, match="num_key_value_heads = 3 neither divides"):
        _check_cp_model(_cfg(2, sequence_parallel_size=2), _llama(heads=6, kv=3), None)
    with pytest.raises(ConfigError, match="autotp_size.*to 1"):
        _check_cp_model(_cfg(4, sequence_parallel_size=2, tensor_parallel={"autotp_size": 2}), _llama(), None)
    with pytest.raises(ConfigError, match="attention_dropout = 0.1"):
        _check_cp_model(_cfg(2, sequence_parallel_size=2), _llama(dropout=0.1), None)
    with pytest.raises(ConfigError, match="custom loss_fn"):
        _check_cp_model(_cfg(2, sequence_parallel_size=2), _llama(), lambda o, t: o.sum())


def test_forward_inputs_it_cannot_shard_are_refused():
    one = AxisGroup.single("cp")
    adapter = _Adapter(CPLayout("ring", 2, 0, 1, one, None), one)
    ids = torch.randint(0, 64, (2, 8))
    ok = adapter.before(None, (ids,), {"labels": ids})[1]          # rank 0 of 2: head-tail chunks 0 and 3
    assert ok["input_ids"].tolist() == ids[:, [0, 1, 6, 7]].tolist()
    assert ok["position_ids"].tolist() == [[0, 1, 6, 7]] * 2 and "labels" not in ok
    assert adapter.labels is not None and adapter.labels.tolist() == [r[[1, 2, 7]].tolist() + [-100] for r in ids]
    bad = [({"input_ids": ids, "attention_mask": torch.tensor([[1] * 7 + [0]] * 2)}, "padding masks"),
           ({"input_ids": ids, "position_ids": torch.arange(8).flip(0)[None]}, "packed documents"),
           ({"input_ids": ids, "use_cache": True}, "use_cache"),
           ({"input_ids": ids, "labels": ids, "shift_labels": ids}, "not both"),
           ({"input_ids": ids, "labels": ids[:, :4]}, "whole sequence"),
           ({"input_ids": ids[:, :6]}, "not divisible by 2 x context_parallel.size = 4")]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            adapter.before(None, (), kwargs)
