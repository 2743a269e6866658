"""The step arithmetic contract (engine.zero.step) as values, and the forward-only
(evaluation) schedule and per-chunk reduction points the executor derives from action lists."""

import itertools

import pytest
import torch

from engine.errors import ConfigError
from engine.pipeline.actions import Action, ActionKind, ScheduleError
from engine.pipeline.executor import last_grad_actions
from engine.pipeline.schedule import build_all, build_all_forward_only, forward_only
from engine.pipeline.simulate import simulate
from engine.zero.step import GradientStep, LocalGradients, scale_loss, step_factors

K = ActionKind


@pytest.mark.parametrize("ga,dp,scale", list(itertools.product([1, 2, 4, 8], [1, 2, 4], [1.0, 1024.0, 2.0 ** 16])))
def test_multiplier_is_one_over_ga_dp_whatever_the_scale(ga, dp, scale):
    """Powers of two: every factor is exact, so the product is exactly 1/(ga*dp); the loss
    is multiplied by S/ga before backward, each gradient by 1/(dp*S) as it is added."""
    f = step_factors(ga, dp, scale)
    assert f.loss == scale / ga
    assert f.grad == 1.0 / (dp * scale)
    assert f.total == 1.0 / (ga * dp)


@pytest.mark.parametrize("ga,dp", [(3, 1), (3, 2), (6, 4), (5, 3)])
def test_multiplier_other_sizes(ga, dp):
    assert step_factors(ga, dp, 512.0).total == pytest.approx(1.0 / (ga * dp), rel=1e-15)


def test_pipeline_depth_adds_no_factor():
    """The factors take no pipeline size: a micro-batch's loss is computed once (last stage);
    stages hold disjoint parameters; tied copies are SUMMED (see sum_tied_grads)."""
    import inspect

    assert list(inspect.signature(step_factors).parameters) == ["ga", "dp", "loss_scale"]


@pytest.mark.parametrize("bad", [dict(ga=0, dp=1), dict(ga=1, dp=0), dict(ga=1, dp=1, loss_scale=0.0),
                                 dict(ga=True, dp=1), dict(ga=1.5, dp=1)])
def test_bad_factors_are_errors(bad):
    with pytest.raises(ValueError):
        step_factors(**bad)


def test_scale_loss_divides_then_scales_as_deepspeed():
    """loss / ga * S in that order (DeepSpeed's backward); bit-equal to it for any loss."""
    g = torch.Generator().manual_seed(0)
    for loss in torch.rand(50, generator=g) * 10:
        assert torch.equal(scale_loss(loss, 3, 1024.0), (loss / 3) * 1024.0)
        assert torch.equal(scale_loss(loss, 2, 1.0), loss / 2)
    x = torch.tensor(1.5)
    assert scale_loss(x, 1, 1.0) is x  # nothing to do: no new op


def test_local_gradients_contract():
    lg = LocalGradients()
    assert isinstance(lg, GradientStep)
    assert torch.equal(lg.scale_loss(torch.tensor(6.0), 3), torch.tensor(2.0))
    lg.finish_backward()  # no tied weights: nothing to sum
    p = torch.nn.Parameter(torch.ones(2))
    LocalGradients([p]).finish_backward()  # both copies on this stage: a size-1 group, nothing to sum
    assert torch.equal(p.grad, torch.zeros(2))  # a copy no micro-batch reached takes part as zeros


def test_zero_optimizer_implements_the_contract():
    from engine.zero.base import ZeroOptimizer

    for name in ("scale_loss", "set_boundary", "finish_backward"):
        assert callable(getattr(ZeroOptimizer, name))


# ------------------------------------------------------------------ forward-only schedule
@pytest.mark.parametrize("p,m,v", [(p, m, v) for p in range(1, 5) for m in range(1, 7) for v in (1, 2, 3)
                                   if v == 1 or p > 1])
def test_forward_only_schedule_passes_the_simulator(p, m, v):
    per_rank = build_all_forward_only(p, m, v)
    res = simulate(per_rank, m, v, forward_only=True)
    assert res.peak_activations == (0,) * p
    for s, acts in enumerate(per_rank):
        assert acts == forward_only(s, p, m, v)
        assert [a for a in acts if a.is_compute] and all(a.kind is K.FORWARD for a in acts if a.is_compute)
        assert sum(a.kind is K.FORWARD for a in acts) == m * v


def test_forward_only_check_rejects_backward_and_missing_sends():
    per_rank = build_all("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="forward-only"):
        simulate(per_rank, 2, forward_only=True)
    fwd = build_all_forward_only(2, 2)
    broken = [[a for a in fwd[0] if a != Action(K.SEND_ACT, 1)], fwd[1]]
    with pytest.raises(ScheduleError, match="SEND_ACT1"):
        simulate(broken, 2, forward_only=True)
    with pytest.raises(ScheduleError):  # a training check still wants the backwards
        simulate(fwd, 2)


def test_forward_only_bad_arguments():
    with pytest.raises(ConfigError, match="num_microbatches"):
        forward_only(0, 2, 0)
    with pytest.raises(ConfigError, match="stage"):
        forward_only(2, 2, 1)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_last_grad_action_of_each_chunk(name, v):
    """Where the executor turns the reduction boundary on: the chunk's last B (or W)."""
    p, m = 2, 4
    for acts in build_all(name, p, m, v):
        last = last_grad_actions(acts)
        assert sorted(last) == list(range(v))
        for c, i in last.items():
            assert acts[i].chunk == c and acts[i].kind in (K.BACKWARD, K.BACKWARD_WEIGHT)
            assert not any(a.chunk == c and a.kind in (K.BACKWARD, K.BACKWARD_WEIGHT) for a in acts[i + 1:])
        if v > 1:  # backwards visit chunks in reverse: chunk 1 is final before chunk 0
            assert last[1] < last[0]
