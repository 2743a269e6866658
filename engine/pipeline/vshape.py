"""Compute orders of the V-shaped schedules (V placement, two chunks per rank): ``zb-v``.

V placement (:mod:`engine.pipeline.actions`): rank ``r`` holds model stages ``r`` (chunk 0)
and ``2p - 1 - r`` (chunk 1), so a micro-batch goes down the ranks on chunk 0, turns on rank
``p - 1`` without leaving it, and comes back up on chunk 1 to the loss on rank 0.

ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", §6) splits each backward into the input
grad ``I`` (on the critical path) and the weight grad ``W`` (deferrable), and fills every slot
where a rank would wait with a ``W``. Model stage 0 (rank 0, chunk 0) has no input gradient
(its input is token ids: the executor's ``I`` there is empty and its ``W`` the whole
backward), so its backward is one full ``B`` here, on the critical path, as it is in fact.

The order is built as data by a list scheduler over all ranks in time, with the default cost
table (a chunk's ``F = I = W = 1``, ``B = 2``: a backward of twice the forward, split evenly):
whenever a rank is free it takes, in this priority,

1. the ready ``I`` (``B`` on stage 0) of the oldest micro-batch (chunk 1 first): gradients
   flow back without delay;
2. with the option ``eager_loss_w``, on rank 0 the pending ``W`` of the loss chunk (chunk 1):
   what it keeps is the logits' gradient, vocabulary-sized per token;
3. a ready chunk-1 ``F`` (it leads to the loss, so to the next ``I``); else the next chunk-0
   ``F`` while the rank's chunk activations (held, plus the chunk-1 forwards still owed to
   micro-batches already in chunk 0) stay within a cap;
4. the oldest pending ``W``.

So warm-up is forwards on chunk 0 then chunk 1, and the steady state interleaves F, I and W.
Each admitted chunk-0 forward may be followed by its chunk-1 forward before a ``W`` frees a
slot, so a rank holds at most ``cap + 1`` chunk activations. :func:`zb_v_orders` runs the
scheduler with every cap from ``2p`` down to ``p``, with stage 0 planned whole or split (the
original uniform-cost plan, its ``I`` then made the ``B``) and the loss chunk's ``W`` deferred
or eager, then seeded randomised runs (a rank sometimes takes a pending ``W`` before a forward
it could run), and keeps a plan within the memory budget first (at most ``2p`` chunk
activations held, ``p`` stages as 1F1B's rank 0, and a modelled peak, :func:`_memory_peak`,
of at most ``2p`` chunks plus one input pass's working memory), then the shortest makespan
under the default cost table, then the smallest modelled peak. The makespan's lower bound is
``6m + p - 1`` chunk-forward times (rank ``p - 1`` must wait ``p - 1`` forwards at the start:
the bubble of :func:`engine.pipeline.simulate.bubble_formula`, derived in docs/training.md);
the kept plan reaches it at p = 4, m = 4, 5, 8, 9; at p = 2 the budget costs one unit for every
m (the plans on the bound keep the loss chunk's ``W`` pending while rank 0 holds 2p chunks),
at p = 3 and for larger m at p = 4 a few (tests/unit/test_vshape.py and
benchmarks/results/zb-v_memory_cpu-2core_2026-11-27b.md). The order is only a list per rank:
the simulator checks it (and the communication placed around it) under any cost model.
"""

from __future__ import annotations

import functools
import random
from typing import Optional, Sequence

from engine.pipeline.actions import Action, ActionKind, virtual_stage
from engine.pipeline.simulate import reference_times

__all__ = ["zb_v_orders", "dualpipe_v_order"]

F, B, I, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
_COST = {F: 1, B: 2, I: 1, W: 1}  # chunk-forward units: the default cost table's (backward = 2 x forward)


class _Greedy:
    """The state of the list scheduler: what is done (and when it ends), per rank what it holds."""

    def __init__(self, p: int, m: int, limit: int, whole_stage0: bool = True,
                 rng: Optional[random.Random] = None, defer: float = 0.0, eager_loss_w: bool = False) -> None:
        self.p, self.m, self.limit, self.whole_stage0 = p, m, limit, whole_stage0
        # the loss chunk's W (rank 0, chunk 1) right after its I: it holds the head's logits gradient
        self.eager_loss_w = eager_loss_w
        # randomised plans: with probability ``defer`` a rank that could run a forward and has a
        # W pending runs the W first (frees a chunk sooner; see zb_v_orders)
        self.rng, self.defer = rng, defer
        self.done: dict[tuple[ActionKind, int, int], int] = {}  # (F or I, mb, model stage) -> end time
        self.orders: list[list[Action]] = [[] for _ in range(p)]
        self.free = [0] * p  # when each rank finishes its current action
        self.held = [0] * p  # chunk activations held (forward done, weight grad not yet)
        self.next_f0 = [0] * p  # next micro-batch of chunk 0 (fed in order)
        self.pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # (mb, chunk), oldest first
        self.stages = [(virtual_stage(r, 0, p, "v"), virtual_stage(r, 1, p, "v")) for r in range(p)]
        self.low_i = [[0, 0] for _ in range(p)]  # per rank and chunk: micro-batches below have run I
        self.low_f1 = [0] * p  # per rank: micro-batches below have run chunk 1's forward

    def ready(self, kind: ActionKind, mb: int, stage: int, t: int) -> bool:
        end = self.done.get((kind, mb, stage))
        return end is not None and end <= t

    def _input_grad(self, r: int, t: int) -> Action | None:
        """The first (micro-batch, then chunk 1 before chunk 0) input pass rank ``r`` can run
        at ``t``. Micro-batches below ``low_i[r][c]`` have had theirs (skipped: the search
        calls this O(m p) times per plan), and a chunk's forwards end in micro-batch order
        on its rank, so past the first forward not yet ended none of that chunk is ready."""
        last, low, stages = 2 * self.p - 1, self.low_i[r], self.stages[r]
        for c in (0, 1):
            while low[c] < self.m and (I, low[c], stages[c]) in self.done:
                low[c] += 1
        open_ = [True, True]
        for mb in range(min(low), self.m):
            for c in (1, 0):
                if not open_[c] or mb < low[c]:
                    continue
                k = stages[c]
                if (I, mb, k) in self.done:
                    continue
                if not self.ready(F, mb, k, t):
                    open_[c] = False
                    continue
                if k == last or self.ready(I, mb, k + 1, t):
                    return Action(B if k == 0 and self.whole_stage0 else I, mb, c)
            if not (open_[0] or open_[1]):
                break
        return None

    def _forward(self, r: int, t: int) -> Action | None:
        k0, k1 = self.stages[r]
        # chunk 1's forwards run in micro-batch order (their inputs end in that order on the
        # rank before), so the first not yet run is the only candidate
        low = self.low_f1[r]
        while low < self.m and (F, low, k1) in self.done:
            low += 1
        self.low_f1[r] = low
        if low < self.m and self.ready(F, low, k1 - 1, t):
            return Action(F, low, 1)
        mb = self.next_f0[r]
        # room is reserved for the chunk-1 forwards still to come of the micro-batches already in
        # chunk 0 (never gated, they lead to the loss)
        reserved = self.held[r] + sum(1 for j in range(low, mb) if (F, j, k1) not in self.done)
        if mb < self.m and reserved + 1 <= self.limit and (k0 == 0 or self.ready(F, mb, k0 - 1, t)):
            return Action(F, mb, 0)
        return None

    def pick(self, r: int, t: int) -> Action | None:
        a = self._input_grad(r, t)
        if a is None and self.eager_loss_w and r == 0:
            loss_w = [w for w in self.pending_w[0] if w[1] == 1]
            if loss_w:
                self.pending_w[0].remove(loss_w[0])
                return Action(W, *loss_w[0])
        if a is None:
            a = self._forward(r, t)
            if a is not None and self.pending_w[r] and self.rng is not None and self.rng.random() < self.defer:
                a = None
        if a is None and self.pending_w[r]:
            mb, c = self.pending_w[r].pop(0)
            a = Action(W, mb, c)
        return a

    def commit(self, r: int, a: Action, t: int) -> None:
        end = t + _COST[a.kind]
        if a.kind is not W:  # B stands for stage 0's I (what the next actions wait on)
            self.done[(F if a.kind is F else I, a.microbatch, virtual_stage(r, a.chunk, self.p, "v"))] = end
        self.orders[r].append(a)
        self.free[r] = end
        if a.kind is F:
            self.held[r] += 1
            self.next_f0[r] += a.chunk == 0
        elif a.kind is I:
            self.pending_w[r].append((a.microbatch, a.chunk))
        else:
            self.held[r] -= 1


def _list_schedule(p: int, m: int, limit: int, whole_stage0: bool,
                   rng: Optional[random.Random] = None, defer: float = 0.0,
                   eager_loss_w: bool = False) -> list[list[Action]]:
    """One run of the list scheduler (module docstring). ``whole_stage0=False`` plans stage 0
    as if its backward split like the others (I then W, one unit each) and then makes its
    ``I`` the one ``B`` and drops its ``W``: the original ZB-V plan of uniform costs.
    ``rng``, ``defer``: the randomised variant (:class:`_Greedy`)."""
    g = _Greedy(p, m, limit, whole_stage0, rng, defer, eager_loss_w)
    total = 6 * p * m - (m if whole_stage0 else 0)  # F, I, W of 2 chunks x m micro-batches on p ranks
    count, t = 0, 0
    while count < total:
        for r in range(p):  # every free rank decides on what has ended by time t
            if g.free[r] <= t:
                a = g.pick(r, t)
                if a is not None:
                    g.commit(r, a, t)
                    count += 1
        later = [x for x in (*g.free, *g.done.values()) if x > t]
        if not later and count < total:  # cannot happen: chunk-1 F and I are never gated
            raise RuntimeError(f"zb-v list scheduler made no progress (p={p}, m={m})")
        t = min(later, default=t)
    if not whole_stage0:
        g.orders[0] = [Action(B, a.microbatch) if a.chunk == 0 and a.kind is I else a
                       for a in g.orders[0] if not (a.chunk == 0 and a.kind is W)]
    return g.orders


def _held_peak(order: list[Action]) -> int:
    """Most chunk activations held along one rank's order (F adds one, B or W frees one)."""
    held = peak = 0
    for a in order:
        held += 1 if a.kind is F else -1 if a.kind in (B, W) else 0
        peak = max(peak, held)
    return peak


# The order's memory model, in units of one chunk's forward activation (what a one-block
# forward saves), measured with the live tracker on the benchmark's model (hidden 128, vocab 512;
# benchmarks/pipeline_memory.py, benchmarks/results/zb-v_memory_cpu-2core_2026-11-27b.md):
# after its I a chunk still holds 0.9 of it until its W (the weight pass's inputs beside the
# output gradients captured for it); an input pass needs 0.75 more while it runs (the gradients
# it captures, beside the saved tensors it drops only at its end), a whole backward 0.25. The
# loss chunk (rank 0, chunk 1) saves 1.2 (the head's logits too) and keeps 1.15 until its W (the
# logits' gradient: vocabulary-sized per token, the largest thing a deferred W holds), its
# input pass needs 1.0.
_PENDING_W, _I_WORK, _B_WORK = 0.9, 0.75, 0.25
_LOSS_F, _LOSS_PENDING_W, _LOSS_I_WORK = 1.2, 1.15, 1.0


def _memory_peak(order: Sequence[Action], rank: int) -> float:
    """Peak of one rank's activation memory along its order under the model above."""
    held = peak = 0.0
    for a in order:
        loss = rank == 0 and a.chunk == 1
        size, pending = (_LOSS_F, _LOSS_PENDING_W) if loss else (1.0, _PENDING_W)
        if a.kind is F:
            held += size
            peak = max(peak, held)
        elif a.kind is I:
            peak = max(peak, held + (_LOSS_I_WORK if loss else _I_WORK))
            held -= size - pending
        elif a.kind is W:
            held -= pending
        else:
            peak = max(peak, held + _B_WORK)
            held -= size
    return peak


_DEFERS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


@functools.lru_cache(maxsize=64)
def zb_v_orders(p: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's ZB-V compute order (module docstring), indexed by rank.

    Candidates: the list scheduler's deterministic plans (stage 0 planned whole or split,
    chunk cap ``p .. 2p``, the loss chunk's ``W`` deferred or eager), then seeded randomised
    ones (a rank sometimes runs a pending ``W`` before a forward it could run; the seed is a
    function of ``(p, m)``, so every rank and process builds the same order). Kept: a plan
    within the memory budget if any, then the shortest makespan under the default cost table,
    then the smallest modelled memory. The budget: at most ``2p`` chunk activations held
    (``p`` stages, 1F1B's rank 0) and a modelled peak (:func:`_memory_peak`) of at most
    ``2p`` chunk activations plus one input pass's working memory. The search stops at the
    first plan within the budget on the lower bound ``6m + p - 1``; the randomised trials are
    capped (fewer for large ``p m^2``, the cost of one plan)."""
    bound = 6 * m + p - 1
    budget = 2 * p + _I_WORK
    best: tuple[tuple[bool, float, float], list[list[Action]]] | None = None

    def consider(orders: list[list[Action]]) -> bool:
        nonlocal best
        span = max(end for row in reference_times(orders, p, 2, placement="v") for _, end in row)
        memory = max(_memory_peak(o, r) for r, o in enumerate(orders))
        over = max(_held_peak(o) for o in orders) > 2 * p or memory > budget + 1e-9
        key = (over, span, memory)
        if best is None or key < best[0]:
            best = (key, orders)
        return not over and span <= bound

    done = False
    for eager in (False, True):
        for whole in (True, False):
            for limit in range(2 * p, p - 1, -1):
                done = consider(_list_schedule(p, m, limit, whole, eager_loss_w=eager)) or done
    for eager, seed in ((False, 1_000_003 * p + m), (True, 7_000_003 * p + m)):
        rng = random.Random(seed)
        trials = 0 if done else min(48, max(4, 400_000 // (p * m * m)))
        for _ in range(trials):
            limit = 2 * p if rng.random() < 0.6 else rng.randint(p, 2 * p)
            defer, whole = rng.choice(_DEFERS), rng.random() < 0.7
            if consider(_list_schedule(p, m, limit, whole, rng, defer, eager)):
                done = True
                break
    assert best is not None
    return tuple(tuple(o) for o in best[1])


# ------------------------------------------------------------------ DualPipeV
def dualpipe_v_order(rank: int, p: int, m: int) -> list[Action]:
    """Rank ``rank``'s DualPipeV compute order (DeepSeek-V3's DualPipe folded into a V, as in
    DeepSeek's open DualPipeV schedule), in eight phases. Forwards and backwards take the next
    micro-batch of their chunk in order; a zero-bubble backward is an ``I`` whose ``W`` joins a
    FIFO queue that the ``W`` steps drain; every other backward is one ``B``. An overlapped
    forward-backward pair (``F`` of one chunk, then the backward of the other) is two adjacent
    actions: this executor runs them one after the other (overlapping them needs two streams).
    Needs ``m >= 2p`` micro-batches (the steady phase 4 has ``m - 2p + rank + 1`` pairs)."""
    nf, nb = [0, 0], [0, 0]  # next micro-batch of each chunk's forward / backward
    queue: list[Action] = []  # deferred weight passes, oldest first
    out: list[Action] = []

    def fwd(c: int) -> None:
        out.append(Action(F, nf[c], c))
        nf[c] += 1

    def bwd(c: int, zero_bubble: bool = False) -> None:
        if zero_bubble:
            out.append(Action(I, nb[c], c))
            queue.append(Action(W, nb[c], c))
        else:
            out.append(Action(B, nb[c], c))
        nb[c] += 1

    def weight() -> None:
        out.append(queue.pop(0))

    r = rank
    for _ in range(2 * (p - r - 1)):  # 1: nF0
        fwd(0)
    for _ in range(r + 1):  # 2: nF0F1
        fwd(0)
        fwd(1)
    for _ in range(p - r - 1):  # 3: nB1W1F1 (zero bubble)
        bwd(1, True)
        weight()
        fwd(1)
    for _ in range(m - 2 * p + r + 1):  # 4 (main): nF0B1F1B0, overlapped pairs
        fwd(0)
        bwd(1)
        fwd(1)
        bwd(0)
    for _ in range(p - r - 1):  # 5: nB1F1B0
        bwd(1)
        fwd(1)
        bwd(0)
    zero_bubble = False
    for i in range(r + 1):  # 6: nB1B0, the second half zero bubble
        if i == (r + 1) // 2 and r % 2 == 1:
            zero_bubble = True
        bwd(1, zero_bubble)
        if i == (r + 1) // 2 and r % 2 == 0:
            zero_bubble = True
        bwd(0, zero_bubble)
    for _ in range(p - r - 1):  # 7: nWB0 (zero bubble)
        weight()
        bwd(0, True)
    while queue:  # 8: nW
        weight()
    return out
