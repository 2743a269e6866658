"""engine.zero.norm.sum_of_squares: the grad norm's kernel is accurate at any length.

torch's CPU fp32 ``vector_norm`` accumulates almost sequentially: on 1M elements it is off by
~3e-5 relative, so a norm over ZeRO's flat buffers depended on how they were cut (the
layout-dependent 1e-6 of the MoE entry-point runs). The chunked kernel must stay within 1e-7
of the float64 value at every length and keep non-finite elements visible.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.zero.norm import NORM_CHUNK, sum_of_squares


@pytest.mark.parametrize("n", [0, 1, NORM_CHUNK - 1, NORM_CHUNK, 45_000, 1_000_003])
def test_sum_of_squares_is_accurate_at_every_length(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 8
    want = float(x.double().pow(2).sum())
    got = sum_of_squares(x)
    assert got.dtype == torch.float64 and got.dim() == 0
    assert float(got) == pytest.approx(want, rel=1e-7, abs=0.0)
    if n >= 1_000_000:  # what the plain fp32 norm gives here: the bug this kernel replaces
        plain = float(torch.linalg.vector_norm(x).double() ** 2)
        assert abs(plain - want) / want > 1e-6


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", [3, NORM_CHUNK * 2 + 5])
def test_a_non_finite_element_gives_a_non_finite_sum(bad, where):
    x = torch.ones(NORM_CHUNK * 2 + 7)
    x[where] = bad
    assert not torch.isfinite(sum_of_squares(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradient_shards_are_summed_in_fp32(dtype):
    """bf16 master gradients (bf16.bf16_master_weights_and_grads): the rows' norms in fp32,
    not rounded to the input's dtype (which is off by ~1e-4 relative here)."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(NORM_CHUNK * 400 + 9, generator=g) * 0.01).to(dtype)
    want = float(x.double().pow(2).sum())
    assert float(sum_of_squares(x)) == pytest.approx(want, rel=1e-6, abs=0.0)
