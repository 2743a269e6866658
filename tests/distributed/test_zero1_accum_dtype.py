"""ZeRO-1's full gradient accumulator follows ``data_types.grad_accum_dtype`` (gloo, DP = 2).

With gradient accumulation, ZeRO-1 keeps the full gradient until the step's reduce-scatter.
In bf16/fp16 it is kept, by default (DeepSpeed's), in the compute dtype as the raw sum of
the micro-batches' gradients; each bucket is copied to fp32 and scaled by 1 / (dp * loss
scale) as it is reduce-scattered into the fp32 master gradient; ``"fp32"`` keeps the fp32
accumulator into which each gradient is added already scaled.

Exactness: the reference replays the same micro-batches on a copy of the model, sums the
gradients the same way (bf16/fp16 adds in the compute dtype, fp32 adds of the scaled
gradient), scales by powers of two (exact) and adds the two ranks' fp32 contributions (an
fp32 sum of two terms does not depend on the order): the master gradient is bit-equal.
fp16 runs with a static loss scale of 1024, so the raw sums are the scaled gradients.
"""

import copy

import pytest
import torch
import torch.nn as nn
from harness import run_ranks

from engine.distributed.groups import AxisGroup
from engine.precision.loss_scaler import StaticLossScaler
from engine.precision.mixed import PrecisionPolicy
from engine.zero import build_zero_optimizer

GA, ROWS, SCALE = 3, 4, 1024.0


def _model(dtype):
    torch.manual_seed(3)
    # uneven sizes (91, 13, 143, 11, 55, 5): parameters straddle bucket and shard boundaries
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 5)).to(dtype)


def _micro(rank, i, dtype):
    g = torch.Generator().manual_seed(100 * rank + i)
    return torch.randn(ROWS, 7, generator=g).to(dtype), torch.randn(ROWS, 5, generator=g).to(dtype)


def _loss(model, x, y):
    return ((model(x) - y).float() ** 2).mean()


def _reference(model, dtype, accum, scale, dp=2):
    """{parameter index: the reduced fp32 gradient} the contract prescribes."""
    total = {}
    for r in range(dp):
        m = copy.deepcopy(model)
        acc = {}
        for i in range(GA):
            m.zero_grad(set_to_none=True)
            x, y = _micro(r, i, dtype)
            (_loss(m, x, y) / GA * scale).backward()
            for k, p in enumerate(m.parameters()):
                if accum == torch.float32:
                    step = p.grad.float() * (1.0 / (dp * scale))
                    acc[k] = step if k not in acc else acc[k] + step
                else:
                    acc[k] = p.grad.clone() if k not in acc else acc[k] + p.grad
        for k, a in acc.items():
            part = a.float() if accum == torch.float32 else a.float() * (1.0 / (dp * scale))
            total[k] = part if k not in total else total[k] + part
    return total


def _case(rank, dtype, grad_accum, overlap):
    model = _model(dtype)
    ref_model = copy.deepcopy(model)
    index = {id(p): k for k, p in enumerate(model.parameters())}
    fp16 = dtype == torch.float16
    policy = PrecisionPolicy(compute_dtype=dtype, grad_accum_dtype=grad_accum)
    opt = build_zero_optimizer(1, model, lambda g: torch.optim.SGD(g, lr=0.0), AxisGroup.world(),
                               precision=policy, loss_scaler=StaticLossScaler(SCALE if fp16 else 1.0),
                               reduce_bucket_size=120, overlap_comm=overlap)
    dtypes = []
    for i in range(GA):
        opt.set_boundary(i == GA - 1)
        x, y = _micro(rank, i, dtype)
        opt.backward(_loss(model, x, y), num_microbatches=GA)
        if i == 0:
            dtypes = sorted({str(b.grad_acc.dtype) for b in opt.buckets})
    opt.reduce_gradients()
    ref = _reference(ref_model, dtype, policy.accum_dtype, SCALE if fp16 else 1.0)
    equal = []
    for b in opt.buckets:
        flat = torch.zeros(b.layout.padded_numel)
        for i, p in enumerate(b.params):
            lo, hi = b.layout.param_range(i)
            flat[lo:hi] = ref[index[id(p)]].reshape(-1)
        equal.append(torch.equal(b.shard_grad, b.shard_of(flat)))
    freed = all(b.grad_acc is None for b in opt.buckets)
    return {"acc_dtypes": dtypes, "equal": equal, "freed": freed, "buckets": len(opt.buckets)}


def _all(rank, world):
    out = {}
    for name, dtype, accum, overlap in (("bf16-default", torch.bfloat16, None, True),
                                        ("bf16-default-no-overlap", torch.bfloat16, None, False),
                                        ("bf16-fp32", torch.bfloat16, torch.float32, True),
                                        ("fp16-default", torch.float16, None, True),
                                        ("fp32", torch.float32, None, True)):
        out[name] = _case(rank, dtype, accum, overlap)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, 2, timeout=180)


@pytest.mark.parametrize("name,acc", [("bf16-default", "torch.bfloat16"), ("bf16-default-no-overlap", "torch.bfloat16"),
                                      ("bf16-fp32", "torch.float32"), ("fp16-default", "torch.float16"),
                                      ("fp32", "torch.float32")])
def test_zero1_accumulates_in_grad_accum_dtype_and_reduces_exactly(results, name, acc):
    for rank_out in results:
        r = rank_out[name]
        assert r["buckets"] > 2  # several buckets: launches during backward and after it
        assert r["acc_dtypes"] == [acc], r
        assert all(r["equal"]), r
        assert r["freed"]  # the full accumulators are gone once the step's reduction is done


def test_a_mix_of_dtypes_is_an_error():
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="grad_accum_dtype"):
        PrecisionPolicy(compute_dtype=torch.bfloat16, grad_accum_dtype=torch.float16)
