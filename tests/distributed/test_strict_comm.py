"""The strict NCCL-rules mode (engine.distributed.strict) catches a planted violation of each rule.

Every case runs on 2 gloo ranks in ONE spawn (starting interpreters dominates the cost).
Each planted violation is one that gloo forgives or reports only as a size error or a hang,
while NCCL rejects it, hangs or corrupts: the control cases show gloo accepting the
"forgiven" ones with the mode off, so these tests fail without the strict mode. The
rank-symmetric cases raise on every rank (the per-call header is exchanged before the
collective), so the ranks stay in step for the next case.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from harness import run_ranks

from engine.distributed import comm, strict
from engine.distributed.groups import AxisGroup


def _raises(fn) -> str:
    try:
        fn()
    except strict.NcclRuleError as e:
        return str(e)
    return ""


def _planted(rank, world):
    out = {}
    world_group = AxisGroup.world()
    strict.enable("cpu")
    # 1. device type: a CPU tensor in a job whose collectives run on CUDA (the benchmarks' bug)
    strict.enable("cuda")
    out["device"] = _raises(lambda: comm.all_reduce(torch.ones(3), world_group))
    strict.enable("cpu")
    # 2. contiguity
    out["contiguous"] = _raises(lambda: comm.all_reduce(torch.ones(2, 3).t(), world_group))
    # 3. dtype differs between ranks
    t = torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64)
    out["dtype"] = _raises(lambda: comm.all_reduce(t, world_group))
    # 4. unequal all_gather shards
    n = 2 + rank
    out["sizes"] = _raises(lambda: comm.all_gather(torch.empty(n * world), torch.ones(n), world_group))
    # 5. broadcast from different sources
    out["src"] = _raises(lambda: comm.broadcast(torch.ones(2), rank, world_group))
    # 6. send/receive shapes: (2, 3) sent, (3, 2) expected - same bytes, so gloo is silent
    def p2p():
        if rank == 0:
            ops = [dist.P2POp(dist.isend, torch.arange(6.0).view(2, 3), 1)]
        else:
            ops = [dist.P2POp(dist.irecv, torch.empty(3, 2), 0)]
        for w in comm.batch_isend_irecv(ops):
            w.wait()
    out["p2p"] = _raises(p2p)
    # 7. host sync inside a no-sync region (the ZeRO hooks / the executor); CPU-only checks exempt
    x = torch.ones(2)
    with comm.no_host_sync("a planted region"):
        out["host_sync"] = _raises(lambda: x.sum().item())
        with strict.host_sync_allowed():
            out["host_sync_allowed"] = float(x.sum())
    # 8. sequence: rank 0 issues one extra collective, then the step-boundary check
    def extra_then_check():
        if rank == 0:
            comm.all_reduce(torch.ones(1), world_group)
        comm.check_sequence([world_group], "end of step 1", torch.device("cpu"))
    out["sequence"] = _raises(extra_then_check)
    # a matching sequence passes the step-boundary check
    strict.enable("cpu")
    comm.all_reduce(torch.ones(5), world_group)
    comm.check_sequence([world_group], "end of step 2", torch.device("cpu"))

    # controls with the mode off: gloo accepts what NCCL would not (so the tests above need it)
    strict.disable()
    comm.all_reduce(torch.ones(2, 3).t(), world_group)
    if rank == 0:
        dist.send(torch.arange(6.0).view(2, 3), 1)
    else:
        got = torch.empty(3, 2)
        dist.recv(got, 0)
        out["control_p2p_shape_lost"] = got.tolist()
    return out


def test_strict_mode_catches_a_planted_violation_of_each_rule():
    per_rank = run_ranks(_planted, 2, timeout=120)
    for out in per_rank:
        assert "is on cpu but this job communicates on cuda" in out["device"]
        assert "not contiguous" in out["contiguous"]
        assert "disagree on this collective" in out["dtype"] and "float64" in out["dtype"]
        assert "disagree on this collective" in out["sizes"] and "numel 2" in out["sizes"]
        assert "disagree on this collective" in out["src"]
        assert "blocking host sync" in out["host_sync"] and ".item()" in out["host_sync"] and "a planted region" in out["host_sync"]
        assert out["host_sync_allowed"] == 2.0
        assert "at different collectives" in out["sequence"], out["sequence"]
        assert "rank 0: call #0 all_reduce" in out["sequence"] and "rank 1: call #0 sequence-check" in out["sequence"]
    # the receiver names both shapes; the sender's transfer itself succeeded
    assert per_rank[0]["p2p"] == ""
    assert "sent float32 (2, 3)" in per_rank[1]["p2p"] and "buffer is float32 (3, 2)" in per_rank[1]["p2p"]
    # without the mode gloo delivered the bytes into the wrong shape silently
    assert per_rank[1]["control_p2p_shape_lost"] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


class _SyncInHook(nn.Module):
    """A module whose gradient hook reads a value on the host: on a GPU a stall in every
    backward (as a ``.item()`` inside a ZeRO gradient hook would be)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.lin.weight.register_hook(lambda g: g * float(g.abs().max() > 0))

    def forward(self, x, y):
        return ((self.lin(x) - y) ** 2).mean()


def _engine_hook_sync(rank, world):
    import engine

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 2}}
    torch.manual_seed(0)
    eng, *_ = engine.initialize(model=_SyncInHook(), config=cfg)
    loss = eng(torch.randn(2, 4), torch.randn(2, 1))
    try:
        eng.backward(loss)
    except strict.NcclRuleError as e:
        return str(e)
    finally:
        eng.destroy()
    return ""


def test_strict_mode_catches_a_host_sync_in_a_gradient_hook_of_the_engine():
    msgs = run_ranks(_engine_hook_sync, 2, timeout=120)
    for m in msgs:
        assert "blocking host sync (a scalar read" in m and "ZeRO gradient hooks" in m, m


# ------------------------------------------------------------------ rules 7 and 8, the forward
def _planted_direct(rank, world):
    out = {}
    world_group = AxisGroup.world()
    strict.enable("cuda")  # a job whose device is not the tensors' (CPU) device
    # 7a. a direct torch.distributed call that bypasses engine.distributed.comm
    out["direct"] = _raises(lambda: dist.all_reduce(torch.ones(3)))
    out["direct_p2p"] = _raises(lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2), 1 - rank)]))
    strict.enable("cpu")
    out["direct_contiguous"] = _raises(lambda: dist.all_reduce(torch.ones(2, 3).t()))
    # 7b. an object collective inside a step region, and the same call outside it
    with comm.no_host_sync("a planted step"):
        out["object"] = _raises(lambda: dist.all_gather_object([None] * world, rank))
    got = [None] * world
    dist.all_gather_object(got, rank)
    out["object_outside"] = got
    # 8. all-to-all (Muon's exchange) with splits that do not match the peers' (rank 1 sends
    # 3 rows to rank 0, which expects 1): gloo would fail with a size error or hang
    inp = torch.arange(4.0).view(4, 1)
    in_splits = [2, 2] if rank == 0 else [3, 1]
    out_splits = [2, 1] if rank == 0 else [2, 1]
    recv = torch.empty(sum(out_splits), 1)
    out["a2a"] = _raises(lambda: comm.all_to_all_single(recv, inp, out_splits, in_splits, world_group))
    # matching splits pass and deliver
    in_ok, out_ok = ([1, 3], [1, 2]) if rank == 0 else ([2, 2], [3, 2])
    recv = torch.empty(sum(out_ok), 1)
    comm.all_to_all_single(recv, inp, out_ok, in_ok, world_group)
    out["a2a_ok"] = recv.flatten().tolist()
    return out


def test_strict_mode_sees_direct_calls_object_collectives_and_all_to_all():
    per_rank = run_ranks(_planted_direct, 2, timeout=120)
    for out in per_rank:
        assert "torch.distributed.all_reduce: tensor is on cpu but this job communicates on cuda" in out["direct"]
        assert "torch.distributed.batch_isend_irecv: tensor is on cpu" in out["direct_p2p"]
        assert "not contiguous" in out["direct_contiguous"]
        assert "all_gather_object inside a planted step" in out["object"], out["object"]
        assert out["object_outside"] == [0, 1]
        assert "rank 1 sends 3 rows to rank 0, which expects 1" in out["a2a"], out["a2a"]
    assert per_rank[0]["a2a_ok"] == [0.0, 0.0, 1.0]
    assert per_rank[1]["a2a_ok"] == [1.0, 2.0, 3.0, 2.0, 3.0]


class _SyncInForward(nn.Module):
    """A forward that reads a value on the host (a data-dependent branch): a device stall in
    every forward on a GPU."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x, y):
        h = self.lin(x)
        if h.abs().max() > 100:  # bool(t): a scalar read
            h = h.clamp(-100, 100)
        return ((h - y) ** 2).mean()


def _engine_forward_sync(rank, world):
    import engine

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1}}
    torch.manual_seed(0)
    eng, *_ = engine.initialize(model=_SyncInForward(), config=cfg)
    try:
        eng(torch.randn(2, 4), torch.randn(2, 1))
    except strict.NcclRuleError as e:
        return str(e)
    finally:
        eng.destroy()
    return ""


def test_strict_mode_catches_a_host_sync_in_the_forward():
    for m in run_ranks(_engine_forward_sync, 2, timeout=120):
        assert "blocking host sync" in m and "inside the forward" in m, m
