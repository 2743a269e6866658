"""Unit tests of engine.moe's pieces (one process, no groups): the router, the sequence-wise
balancing loss and its gradient-accumulation invariance, the aux-free update, the capacity,
the grouped GEMM and the model.moe config errors."""

from __future__ import annotations

import pytest
import torch

from engine.errors import ConfigError
from engine.models.config import ModelConfig
from engine.models.gpt import GPT, flops_per_token, param_count
from engine.moe.balancing import aux_free_update, aux_loss_terms, sequence_stats
from engine.moe.config import MoEConfig
from engine.moe.context import MoEContext
from engine.moe.experts import grouped_mm
from engine.moe.layer import MoELayer
from engine.moe.router import route
from engine.moe.stats import load_imbalance


def _cfg(**moe):
    spec = {"num_experts": 4, "expert_hidden_size": 16, **moe}
    return ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, seq_len=16, moe=spec)


def test_router_picks_top_k_and_renormalises_in_fp32():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]], dtype=torch.bfloat16)
    r = route(logits, 2)
    assert r.probs.dtype == torch.float32 and r.experts.tolist() == [[1, 2]]
    p = torch.softmax(logits.float(), -1)[0]
    assert torch.allclose(r.weights[0], p[[1, 2]] / p[[1, 2]].sum())
    # the aux-free bias steers the choice, never the weights
    biased = route(logits, 2, bias=torch.tensor([5.0, 0.0, 0.0, 0.0]))
    assert biased.experts.tolist() == [[0, 1]]
    assert torch.allclose(biased.weights[0], p[[0, 1]] / p[[0, 1]].sum())


def test_sequence_aux_loss_is_one_when_balanced_and_e_over_k_when_collapsed():
    probs = torch.full((8, 4), 0.25)
    balanced = torch.tensor([[0, 1], [2, 3]] * 4)
    s = sequence_stats(probs, balanced, batch=2, num_experts=4, seq_groups=())
    assert float(aux_loss_terms(s, 2)) == pytest.approx(1.0)
    one_hot = torch.zeros(8, 4)
    one_hot[:, 0] = 1.0
    s = sequence_stats(one_hot, torch.zeros(8, 1, dtype=torch.long), batch=2, num_experts=4, seq_groups=())
    assert float(aux_loss_terms(s, 1)) == pytest.approx(4.0)  # E/K * P_0 = 4 * 1


def _aux_grads(layer, x, chunks):
    """Gradients of the balancing loss alone (the output's gradient is zero), the batch run as
    ``chunks`` micro-batches with loss factor 1/chunks (what the engine gives at GA = chunks)."""
    layer.zero_grad()
    layer.ctx = MoEContext(loss_factor=1.0 / chunks)
    for xc in x.chunk(chunks):
        (layer(xc) * 0.0).sum().backward()
    return [p.grad.clone() for p in (layer.router.weight,)]


def test_balancing_gradient_is_the_same_at_ga_1_and_4():
    cfg = _cfg(top_k=2, aux_loss_coef=0.1, z_loss_coef=1e-2)
    layer = MoELayer(cfg, cfg.moe, 0, 1234)
    x = torch.randn(8, 16, 32, generator=torch.Generator().manual_seed(0))
    one, four = _aux_grads(layer, x, 1), _aux_grads(layer, x, 4)
    assert one[0].abs().max() > 0
    torch.testing.assert_close(four[0], one[0], rtol=1e-6, atol=1e-9)


def test_aux_free_update_moves_toward_balance_identically():
    bias = torch.zeros(4)
    aux_free_update(bias, torch.tensor([10.0, 2.0, 2.0, 2.0]), 1e-3)
    assert bias.tolist() == pytest.approx([-1e-3, 1e-3, 1e-3, 1e-3])
    assert float(load_imbalance(torch.tensor([10.0, 2.0, 2.0, 2.0]))) == pytest.approx(2.5)
    assert float(load_imbalance(torch.zeros(4))) == 0.0


def test_capacity_drops_and_counts():
    cfg = _cfg(top_k=1, capacity_factor=0.5, load_balancing="none")
    layer = MoELayer(cfg, cfg.moe, 0, 1234).train()
    x = torch.randn(1, 16, 32)
    x[..., 0] = 1.0
    with torch.no_grad():  # expert 0 wins for every token
        layer.router.weight[:, 0] = torch.tensor([40.0, -40.0, -40.0, -40.0])
    y = layer(x.requires_grad_(True))
    assert layer.capacity(16) == 2
    assert float(layer.stats.dropped) == 14.0  # 16 tokens to expert 0, 2 kept
    assert int((y.abs().sum(-1) > 0).sum()) == 2 and torch.isfinite(y).all()


def test_grouped_mm_loop_equals_per_group_matmul_with_empty_groups():
    x = torch.randn(5, 3)
    w = torch.randn(3, 3, 2)
    out = grouped_mm(x, w, torch.tensor([2, 0, 3]))
    torch.testing.assert_close(out, torch.cat([x[:2] @ w[0], x[2:] @ w[2]]))


def test_gpt_with_moe_trains_a_step_and_counts_params():
    cfg = _cfg(top_k=2, layer_freq=2, shared_experts=1)
    model = GPT(cfg)
    assert type(model.layers[1].mlp).__name__ == "MoELayer" and type(model.layers[2].mlp).__name__ == "SwiGLU"
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())
    dense = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, seq_len=16)
    assert flops_per_token(cfg) != flops_per_token(dense)
    ids = torch.randint(0, 64, (2, 16))
    loss = model(ids, ids)
    loss.backward()
    assert torch.isfinite(loss) and model.layers[1].mlp.router.weight.grad.abs().max() > 0


@pytest.mark.parametrize("spec, key", [
    ({"num_experts": 4}, "expert_hidden_size"),
    ({"num_experts": 4, "expert_hidden_size": 8, "top_k": 5}, "top_k"),
    ({"num_experts": 4, "expert_hidden_size": 8, "load_balancing": "loss"}, "load_balancing"),
    ({"num_experts": 4, "expert_hidden_size": 8, "capacity_factor": 0}, "capacity_factor"),
    ({"num_experts": 4, "expert_hidden_size": 8, "aux_loss_coef": -1}, "aux_loss_coef"),
    ({"num_experts": 4, "expert_hidden_size": 8, "experts": 2}, "experts"),
    ({"num_experts": 0, "expert_hidden_size": 8}, "num_experts"),
])
def test_bad_moe_config_names_the_key(spec, key):
    with pytest.raises(ConfigError, match=key):
        ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, seq_len=16, moe=spec)


def test_moe_config_round_trips_and_fp16_is_refused():
    from engine.config import load_config

    cfg = _cfg(top_k=1)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg and isinstance(cfg.moe, MoEConfig)
    base = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "model": cfg.to_dict(),
            "fp16": {"enabled": True}}
    with pytest.raises(ConfigError, match="model.moe with fp16"):
        load_config(base, world_size=1)


def test_resuming_aux_free_needs_the_saved_biases():
    """A checkpoint without routing biases (written before they were saved) cannot resume an
    aux-free run (it would route with zero biases); an aux_loss run does not need them."""
    from types import SimpleNamespace

    import torch

    from engine.checkpoint.format import CheckpointError
    from engine.checkpoint.load import _check_moe_bias
    from engine.config import load_config
    from engine.training_state import TrainingState

    base = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2}
    state = TrainingState(SimpleNamespace(), SimpleNamespace(), None, [], {}, torch.device("cpu"),
                          moe_bias={"layers.1.mlp.expert_bias": torch.zeros(4)})
    old = SimpleNamespace(moe_bias=None)
    _check_moe_bias(load_config({**base, "model": _cfg().to_dict()}, world_size=1), state, "ck", old)  # fine
    free = load_config({**base, "model": _cfg(load_balancing="aux_free").to_dict()}, world_size=1)
    with pytest.raises(CheckpointError, match="aux_free"):
        _check_moe_bias(free, state, "ck", old)
    with pytest.raises(CheckpointError, match="layers.1.mlp.expert_bias"):  # another number of experts
        _check_moe_bias(free, state, "ck", SimpleNamespace(moe_bias={"layers.1.mlp.expert_bias": [0.0] * 8}))
    _check_moe_bias(free, state, "ck", SimpleNamespace(moe_bias={"layers.1.mlp.expert_bias": [0.5, 0, 0, 0]}))
    state.load_moe_bias({"layers.1.mlp.expert_bias": [0.5, -1e-3, 0, 0]})
    assert state.moe_bias["layers.1.mlp.expert_bias"].tolist() == [0.5, torch.tensor(-1e-3).item(), 0, 0]
