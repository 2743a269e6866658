"""engine.optim.ChunkedAdamW / ChunkedAdam: torch's Adam/AdamW update stepped in chunks of
each tensor. Bit-identical to torch.optim.AdamW / Adam (the update is elementwise; chunk
sizes that do not divide the tensor, several steps, weight decay, amsgrad, both the
multi-tensor and the per-tensor path), the same state dict (a checkpoint of either loads
into the other and continues bit for bit), and temporaries the size of a chunk, not of the
tensor (exact live-storage tracker)."""

import pytest
import torch

from engine.optim import ChunkedAdam, ChunkedAdamW
from engine.zero.peak import LiveMemoryTracker


def _pair(cls, ref, foreach, **kw):
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(10_007)), torch.nn.Parameter(torch.randn(33))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    return a, b, cls(a, lr=1e-2, chunk_numel=1000, foreach=foreach, **kw), ref(b, lr=1e-2, foreach=foreach, **kw)


def _steps(a, b, o1, o2, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for x, y in zip(a, b):
            grad = torch.randn(x.shape, generator=g)
            x.grad, y.grad = grad.clone(), grad.clone()
        o1.step()
        o2.step()


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("cls,ref,kw", [(ChunkedAdamW, torch.optim.AdamW, {"weight_decay": 0.1}),
                                        (ChunkedAdam, torch.optim.Adam, {"weight_decay": 0.1, "amsgrad": True})])
def test_bit_identical_to_torch_and_same_state_dict(cls, ref, kw, foreach):
    a, b, o1, o2 = _pair(cls, ref, foreach, **kw)
    _steps(a, b, o1, o2, 5)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    s1, s2 = o1.state_dict(), o2.state_dict()
    assert s1["state"].keys() == s2["state"].keys()
    for k in s2["state"]:
        assert s1["state"][k].keys() == s2["state"][k].keys()
        assert all(torch.equal(s1["state"][k][n], s2["state"][k][n]) for n in s2["state"][k])
    # each loads the other's state dict and both continue identically
    o1.load_state_dict(s2)
    o2.load_state_dict(s1)
    _steps(a, b, o1, o2, 3, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_temporaries_are_chunk_sized():
    n, chunk = 1 << 22, 1 << 16
    peaks = {}
    for name, make in (("torch", lambda p: torch.optim.AdamW([p], foreach=True)),
                       ("chunked", lambda p: ChunkedAdamW([p], foreach=True, chunk_numel=chunk))):
        with LiveMemoryTracker() as t:
            p = torch.nn.Parameter(torch.randn(n))
            p.grad = torch.randn(n)
            opt = make(p)
            opt.step()  # creates the moments
            before = t.current
            t.reset_peak()
            opt.step()
            peaks[name] = t.peak - before
    assert peaks["torch"] >= 4 * n  # a tensor-sized temporary
    assert peaks["chunked"] <= 4 * 4 * chunk  # a few chunk-sized ones


def test_bad_arguments():
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="chunk_numel"):
        ChunkedAdamW(p, chunk_numel=0)
    with pytest.raises(ValueError, match="fused"):
        ChunkedAdamW(p, fused=True)
