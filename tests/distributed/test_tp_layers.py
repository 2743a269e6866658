"""Tensor-parallel layers vs their dense single-process references, on gloo, fp32.

Every rank builds the unsharded reference (nn.functional on the full weight drawn from the
same seed) next to its TP layer and compares outputs and weight/bias/input gradients.
The references slice with plain ``chunk`` (not the library's shard helpers), so a layout
bug in the library cannot cancel out.

Tolerances (fp32, eps ~1.2e-7): a TP reduction (row-parallel output, the all-reduced input
gradient of a column-parallel layer, reduce-scatter under sequence parallelism) sums the
same terms in a different order than the dense matmul, which moves results by a few ulp:
``rtol=1e-5, atol=1e-6`` (measured max abs differences here are ~1e-7 on values of O(1)).
Anything computed with no cross-rank sum must be bit-exact: the embedding forward equals
the dense lookup, and the column-parallel forward equals the dense matmul of the same
weight slice. (It is NOT always bit-exact against the slice of the full-width matmul:
the CPU BLAS picks a different kernel for a narrower output, e.g. 6 columns instead of
24, which moves results by ~1 ulp; that comparison uses the tolerance.) A missing all-reduce shows up as O(1) errors, far above tolerance
(see test_missing_collectives_are_caught).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_ranks

from engine.distributed.groups import NO_TP, AxisGroup
from engine.models.blocks import RMSNorm
from engine.placement import placement_of
from engine.tensor_parallel import cross_entropy as ce_mod
from engine.tensor_parallel import mappings
from engine.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from engine.tensor_parallel.layers import (
    ColumnParallelLinear,
    NormalInit,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)

TOL = dict(rtol=1e-5, atol=1e-6)
B, S, IN, OUT = 2, 8, 16, 24   # IN, OUT divisible by 1, 2, 4


def _randn(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _close(actual, expected, what, **tol):
    torch.testing.assert_close(actual, expected, **(tol or TOL), msg=lambda m: f"{what}: {m}")


def _exact(actual, expected, what):
    assert torch.equal(actual, expected), f"{what}: not bit-exact, max diff {(actual - expected).abs().max()}"


# ---------------------------------------------------------------- checks (raise AssertionError)

def check_column(group, gather_output: bool, sequence_parallel: bool = False):
    world, rank = mappings.tp_world_size(group), mappings.tp_rank(group)
    init = NormalInit(0.2, 11, "col")
    layer = ColumnParallelLinear(IN, OUT, group, init=init, bias=True, gather_output=gather_output,
                                 sequence_parallel=sequence_parallel)
    w, b = init((OUT, IN)), _randn(OUT, seed=1)
    with torch.no_grad():
        layer.bias.copy_(b.chunk(world)[rank])
    assert placement_of(layer.weight).tp_sharded and placement_of(layer.weight).tp.dim == 0 and placement_of(layer.bias).tp_sharded
    _exact(layer.weight.detach(), w.chunk(world, 0)[rank], "column weight is the slice of the full init")

    x_ref, g = _leaf(_randn(B, S, IN, seed=2)), _randn(B, S, OUT, seed=3)
    y_ref = F.linear(x_ref, w, b)
    (y_ref * g).sum().backward()

    x = _leaf(x_ref.chunk(world, 1)[rank] if sequence_parallel else x_ref)
    y = layer(x)
    local = F.linear(x_ref.detach(), w.chunk(world, 0)[rank], b.chunk(world)[rank])  # no communication
    if gather_output:
        _close(y, y_ref.detach(), "column forward (gathered)")
        _exact(y.detach().chunk(world, -1)[rank], local, "column forward (own slice, gathered)")
        (y * g).sum().backward()
    else:
        _close(y, y_ref.detach().chunk(world, -1)[rank], "column forward")
        _exact(y.detach(), local, "column forward (own slice)")
        (y * g.chunk(world, -1)[rank]).sum().backward()
    _close(layer.weight.grad, _wgrad_col(x_ref, g).chunk(world, 0)[rank], "column weight grad")
    _close(layer.bias.grad, g.sum((0, 1)).chunk(world)[rank], "column bias grad")
    ref_xg = x_ref.grad.chunk(world, 1)[rank] if sequence_parallel else x_ref.grad
    _close(x.grad, ref_xg, "column input grad")


def _wgrad_col(x, g):
    return torch.einsum("bso,bsi->oi", g, x.detach())  # (out, in) dense weight gradient


def check_fused_column(group):
    """A fused [q; k; v]-style weight with unequal parts: each part split separately."""
    world, rank = mappings.tp_world_size(group), mappings.tp_rank(group)
    parts = [16, 8, 8]
    init = NormalInit(0.2, 12, "fused")
    w = init((sum(parts), IN))
    x_ref = _leaf(_randn(B, S, IN, seed=4))
    y_ref = F.linear(x_ref, w)
    local_w = torch.cat([p.chunk(world, 0)[rank] for p in w.split(parts, 0)], 0)  # [q_r; k_r; v_r]
    local_ref = torch.cat([p.chunk(world, -1)[rank] for p in y_ref.detach().split(parts, -1)], -1)
    for gather_output in (False, True):
        layer = ColumnParallelLinear(IN, parts, group, init=init, gather_output=gather_output)
        _exact(layer.weight.detach(), local_w, "fused column weight shard")
        y = layer(_leaf(x_ref))
        _close(y, y_ref.detach() if gather_output else local_ref,
               f"fused column forward (gather_output={gather_output})")
        if not gather_output:
            _exact(y.detach(), F.linear(x_ref.detach(), local_w), "fused column forward (own slice)")


def check_row(group, input_is_parallel: bool, sequence_parallel: bool = False):
    world, rank = mappings.tp_world_size(group), mappings.tp_rank(group)
    init = NormalInit(0.2, 13, "row")
    layer = RowParallelLinear(IN, OUT, group, init=init, bias=True, input_is_parallel=input_is_parallel,
                              sequence_parallel=sequence_parallel)
    w, b = init((OUT, IN)), _randn(OUT, seed=5)
    with torch.no_grad():
        layer.bias.copy_(b)
    assert placement_of(layer.weight).tp_sharded and placement_of(layer.weight).tp.dim == 1
    assert not placement_of(layer.bias).tp_sharded
    _exact(layer.weight.detach(), w.chunk(world, 1)[rank], "row weight is the slice of the full init")

    x_ref, g = _leaf(_randn(B, S, IN, seed=6)), _randn(B, S, OUT, seed=7)
    y_ref = F.linear(x_ref, w, b)
    (y_ref * g).sum().backward()

    x = _leaf(x_ref.chunk(world, -1)[rank] if input_is_parallel else x_ref)
    y = layer(x)
    if sequence_parallel:
        _close(y, y_ref.detach().chunk(world, 1)[rank], "row forward (sequence slice)")
        (y * g.chunk(world, 1)[rank]).sum().backward()
    else:
        _close(y, y_ref.detach(), "row forward")
        (y * g).sum().backward()
    _close(layer.weight.grad, _wgrad_col(x_ref, g).chunk(world, 1)[rank], "row weight grad")
    _close(layer.bias.grad, g.sum((0, 1)), "row bias grad (added once, after the reduction)")
    _close(x.grad, x_ref.grad.chunk(world, -1)[rank] if input_is_parallel else x_ref.grad, "row input grad")
    return y.detach()


def check_row_modes_agree(group):
    a = check_row(group, input_is_parallel=True)
    b = check_row(group, input_is_parallel=False)
    _close(a, b, "row-parallel input_is_parallel=True vs False")


def check_embedding(group, vocab: int, sequence_parallel: bool = False):
    world, rank = mappings.tp_world_size(group), mappings.tp_rank(group)
    hidden = 12
    init = NormalInit(0.5, 14, "emb")
    emb = VocabParallelEmbedding(vocab, hidden, group, init=init, sequence_parallel=sequence_parallel)
    w = _leaf(init((vocab, hidden)))
    padded = -(-vocab // world) * world
    assert emb.weight.shape == (padded // world, hidden)
    ids = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(8))
    ids[0, :3] = torch.tensor([0, vocab - 1, min(padded // world, vocab - 1)])  # ends, a shard boundary
    g = _randn(B, S, hidden, seed=9)
    y_ref = F.embedding(ids, w)
    (y_ref * g).sum().backward()
    y = emb(ids)
    if sequence_parallel:
        _exact(y.detach(), y_ref.detach().chunk(world, 1)[rank], "embedding forward (sequence slice)")
        (y * g.chunk(world, 1)[rank]).sum().backward()
    else:
        _exact(y.detach(), y_ref.detach(), "embedding forward")
        (y * g).sum().backward()
    ref_grad = F.pad(w.grad, (0, 0, 0, padded - vocab)).chunk(world, 0)[rank]
    _close(emb.weight.grad, ref_grad, "embedding weight grad")


def check_cross_entropy(group, vocab: int):
    world, rank = mappings.tp_world_size(group), mappings.tp_rank(group)
    padded = -(-vocab // world) * world
    logits_ref = _leaf(3 * _randn(B, S, vocab, seed=10))
    targets = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(11))
    targets[0, 0], targets[1, 1] = -100, vocab - 1          # an ignored token and the last id
    loss_ref = F.cross_entropy(logits_ref.flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss_ref.backward()
    # padded columns are -inf, as the LM head produces them
    full = F.pad(logits_ref.detach(), (0, padded - vocab), value=float("-inf"))
    shard = _leaf(full.chunk(world, -1)[rank])
    loss = vocab_parallel_cross_entropy(shard, targets, group)
    _close(loss, loss_ref.detach(), "cross-entropy loss")
    loss.backward()
    ref_grad = F.pad(logits_ref.grad, (0, padded - vocab)).chunk(world, -1)[rank]
    _close(shard.grad, ref_grad, "cross-entropy logits grad")
    per_token = vocab_parallel_cross_entropy(shard.detach(), targets, group, reduction="none")
    _close(per_token.flatten(), F.cross_entropy(logits_ref.detach().flatten(0, 1), targets.flatten(),
                                                reduction="none"), "cross-entropy per-token losses")


def check_head(group, vocab: int):
    """LM head: the real columns match the dense head and padded columns are -inf."""
    world, rank = mappings.tp_world_size(group), mappings.tp_rank(group)
    hidden, padded = 12, -(-vocab // world) * world
    w = F.pad(_randn(vocab, hidden, seed=12), (0, 0, 0, padded - vocab))
    x = _randn(B, S, hidden, seed=13)
    w_local = w.chunk(world, 0)[rank]
    y = vocab_parallel_logits(x, w_local, group, vocab)
    start = rank * padded // world
    real = max(0, min(vocab - start, padded // world))      # columns of this shard that are real
    full = F.linear(x, w[:vocab])
    _close(y[..., :real], full[..., start:start + real], "LM head logits")
    _exact(y[..., :real], F.linear(x, w_local)[..., :real], "LM head logits (own slice)")
    assert torch.all(y[..., real:] == float("-inf")), "padded vocabulary columns must be -inf"


def check_rmsnorm_sequence_parallel(group):
    """Norm weight gradient under sequence parallelism equals the full-sequence one."""
    world, rank = mappings.tp_world_size(group), mappings.tp_rank(group)
    ref, norm = RMSNorm(IN, 1e-5), RMSNorm(IN, 1e-5, group, sequence_parallel=True)
    with torch.no_grad():
        w = _randn(IN, seed=14)
        ref.weight.copy_(w)
        norm.weight.copy_(w)
    x, g = _randn(B, S, IN, seed=15), _randn(B, S, IN, seed=16)
    (ref(x) * g).sum().backward()
    y = norm(x.chunk(world, 1)[rank])
    _exact(y.detach(), ref(x).detach().chunk(world, 1)[rank], "RMSNorm forward (sequence slice)")
    (y * g.chunk(world, 1)[rank]).sum().backward()
    _close(norm.weight.grad, ref.weight.grad, "RMSNorm weight grad under sequence parallelism")


def check_sequence_parallel_equals_off(group):
    """Column -> row with sequence parallelism equals the same pair without it."""
    world, rank = mappings.tp_world_size(group), mappings.tp_rank(group)
    outs = {}
    for sp in (False, True):
        col = ColumnParallelLinear(IN, OUT, group, init=NormalInit(0.2, 17, "c"), sequence_parallel=sp)
        row = RowParallelLinear(OUT, IN, group, init=NormalInit(0.2, 18, "r"), bias=True, sequence_parallel=sp)
        x_full = _randn(B, S, IN, seed=19)
        x = _leaf(x_full.chunk(world, 1)[rank] if sp else x_full)
        y = row(torch.relu(col(x)))
        y_full = mappings.all_gather_along_dim(y.detach(), 1, group) if sp else y.detach()
        g = _randn(B, S, IN, seed=20)
        (y * (g.chunk(world, 1)[rank] if sp else g)).sum().backward()
        x_grad = mappings.all_gather_along_dim(x.grad, 1, group) if sp else x.grad
        outs[sp] = (y_full, x_grad, col.weight.grad, row.weight.grad, row.bias.grad)
    for name, a, b in zip(("output", "input grad", "column weight grad", "row weight grad", "row bias grad"),
                          outs[False], outs[True]):
        _close(b, a, f"sequence parallel on vs off: {name}")


# ---------------------------------------------------------------- rank functions

def _setup():
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)


def _tp_groups(world_size: int) -> dict:
    """TP degree -> this rank's TP group. With 4 ranks: TP=2 on the pairs {0,1} and {2,3}
    (so group-relative ranks differ from global ones) and TP=4 on all of them; every
    rank creates every group, in the same order, as torch.distributed requires."""
    mine = {}
    for tp in (2, 4):
        for start in range(0, world_size, tp):
            ranks = list(range(start, start + tp))
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine[tp] = AxisGroup.of(group, "tp")
    return mine


def _layer_checks(group):
    """(name, check, args) for every equivalence check; vocab sizes 96 / 98 / 101 are
    divisible by 1, 2, 4 / by 2 only / by none; S = 8 is divisible by 1, 2, 4."""
    checks = [(f"column gather_output={go}", check_column, (group, go)) for go in (False, True)]
    checks += [("fused column", check_fused_column, (group,)),
               ("row input_is_parallel True/False", check_row_modes_agree, (group,))]
    for vocab in (96, 98, 101):
        checks += [(f"embedding V={vocab}", check_embedding, (group, vocab)),
                   (f"cross-entropy V={vocab}", check_cross_entropy, (group, vocab)),
                   (f"LM head V={vocab}", check_head, (group, vocab))]
    checks += [("column sequence-parallel", check_column, (group, False, True)),
               ("row sequence-parallel", check_row, (group, True, True)),
               ("embedding sequence-parallel", check_embedding, (group, 101, True)),
               ("RMSNorm sequence-parallel", check_rmsnorm_sequence_parallel, (group,)),
               ("sequence parallel on == off", check_sequence_parallel_equals_off, (group,))]
    return checks


def _run_checks(group) -> dict:
    """name -> None if the check passed, else its assertion message (all checks run)."""
    failures = {}
    for name, check, args in _layer_checks(group):
        try:
            check(*args)
            failures[name] = None
        except AssertionError as e:
            failures[name] = str(e)
    return failures


def _rank_main(rank, world_size):
    _setup()
    groups = _tp_groups(world_size)
    return {"checks": {tp: _run_checks(g) for tp, g in groups.items()},
            "teeth": _broken_collectives(groups[2])}


_RESULTS: list = []


def _results() -> list[dict]:
    """One 4-rank spawn serves every test below (spawning dominates the runtime)."""
    if not _RESULTS:
        _RESULTS.extend(run_ranks(_rank_main, 4, timeout=180))
    return _RESULTS


def _assert_all_passed(per_rank: list[dict]) -> None:
    failed = {f"rank {r}: {name}": msg for r, res in enumerate(per_rank)
              for name, msg in res.items() if msg is not None}
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items())


@pytest.mark.parametrize("tp", [2, 4])
def test_layers_match_dense(tp):
    _assert_all_passed([r["checks"][tp] for r in _results()])


def test_layers_tp1_without_process_group():
    """TP=1 is a TP group of one (NO_TP): no torch.distributed at all, every check as above."""
    assert not dist.is_initialized()
    _setup()
    _assert_all_passed([_run_checks(NO_TP)])


# ---------------------------------------------------------------- the checks have teeth

@contextlib.contextmanager
def _patched(obj, name, value):
    old = obj.__dict__[name]
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _identity_backward(n_extra):
    return staticmethod(lambda ctx, grad: (grad,) + (None,) * n_extra)


def _expect_failure(check, *args):
    try:
        check(*args)
    except AssertionError:
        return True
    return False


def _broken_collectives(group) -> dict:
    """Each entry removes one collective (on every rank, so nothing hangs) and names a
    check that must then fail; name -> whether it failed."""
    m = mappings
    cases = {
        "copy-to-region backward all-reduce": (
            _patched(m._CopyToRegion, "backward", _identity_backward(1)), check_column, (group, False)),
        "reduce-from-region forward all-reduce": (
            _patched(m._ReduceFromRegion, "forward", staticmethod(lambda ctx, x, g: x.clone())),
            check_row, (group, True)),
        "sequence-parallel gather backward reduce-scatter": (
            _patched(m._GatherFromSequenceParallel, "backward",
                     staticmethod(lambda ctx, grad: (m.split_along_dim(grad, ctx.dim, ctx.group), None, None))),
            check_column, (group, False, True)),
        "norm-weight all-reduce under sequence parallelism": (
            _patched(m._CopyToRegion, "backward", _identity_backward(1)),
            check_rmsnorm_sequence_parallel, (group,)),
        "cross-entropy all-reduces": (
            _patched(ce_mod, "_all_reduce", lambda t, g, op: None), check_cross_entropy, (group, 101)),
        "embedding all-reduce": (
            _patched(m._ReduceFromRegion, "forward", staticmethod(lambda ctx, x, g: x.clone())),
            check_embedding, (group, 101)),
    }
    caught = {}
    for name, (patch, check, args) in cases.items():
        with patch:
            caught[name] = _expect_failure(check, *args)
        check(*args)  # and passes again once restored
    return caught


def test_missing_collectives_are_caught():
    for caught in (r["teeth"] for r in _results()):
        missed = [name for name, ok in caught.items() if not ok]
        assert not missed, f"removing these collectives went unnoticed: {missed}"
