"""Compute orders of the V-shaped schedules (V placement, two chunks per rank): ``zb-v``.

V placement (:mod:`engine.pipeline.actions`): rank ``r`` holds model stages ``r`` (chunk 0)
and ``2p - 1 - r`` (chunk 1), so a micro-batch goes down the ranks on chunk 0, turns on rank
``p - 1`` without leaving it, and comes back up on chunk 1 to the loss on rank 0.

ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", §6) splits each backward into the input
grad ``I`` (on the critical path) and the weight grad ``W`` (deferrable), and fills every slot
where a rank would wait with a ``W``. The order is built here as data by a list scheduler
over all ranks in unit time steps (``F = I = W``, the default cost table's split of a backward
of twice the forward): at each step every rank takes, in this priority,

1. the ready ``I`` of the oldest micro-batch (chunk 1 first): gradients flow back without delay;
2. a ready chunk-1 ``F`` (it leads to the loss, so to the next ``I``); else the next chunk-0
   ``F`` while the rank's chunk activations (held, plus the chunk-1 forwards still owed to
   micro-batches already in chunk 0) stay within ``2p``: 1F1B's peak on rank 0, ``p``
   micro-batches of a whole stage = ``2p`` half-stage chunks;
3. the oldest pending ``W``.

So warm-up is forwards on chunk 0 then chunk 1, and the steady state interleaves F, I and W.
The peak is ``2p`` chunk activations on every rank (tests/unit/test_vshape.py). With ``m >= p``
the makespan is the lower bound ``6m + p - 1`` steps (rank ``p - 1`` must wait ``p - 1``
forwards at the start; no rank waits after that), the bubble of
:func:`engine.pipeline.simulate.bubble_formula`, for p = 2 and 4 and odd m at p = 3 (even m
at p = 3: one step more; the memory cap is what costs it). The order is only a list per rank: the
simulator checks it (and the communication placed around it) under any cost model.
"""

from __future__ import annotations

import functools

from engine.pipeline.actions import Action, ActionKind, virtual_stage

__all__ = ["zb_v_orders"]

F, I, W = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


class _Greedy:
    """The state of the list scheduler: what is done (and when), per rank what it holds."""

    def __init__(self, p: int, m: int, limit: int) -> None:
        self.p, self.m, self.limit = p, m, limit
        self.done: dict[tuple[ActionKind, int, int], int] = {}  # (kind, mb, model stage) -> end step
        self.orders: list[list[Action]] = [[] for _ in range(p)]
        self.held = [0] * p  # chunk activations held (forward done, weight grad not yet)
        self.next_f0 = [0] * p  # next micro-batch of chunk 0 (fed in order)
        self.pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # (mb, chunk), oldest first

    def ready(self, kind: ActionKind, mb: int, stage: int, t: int) -> bool:
        end = self.done.get((kind, mb, stage))
        return end is not None and end <= t

    def _input_grad(self, r: int, t: int) -> Action | None:
        last = 2 * self.p - 1
        for mb in range(self.m):
            for c in (1, 0):
                k = virtual_stage(r, c, self.p, "v")
                if (I, mb, k) in self.done or not self.ready(F, mb, k, t):
                    continue
                if k == last or self.ready(I, mb, k + 1, t):
                    return Action(I, mb, c)
        return None

    def _forward(self, r: int, t: int) -> Action | None:
        k1 = virtual_stage(r, 1, self.p, "v")
        for mb in range(self.m):
            if (F, mb, k1) not in self.done and self.ready(F, mb, k1 - 1, t):
                return Action(F, mb, 1)
        mb, k0 = self.next_f0[r], virtual_stage(r, 0, self.p, "v")
        # room is reserved for the chunk-1 forwards still to come of the micro-batches already in
        # chunk 0 (never gated, they lead to the loss): the peak stays 2p chunk activations
        reserved = self.held[r] + sum(1 for j in range(mb) if (F, j, k1) not in self.done)
        if mb < self.m and reserved + 1 <= self.limit and (k0 == 0 or self.ready(F, mb, k0 - 1, t)):
            return Action(F, mb, 0)
        return None

    def pick(self, r: int, t: int) -> Action | None:
        a = self._input_grad(r, t) or self._forward(r, t)
        if a is None and self.pending_w[r]:
            mb, c = self.pending_w[r].pop(0)
            a = Action(W, mb, c)
        return a

    def commit(self, r: int, a: Action, t: int) -> None:
        self.done[(a.kind, a.microbatch, virtual_stage(r, a.chunk, self.p, "v"))] = t + 1
        self.orders[r].append(a)
        if a.kind is F:
            self.held[r] += 1
            self.next_f0[r] += a.chunk == 0
        elif a.kind is I:
            self.pending_w[r].append((a.microbatch, a.chunk))
        else:
            self.held[r] -= 1


@functools.lru_cache(maxsize=64)
def zb_v_orders(p: int, m: int, limit: int = 0) -> tuple[tuple[Action, ...], ...]:
    """Every rank's ZB-V compute order (module docstring), indexed by rank."""
    g = _Greedy(p, m, limit or 2 * p)
    total, t = 6 * p * m, 0  # F, I, W of 2 chunks x m micro-batches on each of p ranks
    while sum(len(o) for o in g.orders) < total:
        picked = [(r, g.pick(r, t)) for r in range(p)]  # decided on the state before step t
        for r, a in picked:
            if a is not None:
                g.commit(r, a, t)
        t += 1
        if t > 4 * total:  # cannot happen: some rank can always move (chunk-1 F and I are never gated)
            raise RuntimeError(f"zb-v list scheduler made no progress (p={p}, m={m})")
    return tuple(tuple(o) for o in g.orders)
