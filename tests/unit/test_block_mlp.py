"""The block's MLP is a choice (engine/models/blocks.py MLPS, ``model.mlp``): the default
keeps the reference model's names, init and config dicts; another factory is used as given."""

import pytest
import torch
import torch.nn as nn

from engine.distributed.groups import NO_TP
from engine.errors import ConfigError
from engine.models import GPT, ModelConfig
from engine.models.blocks import MLPS, Block, RotaryEmbedding, SwiGLU, mlp_factory
from engine.models.config import DEFAULT_MLP, MLP_KINDS

BASE = dict(vocab_size=101, hidden_size=32, num_layers=2, num_heads=4, seq_len=16)


def test_registry_matches_the_config_names():
    assert set(MLPS) == set(MLP_KINDS) and DEFAULT_MLP == "swiglu"
    assert mlp_factory("swiglu") is SwiGLU and mlp_factory(SwiGLU) is SwiGLU
    with pytest.raises(ConfigError, match="model.mlp"):
        mlp_factory("nope")


def test_config_without_the_key_is_swiglu_and_its_dict_unchanged():
    cfg = ModelConfig.from_dict(dict(BASE))              # an old config / checkpoint's model section
    assert cfg.mlp == "swiglu" and "mlp" not in cfg.to_dict()
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg == ModelConfig.from_dict({**BASE, "mlp": "swiglu"})
    with pytest.raises(ConfigError, match="model.mlp"):
        ModelConfig.from_dict({**BASE, "mlp": "moe"})    # not yet: the expert-parallel issue adds it


def test_default_block_is_swiglu_with_the_same_names_and_init():
    cfg = ModelConfig(**BASE)
    rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.seq_len)
    default = Block(cfg, 1, NO_TP, False, 7, rotary)
    named = Block(cfg, 1, NO_TP, False, 7, rotary, mlp="swiglu")
    assert isinstance(default.mlp, SwiGLU)
    a, b = dict(default.named_parameters()), dict(named.named_parameters())
    assert list(a) == list(b) == ["attn_norm.weight", "attn.qkv.weight", "attn.proj.weight", "mlp_norm.weight",
                                  "mlp.gate_up.weight", "mlp.down.weight"]
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert torch.equal(GPT(cfg, seed=7).layers[2].mlp.gate_up.weight, default.mlp.gate_up.weight)


def test_a_factory_is_used_as_given():
    made = []

    def tiny(cfg, layer, tp_group, sequence_parallel, seed, device=None, dtype=None, *, fp8_recipe=None):
        made.append(layer)
        return nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    cfg = ModelConfig(**BASE)
    block = Block(cfg, 0, NO_TP, False, 7, RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.seq_len), mlp=tiny)
    assert made == [0] and isinstance(block.mlp, nn.Linear)
    x = torch.randn(2, cfg.seq_len, cfg.hidden_size)
    assert block(x).shape == x.shape
