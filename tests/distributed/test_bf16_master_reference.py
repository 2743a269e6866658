"""DeepSpeed's bf16 master weights (``bf16.bf16_master_weights_and_grads``) at ZeRO 1, 2 and 3
against a dense single-process reference written here from torch primitives, 2 gloo ranks.

The reference (:func:`_reference`), what the engine must compute:

- the model, its activations and gradients in bf16; each rank's micro-batch gradient (bf16,
  from the same bf16 forward/backward as the rank's) scaled by 1/dp and summed over the ranks
  in fp32 (the ZeRO reduction), then **rounded to bf16 into the master gradient once per
  reduction**: without gradient accumulation once per step; at stages 2/3 with gradient
  accumulation once per micro-batch (each micro-batch's reduce-scatter is added, in fp32,
  into the bf16 gradient shard and rounded again), as DeepSpeed's bf16 gradient partitions;
  at ZeRO-1 with accumulation each rank first sums its micro-batches in its full accumulator,
  bf16 by default (``data_types.grad_accum_dtype``: every add rounded), reduced once per step;
- clipping (``gradient_clipping``) scales the bf16 gradient by min(1, clip / (norm + 1e-6))
  and rounds again (the norm from the bf16 values, summed in float64);
- AdamW per element in fp32 (master, gradient and moments loaded to fp32), torch.optim.AdamW's
  formula, each result stored rounded to nearest even: the master in bf16, the moments in bf16
  (``bf16_optimizer_states``) or fp32 (ZeRO-Offload with bf16_optimizer_states false,
  DeepSpeedCPUAdam(fp32_optimizer_states=True)); the model's bf16 weights are the master.

Tolerance: bitwise (torch.equal on every bf16 parameter, both ranks). Every rounding to bf16
happens at the same place in both, and the fp32 arithmetic between roundings is the same: the
reference runs torch.optim.AdamW's single-tensor fp32 ops (mul_, lerp_, addcmul_, addcdiv_),
which the engine's fused kernel reproduces op for op (csrc/adam: contraction off, torch's fmas).
The one fp32 value computed differently is the clipping norm (rows of fp32 partial norms in the
engine, a float64 sum here: ~1e-8 relative); it moves a bf16 rounding only for an element within
an fp32 ulp of a bf16 midpoint (none here: the run is deterministic, seeds fixed, one thread
per rank). A change of the arithmetic (fp32 masters, another rounding of the gradient, moments
in the other dtype) moves many elements by bf16 ulps, and the test asserts so: the reference
computed with each such change differs from the engine's result, and the engine run with fp32
masters differs from the bf16 reference. (An earlier version of this reference wrote AdamW as
one fp32 expression, ``b1 * m + (1 - b1) * g`` instead of lerp: one element in ~500 x 3 steps
then ended one bf16 ulp apart at ZeRO 2/3 with accumulation and clipping.)
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.nn as nn
from harness import run_ranks

DP, STEPS, BATCH, LR, WD, BETAS, EPS = 2, 3, 16, 1e-2, 0.1, (0.9, 0.999), 1e-8
BF16 = torch.bfloat16
# (stage, gradient accumulation steps, gradient_clipping, moments dtype, offload_optimizer)
CASES = (
    (1, 1, 0.0, BF16, False),
    (1, 2, 0.0, BF16, False),  # ZeRO-1's full accumulator in bf16 (grad_accum_dtype's default)
    (2, 2, 0.05, BF16, False),  # clipping active (the gradient norm is ~0.3-1)
    (3, 2, 0.0, BF16, False),
    (1, 1, 0.0, torch.float32, True),  # bf16_optimizer_states false: fp32 moments on the host
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    # uneven sizes (91, 13, 143, 11, 55, 5): parameters straddle bucket and shard boundaries
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 5)).to(BF16)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 7, generator=g).to(BF16), torch.randn(BATCH, 5, generator=g)


def _micro(x: torch.Tensor, y: torch.Tensor, rank: int, m: int, ga: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch ``m``: BATCH // DP rows per rank, split in ``ga``."""
    per_rank = BATCH // DP
    micro = per_rank // ga
    lo = rank * per_rank + m * micro
    return x[lo:lo + micro], y[lo:lo + micro]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, ga: int) -> torch.Tensor:
    return nn.functional.mse_loss(model(x).float(), y) / ga


# ------------------------------------------------------------------ the engine, 2 ranks
def _engine_rank(rank, world, cases, control):
    from engine.distributed.groups import AxisGroup
    from engine.optim.fused_adamw import FusedAdamW
    from engine.precision.mixed import PrecisionPolicy
    from engine.zero import OffloadOptions, build_zero_optimizer

    out = {}
    for case in cases + (control,):
        stage, ga, clip, state_dtype, offload = case
        master_dtype = torch.float32 if case is control else BF16

        def factory(groups, state_dtype=state_dtype, master_dtype=master_dtype):
            opt = FusedAdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
            if master_dtype == BF16 and state_dtype != BF16:
                opt.state_dtype = state_dtype  # as engine.optim.build does for bf16_optimizer_states false
            return opt

        model = _model()
        kw = {}
        if stage == 3:
            kw = dict(stage3_param_persistence_threshold=12, stage3_prefetch_bucket_size=200,
                      stage3_max_live_parameters=400)
        opt = build_zero_optimizer(stage, model, factory, AxisGroup.world(), reduce_bucket_size=64, alignment=4,
                                   precision=PrecisionPolicy(compute_dtype=BF16, master_dtype=master_dtype),
                                   clip_grad=clip, offload=OffloadOptions(optimizer=offload), **kw)
        for s in range(STEPS):
            x, y = _data(s)
            for m in range(ga):
                opt.set_boundary(m == ga - 1)
                opt.backward(_loss(model, *_micro(x, y, rank, m, ga), ga))
            assert opt.step() is True
        dtypes = {str(t.dtype) for g in opt.groups for t in (g.master, g.master.grad)}
        moments = {str(v.dtype) for st in opt.optimizer.state.values() for k, v in st.items() if k != "step"}
        if stage == 3:
            with opt.gathered_params():
                params = [p.detach().clone() for p in model.parameters()]
        else:
            params = [p.detach().clone() for p in model.parameters()]
        out[case] = (params, dtypes, moments)
        opt.remove_hooks()
    return out


# ------------------------------------------------------------------ the dense reference
def _rank_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, m: int, ga: int) -> list:
    """Rank ``rank``'s bf16 gradient of micro-batch ``m`` (the same bf16 forward/backward)."""
    model.zero_grad(set_to_none=True)
    _loss(model, *_micro(x, y, rank, m, ga), ga).backward()
    return [p.grad for p in model.parameters()]


def _fp32_mean(per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The ZeRO reduction: each rank's gradient times 1/dp (exact), summed over the ranks in fp32."""
    mean = [torch.zeros(g.shape, dtype=torch.float32) for g in per_rank[0]]
    for grads in per_rank:
        for acc, g in zip(mean, grads):
            acc.add_(g.float() * (1.0 / DP))
    return mean


def _master_grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor, ga: int, *,  # noqa: PLR0913
                 zero1_accum: Optional[torch.dtype] = None, round_per_step: bool = False,
                 round_recv: bool = False) -> list[torch.Tensor]:
    """One step's bf16 master gradient. ``zero1_accum``: ZeRO-1 with accumulation, each rank's
    full accumulator in that dtype (``data_types.grad_accum_dtype``, bf16 by default: every add
    rounded) reduced once per step; otherwise (stages 2/3, or no accumulation) one reduction
    per micro-batch, each rounded into the bf16 shard."""
    if zero1_accum is not None:
        acc = [[torch.zeros(p.shape, dtype=zero1_accum) for p in model.parameters()] for _ in range(DP)]
        for m in range(ga):
            for rank in range(DP):
                for a, g in zip(acc[rank], _rank_grads(model, x, y, rank, m, ga)):
                    a.add_(g)
        return [r.to(BF16) for r in _fp32_mean(acc)]
    grad: list[torch.Tensor] = []  # bf16 (fp32 while round_per_step accumulates)
    for m in range(ga):
        mean = _fp32_mean([[g.clone() for g in _rank_grads(model, x, y, r, m, ga)] for r in range(DP)])
        if round_per_step:
            grad = mean if not grad else [g + r for g, r in zip(grad, mean)]
        elif not grad:
            grad = [r.to(BF16) for r in mean]  # the first reduction, rounded into the bf16 shard
        else:  # a later micro-batch's reduction added in fp32 into the bf16 shard, rounded
            grad = [(g.float() + (r.to(BF16).float() if round_recv else r)).to(BF16) for g, r in zip(grad, mean)]
    return [g.to(BF16) for g in grad]


def _reference(ga: int, clip: float, state_dtype: torch.dtype, *, master_dtype: torch.dtype = BF16,
               **grad_kw: Any) -> list[torch.Tensor]:
    """The bf16 parameters after STEPS steps (module docstring). Changes the test shows it
    detects: ``master_dtype`` fp32 (masters kept in fp32, the weights their bf16 copy);
    ``round_per_step`` (micro-batches summed in fp32, one rounding per step); ``round_recv``
    (each micro-batch's reduced gradient rounded to bf16 before it is added into the bf16
    gradient: rounded twice); ``zero1_accum`` fp32 instead of bf16."""
    model = _model()
    params = list(model.parameters())
    master = [p.detach().to(master_dtype) for p in params]
    exp_avg = [torch.zeros(p.shape, dtype=state_dtype) for p in params]
    exp_avg_sq = [torch.zeros(p.shape, dtype=state_dtype) for p in params]
    for step in range(1, STEPS + 1):
        grad = _master_grad(model, *_data(step - 1), ga, **grad_kw)
        if clip > 0:
            norm = torch.stack([g.double().square().sum() for g in grad]).sum().sqrt()
            coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
            grad = [g.mul(coef) for g in grad]  # bf16 times the float64 0-dim factor: rounded again
        bc1, bc2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
        for i, g in enumerate(grad):
            # fp32 copies (.float() of an fp32 tensor is itself: clone so the update is out of place)
            p32, g32, m32, v32 = (t.float().clone() for t in (master[i], g, exp_avg[i], exp_avg_sq[i]))
            # torch.optim.AdamW's single-tensor fp32 update, op for op
            p32.mul_(1 - LR * WD)
            m32.lerp_(g32, 1 - BETAS[0])
            v32.mul_(BETAS[1]).addcmul_(g32, g32, value=1 - BETAS[1])
            p32.addcdiv_(m32, (v32.sqrt() / bc2 ** 0.5).add_(EPS), value=-LR / bc1)
            master[i] = p32.to(master_dtype)  # round to nearest even (bf16 masters)
            exp_avg[i], exp_avg_sq[i] = m32.to(state_dtype), v32.to(state_dtype)
        with torch.no_grad():
            for p, w in zip(params, master):
                p.copy_(w)  # the bf16 weights: the master (or its rounding)
    return [p.detach().clone() for p in params]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def engine_results():
    control = (2, 1, 0.0, BF16, False)  # run with fp32 masters (a key of its own)
    return run_ranks(_engine_rank, DP, CASES, control, timeout=120), control


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"zero{c[0]}-ga{c[1]}-clip{c[2]}-{str(c[3])[6:]}"
                         f"{'-offload' if c[4] else ''}")
def test_bf16_masters_match_dense_reference(engine_results, case):
    results, _ = engine_results
    stage, ga, clip, state_dtype, _ = case
    zero1 = {"zero1_accum": BF16} if stage == 1 and ga > 1 else {}
    ref = _reference(ga, clip, state_dtype, **zero1)
    for r in results:
        params, dtypes, moments = r[case]
        assert dtypes == {"torch.bfloat16"}, dtypes  # master shard and its gradient
        assert moments == {str(state_dtype)}, moments
        mismatch = [(i, int((a != b).sum())) for i, (a, b) in enumerate(zip(params, ref)) if not torch.equal(a, b)]
        assert not mismatch, f"(parameter, elements differing from the bf16 reference): {mismatch}"
    got = results[0][case][0]
    # the comparison detects a change of the arithmetic (module docstring)
    other_states = torch.float32 if state_dtype == BF16 else BF16
    assert not _equal(got, _reference(ga, clip, state_dtype, master_dtype=torch.float32, **zero1)), "fp32 masters"
    assert not _equal(got, _reference(ga, clip, other_states, **zero1)), "moments in the other dtype"
    if zero1:
        assert not _equal(got, _reference(ga, clip, state_dtype, zero1_accum=torch.float32)), "fp32 accumulator"
    elif ga > 1:
        assert not _equal(got, _reference(ga, clip, state_dtype, round_per_step=True)), "one rounding per step"
        assert not _equal(got, _reference(ga, clip, state_dtype, round_recv=True)), "gradient rounded twice"


def test_fp32_master_engine_differs_from_bf16_reference(engine_results):
    """The negative control: the same run with fp32 masters is not the bf16 reference."""
    results, control = engine_results
    _, ga, clip, state_dtype, _ = control
    assert not _equal(results[0][control][0], _reference(ga, clip, state_dtype))
