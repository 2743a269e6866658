"""The token mean of the step contract (engine.zero.step.TokenMean / token_mean) as arithmetic,
in one process: micro-batch ``i`` (token-loss sum ``L_i``, ``n_i`` targets) contributes
``L_i / n_bar`` with ``n_bar = N / (ga * dp)``; after the contract's ``1/ga`` (``scale_loss``)
and ``1/dp`` (the gradient factor) the gradient is that of ``sum L / N`` over the global batch,
and the mean of the micro-batch losses over ``ga * dp`` is ``sum L / N``.

Replicas are emulated here by computing ``n_bar`` from the global count (token_mean's one
all-reduce is the distributed test's, tests/distributed/test_token_mean.py). Tolerance rel
1e-6 in fp32 (reduction order only); the mean of per-micro-batch means, which the token mean
replaces, is off by far more on these counts (checked, so the tests can tell them apart)."""

import pytest
import torch
import torch.nn.functional as F

from engine.distributed.groups import AxisGroup
from engine.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from engine.zero.step import TokenMean, scale_loss, step_factors, token_mean

NO_DP = AxisGroup.single("dp")
V, S, B = 11, 7, 2
GA, DP = 2, 2
IGNORED = [0, 9, 13, 3]  # ignored targets of micro-batch (replica d, i) = IGNORED[d * GA + i]: all different


def _microbatches(seed=0):
    """GA * DP micro-batches of (logits (B, S, V) leaf, targets (B, S)) with IGNORED[k] targets -100."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(GA * DP):
        logits = (torch.randn(B, S, V, generator=g) * 2).requires_grad_()
        targets = torch.randint(0, V, (B, S), generator=g)
        targets.view(-1)[torch.randperm(B * S, generator=g)[:IGNORED[k]]] = -100
        out.append((logits, targets))
    return out


def _sum(logits, targets):
    return vocab_parallel_cross_entropy(logits, targets, AxisGroup.single("tp"), reduction="sum")


def _global_mean(mbs):
    """One process over the whole global batch: sum over every target token / their count."""
    logits = torch.cat([lg.reshape(-1, V) for lg, _ in mbs])
    targets = torch.cat([t.reshape(-1) for _, t in mbs])
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="mean")


def _grads(mbs, loss):
    return torch.autograd.grad(loss, [lg for lg, _ in mbs])


def test_contract_with_the_token_mean_is_the_global_token_mean():
    mbs = _microbatches()
    n_global = sum(int((t != -100).sum()) for _, t in mbs)
    norm = TokenMean(torch.tensor(n_global / (GA * DP), dtype=torch.float32))
    f = step_factors(GA, DP)
    losses = [norm(_sum(lg, t)) for lg, t in mbs]           # what each replica reports / differentiates
    differentiated = sum(scale_loss(loss, GA, 1.0) for loss in losses) * f.grad  # x 1/ga, then x 1/dp
    ref = _global_mean(mbs)
    reported = torch.stack(losses).mean()                    # mean over ga, then over the dp replicas
    assert reported.item() == pytest.approx(ref.item(), rel=1e-6)
    for got, want in zip(_grads(mbs, differentiated), _grads(mbs, ref)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    # the per-micro-batch mean it replaces is another loss on these counts
    old = torch.stack([vocab_parallel_cross_entropy(lg, t, AxisGroup.single("tp")) for lg, t in mbs]).mean()
    assert abs(old.item() - ref.item()) > 1e-3 * ref.item()


def test_equal_counts_are_bit_identical_to_the_per_microbatch_mean():
    """With no ignored target (equal counts) n_bar is each micro-batch's count: same bits as
    the mean reduction, loss and gradient (so existing equivalence tests are untouched)."""
    g = torch.Generator().manual_seed(1)
    mbs = [(torch.randn(B, S, V, generator=g).requires_grad_(), torch.randint(0, V, (B, S), generator=g))
           for _ in range(3)]
    norm = token_mean([t for _, t in mbs], NO_DP, ignore_index=-100, device=torch.device("cpu"))
    assert norm.mean_count.dtype == torch.float32 and norm.mean_count.item() == B * S
    for lg, t in mbs:
        new, old = norm(_sum(lg, t)), vocab_parallel_cross_entropy(lg, t, AxisGroup.single("tp"))
        assert torch.equal(new, old)
        assert torch.equal(torch.autograd.grad(new, lg)[0], torch.autograd.grad(old, lg)[0])


def test_token_mean_counts_every_microbatch_of_the_step():
    mbs = _microbatches()[:GA]  # one replica's: dp = 1
    norm = token_mean([t for _, t in mbs], NO_DP, ignore_index=-100, device=torch.device("cpu"))
    n = sum(B * S - k for k in IGNORED[:GA])
    assert norm.mean_count.item() == pytest.approx(n / GA, rel=1e-7)
    reported = torch.stack([norm(_sum(lg, t)) for lg, t in mbs]).mean()
    assert reported.item() == pytest.approx(_global_mean(mbs).item(), rel=1e-6)


def test_a_step_without_targets_has_loss_and_gradient_zero():
    logits = torch.randn(B, S, V).requires_grad_()
    targets = torch.full((B, S), -100)
    norm = token_mean([targets], NO_DP, ignore_index=-100, device=torch.device("cpu"))
    loss = norm(_sum(logits, targets))
    assert loss.item() == 0.0
    assert torch.equal(torch.autograd.grad(loss, logits)[0], torch.zeros_like(logits))


def test_token_mean_needs_targets():
    with pytest.raises(ValueError, match="at least one micro-batch"):
        token_mean([], NO_DP, ignore_index=-100, device=torch.device("cpu"))
