"""Lion against its published update rule, written out element by element in float64."""

import pytest
import torch

from engine.optim import Lion


def _reference(p, grads, lr, betas, wd):
    # Chen et al. 2023, Algorithm 2 (decoupled weight decay), one scalar at a time
    p = p.double().clone()
    m = torch.zeros_like(p)
    b1, b2 = betas
    for g in grads:
        g = g.double()
        c = b1 * m + (1 - b1) * g
        p = p * (1 - lr * wd) - lr * torch.sign(c)
        m = b2 * m + (1 - b2) * g
    return p


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lion_follows_the_update_rule(wd):
    torch.manual_seed(0)
    p0 = torch.randn(7, 5)
    grads = [torch.randn(7, 5) for _ in range(6)]
    p = torch.nn.Parameter(p0.clone())
    opt = Lion([p], lr=1e-2, betas=(0.9, 0.99), weight_decay=wd)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    # fp32 vs float64 reference: only rounding of the same few ops per step differs
    torch.testing.assert_close(p.detach().double(), _reference(p0, grads, 1e-2, (0.9, 0.99), wd),
                               rtol=1e-6, atol=1e-6)


def test_lion_rejects_bad_hyperparameters():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="lr"):
        Lion([p], lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        Lion([p], betas=(1.0, 0.9))


def test_config_lion_builds_lion():
    from engine.config import load_config
    from engine.optim.build import optimizer_factory

    cfg = load_config({"train_batch_size": 2, "optimizer": {"type": "Lion", "params": {"lr": 1e-4}},
                       "model": {"vocab_size": 64, "hidden_size": 16, "num_layers": 1, "num_heads": 2,
                                 "seq_len": 8}}, world_size=1)
    opt = optimizer_factory(cfg.optimizer)([{"params": [torch.nn.Parameter(torch.zeros(3))]}])
    assert isinstance(opt, Lion) and opt.defaults["lr"] == 1e-4
