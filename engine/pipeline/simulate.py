"""Check and time pipeline schedules on the CPU with no processes.

:func:`simulate` takes every rank's action list and

1. checks each rank's list: every (microbatch, chunk) gets exactly one forward and
   either one full backward or one input-grad plus one weight-grad, in a valid order
   (receive -> F -> send; receive grad -> B/I -> send grad; I -> W), and the sends and
   receives a chunk needs are there - no more, no fewer;
2. pairs every send with the matching receive on the neighbouring rank;
3. runs the lists under the executor's communication model and reports a deadlock
   (naming every blocked rank and what it waits for) if no rank can move;
4. counts the peak number of microbatches whose activations a rank holds, and computes
   the makespan and the bubble fraction under a per-action cost model.

The one pipeline timing model and cost table of the package: :func:`cost_table` (how a
backward splits into zb-h1's input and weight passes), :func:`per_stage_costs` (the
planner's per-piece costs), :func:`bubble_fraction` (also the measured bubble of
:mod:`engine.pipeline.timeline`), and :func:`reference_times`, the same dependency model
with free communication on compute-only lists, from which
:func:`engine.pipeline.schedule.place_comms` orders the transfers.

Placement (``placement="loop"`` or ``"v"``, :mod:`engine.pipeline.actions`): which model stage
each (rank, chunk) holds. A hop between two chunks of one rank (V placement's turn) is local:
no send or receive, the consumer must come after its producer in the rank's own list.

``forward_only=True`` checks an evaluation schedule
(:func:`engine.pipeline.schedule.forward_only`): one forward per (microbatch, chunk) with
its activation transfers, and no backward or gradient transfer at all.

Communication model (the executor's; see :mod:`engine.pipeline.executor`): a run of
consecutive comm actions is one batch, posted without waiting when the rank reaches it.
Each rank has one FIFO communication stream, as NCCL has: a batch starts once it is
posted and the rank's previous batch has finished, and finishes once the batch of every
partner op has started (a send waits for its receive: nothing is buffered). A compute
that consumes a received tensor waits for that batch to finish. A schedule that passes
here does not deadlock on gloo (less constrained) or on NCCL.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence, Union

from engine.pipeline.actions import (
    Action,
    ActionKind,
    ScheduleError,
    comm_batches,
    is_local_hop,
    next_hop,
    prev_hop,
    stage_and_chunk,
    virtual_stage,
)

__all__ = ["ScheduleError", "TimedAction", "SimResult", "simulate", "check_actions", "reference_times",
           "producer", "DEFAULT_COSTS", "CostModel", "cost_table", "per_stage_costs", "bubble_fraction",
           "bubble_formula", "format_timeline"]

K = ActionKind
CostModel = Union[Mapping[str, float], Callable[[int, Action], float]]


# ------------------------------------------------------------------ the cost table
def cost_table(forward: float = 1.0, backward: float = 2.0, input_grad: Optional[float] = None) -> dict[str, float]:
    """Time of each compute kind for one (stage, chunk): the one place that says how a
    backward splits. ``F`` = forward, ``B`` = the full backward; zb-h1's input-grad ``I``
    is ``input_grad`` (default half the backward) and its weight-grad ``W`` the rest."""
    i = backward / 2 if input_grad is None else input_grad
    return {"F": forward, "B": backward, "I": i, "W": backward - i}


# backward = 2 x forward, split evenly: the analytic formulas', the tests' and the
# communication placement's (engine.pipeline.schedule) cost model
DEFAULT_COSTS: Mapping[str, float] = cost_table()


def per_stage_costs(forward: Sequence[float], backward: Sequence[float],
                    num_stages: int, placement: str = "loop") -> Callable[[int, Action], float]:
    """A cost model from per-virtual-stage forward and backward times (index: the model stage
    of (rank, chunk) under ``placement``, the order of the model's pieces), split by :func:`cost_table`."""
    tables = [cost_table(f, b) for f, b in zip(forward, backward)]
    return lambda rank, a: tables[virtual_stage(rank, a.chunk, num_stages, placement)][a.kind.value]


def bubble_fraction(busy: Sequence[float], span: float) -> float:
    """Idle share of ``len(busy)`` ranks over ``span``: 1 - sum(busy) / (ranks x span);
    the simulator's, the planner's and the measured (engine.pipeline.timeline) bubble."""
    return 1.0 - sum(busy) / (len(busy) * span) if span > 0 else 0.0


@dataclass(frozen=True)
class TimedAction:
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    makespan: float
    bubble_fraction: float  # idle time over (ranks * makespan)
    busy: tuple[float, ...]  # compute time per rank
    peak_activations: tuple[int, ...]  # max microbatch-chunks held (F done, B/W not yet) per rank
    timeline: tuple[tuple[TimedAction, ...], ...]  # per rank, compute and comm batches with times


def bubble_formula(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1,
                   forward: float = 1.0, backward: float = 2.0) -> float:
    """The analytic bubble fraction with equal stages and free communication.

    gpipe / 1f1b: (p-1)/(m+p-1); interleaved-1f1b: (p-1)/(v*m+p-1). zb-h1 (backward split
    evenly, input grad b_i = weight grad b_w = backward/2, m >= p): a rank idles only
    (p-1)*(f + b_i - b_w) while its busy time stays m*(f + backward) - with backward =
    2 x forward a third of 1F1B's idle time (p-1)*(f + backward). zb-v (two half-stage chunks
    per rank, backward split evenly, m >= p): only the first forwards wait, (p-1)*f/2; the
    lower bound, which :mod:`engine.pipeline.vshape`'s order attains for the micro-batch counts listed
    there (stage 0, which has no input gradient, runs one whole backward in that order).
    """
    p, m, v = num_stages, num_microbatches, virtual_stages
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zb-h1":
        if m < p:
            raise ValueError(f"the zb-h1 bubble formula assumes microbatches ({m}) >= stages ({p})")
        b_in = b_w = backward / 2
        idle = (p - 1) * max(forward + b_in - b_w, 0.0)
        return idle / (m * (forward + backward) + idle)
    if schedule == "zb-v":  # forward, backward: of a whole stage; a chunk does half of each
        if m < p:
            raise ValueError(f"the zb-v bubble formula assumes microbatches ({m}) >= stages ({p})")
        # only the start: rank p-1 waits p-1 chunk forwards; W's fill every later gap
        idle = (p - 1) * forward / 2
        return idle / (m * (forward + backward) + idle)
    raise ValueError(f"no bubble formula for schedule {schedule!r}")


def format_timeline(result: "SimResult", slot: float = 1.0) -> str:
    """A stage x time table of the compute actions, one cell per ``slot`` of time ('.' = idle)."""
    n = int(round(result.makespan / slot))
    rows = []
    for timed in result.timeline:
        cells = ["."] * n
        for t in timed:
            if t.action.is_compute:
                for i in range(int(round(t.start / slot)), int(round(t.end / slot))):
                    cells[i] = str(t.action)
        rows.append(cells)
    width = max((len(c) for r in rows for c in r), default=1)
    return "\n".join(f"stage {s}: " + " ".join(c.ljust(width) for c in r).rstrip()
                     for s, r in enumerate(rows))


# ------------------------------------------------------------------ static checks
def _num_chunks(per_rank: Sequence[Sequence[Action]]) -> int:
    return 1 + max((a.chunk for acts in per_rank for a in acts), default=0)


_BACKWARD_KINDS = (K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT, K.RECV_GRAD, K.SEND_GRAD)


def _check_rank(rank: int, actions: Sequence[Action], p: int, m: int, v: int, forward_only: bool = False,
                placement: str = "loop") -> None:
    seen: Counter = Counter()
    where = f"rank {rank}"
    for idx, a in enumerate(actions):
        at = f"{where}, action #{idx} ({a})"
        _check_bounds(a, at, m, v, forward_only)
        _check_order(rank, a, at, seen, p, v, placement)
        seen[(a.kind, (a.microbatch, a.chunk))] += 1

    _check_complete(rank, seen, p, m, v, forward_only, placement)


def _check_bounds(a: Action, at: str, m: int, v: int, forward_only: bool) -> None:
    """``a`` names a micro-batch and chunk that exist, and no backward in an evaluation schedule."""
    if forward_only and a.kind in _BACKWARD_KINDS:
        raise ScheduleError(f"{at}: a forward-only (evaluation) schedule has no backward or gradient transfer")
    if a.microbatch >= m:
        raise ScheduleError(f"{at}: microbatch {a.microbatch} is outside [0, {m})")
    if a.chunk >= v:
        raise ScheduleError(f"{at}: chunk {a.chunk} is outside [0, {v})")


def _check_order(rank: int, a: Action, at: str, seen: Counter, p: int, v: int, placement: str = "loop") -> None:
    """Every action ``a`` depends on on this rank (``seen``, the actions before it) came first."""
    key = (a.microbatch, a.chunk)
    prev, nxt = prev_hop(rank, a.chunk, p, placement), next_hop(rank, a.chunk, p, v, placement)
    if seen[(a.kind, key)]:
        raise ScheduleError(f"{at}: duplicate action")
    if _check_local(a, at, seen, rank, prev, nxt):
        return
    has_prev, has_next = prev is not None, nxt is not None

    def need(kind: ActionKind, why: str) -> None:
        if not seen[(kind, key)]:
            raise ScheduleError(f"{at}: comes before {Action(kind, *key)} ({why})")

    k = a.kind
    if k is K.RECV_ACT and not has_prev or k is K.SEND_ACT and not has_next:
        raise ScheduleError(f"{at}: this chunk has no neighbour in that direction")
    if k is K.RECV_GRAD and not has_next or k is K.SEND_GRAD and not has_prev:
        raise ScheduleError(f"{at}: this chunk has no neighbour in that direction")
    if k is K.FORWARD and has_prev:
        need(K.RECV_ACT, "a forward needs its input activation")
    if k is K.SEND_ACT:
        need(K.FORWARD, "the activation is sent after the forward")
    if k in (K.BACKWARD, K.BACKWARD_INPUT):
        need(K.FORWARD, "a backward needs its forward")
        if has_next:
            need(K.RECV_GRAD, "a backward needs its output gradient")
        other = K.BACKWARD_INPUT if k is K.BACKWARD else K.BACKWARD
        if seen[(other, key)]:
            raise ScheduleError(f"{at}: mixes a full backward with a split one")
    if k is K.BACKWARD_WEIGHT:
        need(K.BACKWARD_INPUT, "the weight grad follows the input grad")
    if k is K.SEND_GRAD and not (seen[(K.BACKWARD, key)] or seen[(K.BACKWARD_INPUT, key)]):
        raise ScheduleError(f"{at}: the input gradient is sent before it is computed")


def _check_local(a: Action, at: str, seen: Counter, rank: int, prev: Optional[tuple[int, int]],
                 nxt: Optional[tuple[int, int]]) -> bool:
    """Checks of an action next to a local hop (V placement's turn); True when nothing else applies.

    A local hop has no transfer: the forward after it needs the producer's forward earlier in
    this list, the backward before it needs the consumer's input-grad (or full backward)."""
    k, mb = a.kind, a.microbatch
    local_prev, local_next = is_local_hop(rank, prev), is_local_hop(rank, nxt)
    if (k in (K.RECV_ACT, K.SEND_GRAD) and local_prev) or (k in (K.SEND_ACT, K.RECV_GRAD) and local_next):
        raise ScheduleError(f"{at}: the neighbour chunk is on this rank (a local hop has no transfer)")
    if k is K.FORWARD and local_prev and prev is not None and not seen[(K.FORWARD, (mb, prev[1]))]:
        raise ScheduleError(f"{at}: comes before {Action(K.FORWARD, mb, prev[1])} (its local producer)")
    if k in (K.BACKWARD, K.BACKWARD_INPUT) and local_next and nxt is not None and not (
            seen[(K.BACKWARD, (mb, nxt[1]))] or seen[(K.BACKWARD_INPUT, (mb, nxt[1]))]):
        raise ScheduleError(f"{at}: comes before the backward of microbatch {mb} chunk {nxt[1]} "
                            f"(its local output gradient)")
    if k is K.FORWARD and local_prev:
        return True  # its input is local: no receive to check
    if k in (K.BACKWARD, K.BACKWARD_INPUT) and local_next:
        _check_backward_has_forward(a, at, seen)
        return True
    return False


def _check_backward_has_forward(a: Action, at: str, seen: Counter) -> None:
    key = (a.microbatch, a.chunk)
    if not seen[(K.FORWARD, key)]:
        raise ScheduleError(f"{at}: comes before {Action(K.FORWARD, *key)} (a backward needs its forward)")
    other = K.BACKWARD_INPUT if a.kind is K.BACKWARD else K.BACKWARD
    if seen[(other, key)]:
        raise ScheduleError(f"{at}: mixes a full backward with a split one")


def _check_complete(rank: int, seen: Counter, p: int, m: int, v: int, forward_only: bool,
                    placement: str = "loop") -> None:
    """Every (microbatch, chunk) has all the actions it needs on rank ``rank``."""
    where = f"rank {rank}"
    for mb in range(m):
        for c in range(v):
            key = (mb, c)
            prev, nxt = prev_hop(rank, c, p, placement), next_hop(rank, c, p, v, placement)
            sends_act = nxt is not None and not is_local_hop(rank, nxt)
            sends_grad = prev is not None and not is_local_hop(rank, prev)
            missing = []
            if not seen[(K.FORWARD, key)]:
                missing.append(str(Action(K.FORWARD, mb, c)))
            if forward_only:
                if sends_act and not seen[(K.SEND_ACT, key)]:
                    missing.append(str(Action(K.SEND_ACT, mb, c)))
                if missing:
                    raise ScheduleError(f"{where}: microbatch {mb} chunk {c} is missing {', '.join(missing)}")
                continue
            if not (seen[(K.BACKWARD, key)] or seen[(K.BACKWARD_INPUT, key)]):
                missing.append(str(Action(K.BACKWARD, mb, c)))
            if seen[(K.BACKWARD_INPUT, key)] and not seen[(K.BACKWARD_WEIGHT, key)]:
                missing.append(str(Action(K.BACKWARD_WEIGHT, mb, c)))
            if sends_grad and not seen[(K.SEND_GRAD, key)]:
                missing.append(str(Action(K.SEND_GRAD, mb, c)))
            if sends_act and not seen[(K.SEND_ACT, key)]:
                missing.append(str(Action(K.SEND_ACT, mb, c)))
            if missing:
                raise ScheduleError(f"{where}: microbatch {mb} chunk {c} is missing {', '.join(missing)}")


def _peer_key(rank: int, a: Action, p: int, v: int, placement: str = "loop") -> tuple:
    """A key equal for a send and the receive it pairs with: (kind of data, microbatch, sender vstage)."""
    vs = virtual_stage(rank, a.chunk, p, placement)
    if a.kind is K.SEND_ACT:
        return ("act", a.microbatch, vs)
    if a.kind is K.RECV_ACT:
        return ("act", a.microbatch, vs - 1)
    if a.kind is K.SEND_GRAD:
        return ("grad", a.microbatch, vs)
    return ("grad", a.microbatch, vs + 1)  # RECV_GRAD


def check_actions(per_rank: Sequence[Sequence[Action]], num_microbatches: int,
                  virtual_stages: Optional[int] = None, forward_only: bool = False,
                  placement: str = "loop") -> None:
    """Static checks (1) and (2) of the module docstring; raises :class:`ScheduleError`."""
    p, m = len(per_rank), num_microbatches
    v = virtual_stages if virtual_stages is not None else _num_chunks(per_rank)
    if p < 1:
        raise ScheduleError("no ranks given")
    for r, acts in enumerate(per_rank):
        _check_rank(r, acts, p, m, v, forward_only, placement)
    sends: Counter[tuple] = Counter()
    recvs: Counter[tuple] = Counter()
    for r, acts in enumerate(per_rank):
        for a in acts:
            if a.is_comm:
                (sends if a.kind in (K.SEND_ACT, K.SEND_GRAD) else recvs)[_peer_key(r, a, p, v, placement)] += 1
    if sends != recvs:
        diff = sorted((sends - recvs).keys())[:3] + sorted((recvs - sends).keys())[:3]
        raise ScheduleError(f"unpaired sends/receives (kind, microbatch, sender virtual stage): {diff}")
    _check_pair_order(per_rank, p, v, placement)


def _check_pair_order(per_rank: Sequence[Sequence[Action]], p: int, v: int, placement: str = "loop") -> None:
    """Transfers from rank a to rank b are posted in the same order on both: NCCL (and gloo
    with one tag) pair the k-th send with the k-th receive, not by content."""
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    for r, acts in enumerate(per_rank):
        for a in acts:
            if not a.is_comm:
                continue
            key = _peer_key(r, a, p, v, placement)
            sender_rank = stage_and_chunk(key[2], p, placement)[0]
            if a.kind in (K.SEND_ACT, K.SEND_GRAD):
                receiver = stage_and_chunk(key[2] + (1 if key[0] == "act" else -1), p, placement)[0]
                sent.setdefault((r, receiver), []).append(key)
            else:
                received.setdefault((sender_rank, r), []).append(key)
    for pair, keys in sent.items():
        if received.get(pair) != keys:
            raise ScheduleError(f"rank {pair[0]} posts its sends to rank {pair[1]} in another order than "
                                f"rank {pair[1]} posts the receives: {keys[:6]} vs {received.get(pair, [])[:6]}")


# ------------------------------------------------------------------ free-communication timing
def producer(stage: int, a: Action, p: int, v: int, placement: str = "loop") -> Optional[tuple[int, str, int, int]]:
    """(rank, "F" or "B", microbatch, chunk) of the neighbour compute whose output ``a`` consumes
    (on this very rank for a local hop)."""
    if a.kind is K.FORWARD:
        hop = prev_hop(stage, a.chunk, p, placement)
        return None if hop is None else (hop[0], "F", a.microbatch, hop[1])
    if a.kind in (K.BACKWARD, K.BACKWARD_INPUT):
        hop = next_hop(stage, a.chunk, p, v, placement)
        return None if hop is None else (hop[0], "B", a.microbatch, hop[1])
    return None


def reference_times(compute: Sequence[Sequence[Action]], num_stages: int, virtual_stages: int,
                    costs: Mapping[str, float] = DEFAULT_COSTS,
                    placement: str = "loop") -> list[list[tuple[float, float]]]:
    """(start, end) of every compute action when communication is free and instant: the
    simulator on compute-only lists (no sends or receives to pair yet), which
    :func:`engine.pipeline.schedule.place_comms` uses to order the transfers.

    Each rank runs its computes in order; a compute starts once the previous one on its
    rank has ended and the neighbour compute it consumes has ended.
    """
    p, v = num_stages, virtual_stages
    times: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    ended: dict[tuple[int, str, int, int], float] = {}
    clock = [0.0] * p
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while len(times[s]) < len(compute[s]):
                a = compute[s][len(times[s])]
                dep = producer(s, a, p, v, placement)
                if dep is not None and dep not in ended:
                    break
                start = max(clock[s], ended[dep] if dep is not None else 0.0)
                clock[s] = start + costs[a.kind.value]
                times[s].append((start, clock[s]))
                if a.kind is not K.BACKWARD_WEIGHT:
                    ended[(s, "F" if a.kind is K.FORWARD else "B", a.microbatch, a.chunk)] = clock[s]
                progress = True
    stuck = [s for s in range(p) if len(times[s]) < len(compute[s])]
    if stuck:
        raise ScheduleError("the compute orders wait on each other: "
                            + "; ".join(f"rank {s} at {compute[s][len(times[s])]}" for s in stuck))
    return times


# ------------------------------------------------------------------ timing
def _cost_fn(costs: Optional[CostModel]) -> Callable[[int, Action], float]:
    if callable(costs):
        return costs
    table = dict(DEFAULT_COSTS if costs is None else costs)
    return lambda rank, a: float(table[a.kind.value])


def _consumed_key(rank: int, a: Action, p: int, v: int, placement: str = "loop") -> Optional[tuple]:
    """Peer key of the receive compute ``a`` waits for, if any (none across a local hop: its
    producer ran earlier on this rank)."""
    if a.kind is K.FORWARD:
        hop = prev_hop(rank, a.chunk, p, placement)
        if hop is not None and not is_local_hop(rank, hop):
            return _peer_key(rank, Action(K.RECV_ACT, a.microbatch, a.chunk), p, v, placement)
    if a.kind in (K.BACKWARD, K.BACKWARD_INPUT):
        hop = next_hop(rank, a.chunk, p, v, placement)
        if hop is not None and not is_local_hop(rank, hop):
            return _peer_key(rank, Action(K.RECV_GRAD, a.microbatch, a.chunk), p, v, placement)
    return None


class _Run:
    """The state of one simulation: per rank a CPU pointer and a comm-stream pointer."""

    def __init__(self, per_rank: Sequence[Sequence[Action]], v: int, cost, comm_cost: float, placement: str = "loop"):
        self.p, self.v, self.cost, self.comm_cost = len(per_rank), v, cost, comm_cost
        self.placement = placement
        self.items = [comm_batches(list(acts)) for acts in per_rank]
        # the comm batches of each rank in order, as indices into items
        self.stream_items = [[i for i, (c, _) in enumerate(it) if c] for it in self.items]
        self.cpu = [0] * self.p  # next item for the CPU
        self.strm = [0] * self.p  # next batch (index into stream_items) for the stream
        self.clock = [0.0] * self.p
        self.stream_clock = [0.0] * self.p  # when the previous batch finished
        self.posted: dict[tuple[int, int], float] = {}  # (rank, item) -> post time
        self.started: dict[tuple, float] = {}  # (peer key, is_send) -> batch start time
        self.finished: dict[tuple, float] = {}  # peer key of a receive -> its batch finish
        self.timeline: list[list[TimedAction]] = [[] for _ in range(self.p)]
        self.busy = [0.0] * self.p
        self.held, self.peak = [0] * self.p, [0] * self.p
        self.holds = True  # forwards hold activations until their backward (not when evaluating)

    def _keys(self, r: int, acts: list[Action]) -> list[tuple[tuple, bool]]:
        return [(_peer_key(r, a, self.p, self.v, self.placement), a.kind in (K.SEND_ACT, K.SEND_GRAD)) for a in acts]

    def step_cpu(self, r: int) -> bool:
        if self.cpu[r] >= len(self.items[r]):
            return False
        is_comm, acts = self.items[r][self.cpu[r]]
        if is_comm:
            self.posted[(r, self.cpu[r])] = self.clock[r]
        else:
            a = acts[0]
            need = _consumed_key(r, a, self.p, self.v, self.placement)
            if need is not None and need not in self.finished:
                return False
            start = max(self.clock[r], self.finished[need] if need is not None else 0.0)
            dt = self.cost(r, a)
            self.timeline[r].append(TimedAction(a, start, start + dt))
            self.clock[r] = start + dt
            self.busy[r] += dt
            if self.holds:
                self.held[r] += (a.kind is K.FORWARD) - (a.kind in (K.BACKWARD, K.BACKWARD_WEIGHT))
            self.peak[r] = max(self.peak[r], self.held[r])
        self.cpu[r] += 1
        return True

    def step_stream(self, r: int) -> bool:
        if self.strm[r] >= len(self.stream_items[r]):
            return False
        item = self.stream_items[r][self.strm[r]]
        if (r, item) not in self.posted:
            return False
        acts = self.items[r][item][1]
        keys = self._keys(r, acts)
        start = max(self.posted[(r, item)], self.stream_clock[r])
        for key in keys:
            self.started.setdefault(key, start)
        partners = [(k, not is_send) for k, is_send in keys]
        if any(pk not in self.started for pk in partners):
            return False
        done = max([start] + [self.started[pk] for pk in partners]) + self.comm_cost
        for (k, is_send), a in zip(keys, acts):
            if not is_send:
                self.finished[k] = done
            self.timeline[r].append(TimedAction(a, start, done))
        self.stream_clock[r] = done
        self.strm[r] += 1
        return True

    def run(self) -> None:
        progress = True
        while progress:
            progress = False
            for r in range(self.p):
                while self.step_cpu(r) or self.step_stream(r):
                    progress = True
        blocked = [r for r in range(self.p) if self.cpu[r] < len(self.items[r])
                   or self.strm[r] < len(self.stream_items[r])]
        if blocked:
            raise ScheduleError("deadlock: " + "; ".join(self._describe(r) for r in blocked))

    def _describe(self, r: int) -> str:
        parts = []
        if self.cpu[r] < len(self.items[r]):
            parts.append(f"cpu at {' '.join(map(str, self.items[r][self.cpu[r]][1]))}")
        if self.strm[r] < len(self.stream_items[r]):
            batch = self.items[r][self.stream_items[r][self.strm[r]]][1]
            parts.append(f"stream at [{' '.join(map(str, batch))}]")
        return f"rank {r} " + ", ".join(parts)


def simulate(per_rank: Sequence[Sequence[Action]], num_microbatches: int,
             virtual_stages: Optional[int] = None, costs: Optional[CostModel] = None,
             comm_cost: float = 0.0, forward_only: bool = False, placement: str = "loop") -> SimResult:
    """Check, pair, run and time the schedule (module docstring). Raises ScheduleError.

    ``costs``: a mapping from action prefix ("F", "B", "I", "W") to time, or a callable
    ``(rank, action) -> time``. ``comm_cost`` is added to every comm batch.
    ``forward_only``: an evaluation schedule (no activation is held: peak 0).
    ``placement``: the schedule's stage placement (``"v"`` for zb-v / dualpipe-v;
    :func:`engine.pipeline.schedule.placement_of`).
    """
    check_actions(per_rank, num_microbatches, virtual_stages, forward_only, placement)
    v = virtual_stages if virtual_stages is not None else _num_chunks(per_rank)
    run = _Run(per_rank, v, _cost_fn(costs), comm_cost, placement)
    run.holds = not forward_only
    run.run()
    makespan = max(max(run.clock), max(run.stream_clock))
    bubble = bubble_fraction(run.busy, makespan)
    timeline = tuple(tuple(sorted(t, key=lambda x: (x.start, x.end))) for t in run.timeline)
    return SimResult(makespan=makespan, bubble_fraction=bubble, busy=tuple(run.busy),
                     peak_activations=tuple(run.peak), timeline=timeline)
