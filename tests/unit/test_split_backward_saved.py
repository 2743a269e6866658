"""The split backward's SavedStore: after the input pass (I) only what the weight pass (W)
reads stays; I + W still give exactly the gradients of one full backward."""

from __future__ import annotations

import torch

from engine.pipeline.split_backward import SavedStore, backward_input, backward_weight


class _Block(torch.nn.Module):
    """Norm, a softmax mixing over the sequence (attention-like, no parameters), an MLP."""

    def __init__(self, h: int = 16):
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.up = torch.nn.Linear(h, 4 * h)
        self.down = torch.nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        mix = torch.softmax(y @ y.transpose(-1, -2), dim=-1) @ y  # saves what only dX needs
        return x + self.down(torch.nn.functional.gelu(self.up(mix)))


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_input_pass_drops_what_only_it_reads_and_gradients_are_exact():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), _Block())
    x0, dy = torch.randn(2, 8, 16), torch.randn(2, 8, 16)

    x = x0.clone().requires_grad_()
    model(x).backward(dy)  # reference: one full backward
    want, want_dx = _grads(model), x.grad.clone()
    model.zero_grad()

    x = x0.clone().requires_grad_()
    store = SavedStore()
    with store.hooks():
        out = model(x)
    saved_bytes = sum(t.numel() * t.element_size() for t in store.tensors.values())
    dx, state = backward_input(out, dy, x, list(model.parameters()), store)
    kept_bytes = sum(t.numel() * t.element_size() for t in store.tensors.values())
    assert store.dropped > 0 and kept_bytes < saved_bytes, (store.dropped, kept_bytes, saved_bytes)
    assert all(p.grad is None for p in model.parameters())  # I computes no weight gradient
    backward_weight(state)
    assert torch.equal(dx, want_dx)
    for got, ref in zip(_grads(model), want):
        assert torch.equal(got, ref)
