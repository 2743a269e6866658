"""Pipeline schedules as pure functions: (stage, num_stages, num_microbatches) -> actions.

Each schedule first orders the rank's COMPUTE actions (the part that differs between
schedules: :func:`compute_order`), then :func:`place_comms` adds the point-to-point
actions the same way for all of them, from one reference timeline of all ranks: a send
right after the compute that produced its data, a receive before the compute during
which its data arrives, and every rank's transfers in one global order. The executor
posts a receive without waiting and waits only when the consuming compute starts; the
global order is what keeps FIFO communication streams (NCCL) free of cycles. The
simulator (:mod:`engine.pipeline.simulate`) checks both properties for any cost model.

Names (``pipeline.schedule`` and every command line): ``gpipe``, ``1f1b``,
``interleaved-1f1b`` (with ``virtual_stages`` model chunks per rank), ``zb-h1``, and ``zb-v``
and ``dualpipe-v`` (two chunks per rank in V placement, :mod:`engine.pipeline.vshape`). Which model stage a
rank's chunk holds is :func:`stage_index`, the one answer for every schedule.
Evaluation runs :func:`forward_only` (no backward, any number of micro-batches and model
chunks) through the same executor; the simulator checks it with ``forward_only=True``.
"""

from __future__ import annotations

import functools
from collections import deque
from typing import Callable, Sequence

from engine.errors import ConfigError
from engine.pipeline.actions import Action, ActionKind, is_local_hop, next_hop, prev_hop, stage_and_chunk, virtual_stage
from engine.pipeline.simulate import producer, reference_times
from engine.pipeline.vshape import dualpipe_v_order, zb_v_orders
from engine.validate import check_int

__all__ = [
    "SCHEDULES",
    "V_SCHEDULES",
    "placement_of",
    "stage_index",
    "loss_stage",
    "build_schedule",
    "build_all",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zb_h1",
    "zb_v",
    "forward_only",
    "build_all_forward_only",
    "compute_order",
    "place_comms",
    "check_schedule_args",
    "format_table",
    "schedule_table",
]

F, B, I, W = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT,
              ActionKind.BACKWARD_WEIGHT)

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v")
V_SCHEDULES = ("zb-v", "dualpipe-v")  # V placement, exactly two chunks per rank


def placement_of(name: str) -> str:
    """The stage placement of schedule ``name``: ``"v"`` for the V-shaped ones, else ``"loop"``."""
    return "v" if name in V_SCHEDULES else "loop"


def stage_index(name: str, rank: int, chunk: int, num_stages: int, virtual_stages: int = 1) -> int:
    """The model stage (piece of the layer list, 0 = embedding side) that ``chunk`` of pipeline
    rank ``rank`` holds under schedule ``name``: ``chunk * p + rank`` for the loop placement
    (interleaved 1F1B's; the rank itself with one chunk), ``rank`` / ``2p - 1 - rank`` for V."""
    check_int("num_stages (pipeline-parallel size)", num_stages, minimum=1)
    check_int("virtual_stages", virtual_stages, minimum=1)
    check_int("rank", rank, minimum=0, maximum=num_stages - 1, fix=f"it is outside the {num_stages} stages")
    check_int("chunk", chunk, minimum=0, maximum=virtual_stages - 1,
              fix=f"it is outside the {virtual_stages} chunks per rank")
    return virtual_stage(rank, chunk, num_stages, placement_of(name))


def loss_stage(name: str, num_stages: int, virtual_stages: int = 1) -> int:
    """The pipeline rank holding the last model stage (the head and the loss): ``p - 1`` in the
    loop placement, 0 in V placement (where it also holds the embedding)."""
    check_int("num_stages (pipeline-parallel size)", num_stages, minimum=1)
    check_int("virtual_stages", virtual_stages, minimum=1)
    return stage_and_chunk(num_stages * virtual_stages - 1, num_stages, placement_of(name))[0]


def check_schedule_args(name: str, stage: int, num_stages: int, num_microbatches: int,
                        virtual_stages: int = 1) -> None:
    """Raise ConfigError naming the problem and the fix for an unsupported combination."""
    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline.schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    check_int("num_stages (pipeline-parallel size)", num_stages, minimum=1)
    check_int("num_microbatches (gradient_accumulation_steps)", num_microbatches, minimum=1)
    check_int("pipeline.virtual_stages", virtual_stages, minimum=1)
    check_int("stage", stage, minimum=0, maximum=num_stages - 1, fix=f"it is outside the {num_stages} stages")
    if name == "interleaved-1f1b":
        if num_stages < 2:
            raise ConfigError("interleaved-1f1b needs at least 2 pipeline stages; use 1f1b for pp=1")
        if virtual_stages < 2:
            raise ConfigError("interleaved-1f1b needs pipeline.virtual_stages >= 2 "
                              "(with 1 chunk per rank use 1f1b)")
        if num_microbatches % num_stages != 0:
            raise ConfigError(
                f"interleaved-1f1b needs the number of microbatches ({num_microbatches}) to be a "
                f"multiple of the pipeline stages ({num_stages}): set gradient_accumulation_steps "
                f"to a multiple of {num_stages}")
    elif name in V_SCHEDULES:
        if num_stages < 2:
            raise ConfigError(f"{name} needs at least 2 pipeline stages; use 1f1b for pp=1")
        if virtual_stages != 2:
            raise ConfigError(f"{name} runs exactly two model chunks per rank (V placement): set "
                              f"pipeline.virtual_stages to 2 (got {virtual_stages})")
        if name == "dualpipe-v" and num_microbatches < 2 * num_stages:
            raise ConfigError(f"dualpipe-v needs at least 2 x pipeline stages = {2 * num_stages} micro-batches "
                              f"(got {num_microbatches}): raise gradient_accumulation_steps, or use zb-v")
    elif virtual_stages != 1:
        raise ConfigError(f"pipeline.virtual_stages={virtual_stages} needs schedule "
                          f"'interleaved-1f1b' (or 2 with a V schedule: {', '.join(V_SCHEDULES)}); "
                          f"{name!r} runs one model chunk per rank (set it to 1)")


# ------------------------------------------------------------------ comm placement
def place_comms(compute: Sequence[Sequence[Action]], num_stages: int,
                virtual_stages: int, placement: str = "loop") -> list[list[Action]]:
    """Interleave every rank's compute order with the sends and receives it needs.

    Each transfer gets a time T (when its producer ends in the simulator's free-communication
    timeline, :func:`engine.pipeline.simulate.reference_times`, default costs) and a
    tie-break (data kind, microbatch, sender virtual stage) that both ends compute alike.
    Every rank posts its transfers in (T, tie-break) order - one global order, so FIFO
    communication streams (NCCL) never wait on each other in a cycle - and a receive is
    posted before the compute during which its data arrives, a send right after the
    compute that produced it. A rank then never waits longer than the data takes. A local
    hop (both chunks on one rank, ``placement="v"``) gets no transfer.
    """
    p, v, pl = num_stages, virtual_stages, placement
    times = reference_times(compute, p, v, placement=pl)
    end_of = {(s, "F" if a.kind is F else "B", a.microbatch, a.chunk): t[1]
              for s in range(p) for a, t in zip(compute[s], times[s]) if a.kind is not W}
    out: list[list[Action]] = []
    for s in range(p):
        ops: list[tuple[tuple, Action]] = []
        for a in compute[s]:
            if a.kind is W:
                continue
            vs = virtual_stage(s, a.chunk, p, pl)
            data = 0 if a.kind is F else 1
            dep = producer(s, a, p, v, pl)
            if dep is not None and dep[0] != s:  # receive: sender is the producer's virtual stage
                sender = virtual_stage(dep[0], dep[3], p, pl)
                recv = ActionKind.RECV_ACT if a.kind is F else ActionKind.RECV_GRAD
                ops.append(((end_of[dep], data, a.microbatch, sender), Action(recv, a.microbatch, a.chunk)))
            consumer = next_hop(s, a.chunk, p, v, pl) if a.kind is F else prev_hop(s, a.chunk, p, pl)
            if consumer is not None and not is_local_hop(s, consumer):
                send = ActionKind.SEND_ACT if a.kind is F else ActionKind.SEND_GRAD
                key = (end_of[(s, "F" if a.kind is F else "B", a.microbatch, a.chunk)], data, a.microbatch, vs)
                ops.append((key, Action(send, a.microbatch, a.chunk)))
        ops.sort(key=lambda x: x[0])
        row: list[Action] = []
        j = 0
        for a, (_, end) in zip(compute[s], times[s]):
            while j < len(ops) and ops[j][0][0] < end:  # everything that happens before `a` ends
                row.append(ops[j][1])
                j += 1
            row.append(a)
        row.extend(op for _, op in ops[j:])
        out.append(row)
    return out

# ------------------------------------------------------------------ compute orders
def _gpipe_compute(stage: int, p: int, m: int) -> list[Action]:
    # All forwards, then all backwards: every stage holds all m activations at the peak.
    return [Action(F, i) for i in range(m)] + [Action(B, i) for i in range(m)]


def _1f1b_compute(stage: int, p: int, m: int) -> list[Action]:
    warmup = min(p - stage - 1, m)  # forwards in flight before the first backward can arrive
    ops = [Action(F, i) for i in range(warmup)]
    # Steady state: one forward, then the backward of the oldest microbatch in flight.
    for i in range(m - warmup):
        ops += [Action(F, warmup + i), Action(B, i)]
    # Cooldown: drain the backwards of the warmup forwards.
    ops += [Action(B, i) for i in range(m - warmup, m)]
    return ops


def _interleaved_compute(stage: int, p: int, m: int, v: int) -> list[Action]:
    total = m * v

    # The k-th forward (backward) on this rank: microbatches go in groups of p through
    # chunk 0, then the same group through chunk 1, ...; backwards visit chunks in reverse.
    def fwd(k: int) -> Action:
        return Action(F, (k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k: int) -> Action:
        return Action(B, (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    # Later ranks get their first gradient sooner; every chunk beyond the first adds one
    # round of p forwards that must be in flight before the first backward arrives.
    warmup = min((p - stage - 1) * 2 + (v - 1) * p, total)
    ops = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [fwd(warmup + k), bwd(k)]
    ops += [bwd(k) for k in range(total - warmup, total)]
    return ops


def _zb_h1_compute(stage: int, p: int, m: int) -> list[Action]:
    # 1F1B with B split into I (input grad, on the critical path) and W (weight grad).
    # Stage s runs the W of a microbatch s backward-steps after its I, so the W's fill the
    # slots where 1F1B would wait for the next gradient, and the last W's fill the cooldown.
    warmup = min(p - stage - 1, m)
    ops = [Action(F, i) for i in range(warmup)]
    pending: deque[int] = deque()

    def after_input_grad(k: int) -> None:
        pending.append(k)
        if k >= stage:
            ops.append(Action(W, pending.popleft()))

    for i in range(m - warmup):
        ops += [Action(F, warmup + i), Action(I, i)]
        after_input_grad(i)
    for i in range(m - warmup, m):
        ops.append(Action(I, i))
        after_input_grad(i)
    ops += [Action(W, k) for k in pending]
    return ops


# ------------------------------------------------------------------ public builders
_COMPUTE: dict[str, Callable[[int, int, int, int], list[Action]]] = {
    "gpipe": lambda s, p, m, v: _gpipe_compute(s, p, m),
    "1f1b": lambda s, p, m, v: _1f1b_compute(s, p, m),
    "interleaved-1f1b": _interleaved_compute,
    "zb-h1": lambda s, p, m, v: _zb_h1_compute(s, p, m),
    "zb-v": lambda s, p, m, v: list(zb_v_orders(p, m)[s]),
    "dualpipe-v": lambda s, p, m, v: dualpipe_v_order(s, p, m),
}


def compute_order(name: str, stage: int, num_stages: int, num_microbatches: int,
                  virtual_stages: int = 1) -> list[Action]:
    """Only the compute actions (F/B/I/W) of rank ``stage``, in order."""
    check_schedule_args(name, stage, num_stages, num_microbatches, virtual_stages)
    return _COMPUTE[name](stage, num_stages, num_microbatches, virtual_stages)


@functools.lru_cache(maxsize=256)
def _build_all(name: str, p: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    compute = [compute_order(name, s, p, m, v) for s in range(p)]
    return tuple(tuple(row) for row in place_comms(compute, p, v, placement_of(name)))


def build_all(name: str, num_stages: int, num_microbatches: int,
              virtual_stages: int = 1) -> list[list[Action]]:
    """Every rank's action list (compute and communication), indexed by pipeline rank."""
    for s in range(num_stages if isinstance(num_stages, int) and num_stages > 0 else 1):
        check_schedule_args(name, s, num_stages, num_microbatches, virtual_stages)
    return [list(row) for row in _build_all(name, num_stages, num_microbatches, virtual_stages)]


def build_schedule(name: str, stage: int, num_stages: int, num_microbatches: int,
                   virtual_stages: int = 1) -> list[Action]:
    """The action list of rank ``stage`` for schedule ``name`` (one of :data:`SCHEDULES`).

    Pure: every rank computes the same global placement (cached), so the lists agree.
    """
    check_schedule_args(name, stage, num_stages, num_microbatches, virtual_stages)
    return list(_build_all(name, num_stages, num_microbatches, virtual_stages)[stage])


def gpipe(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    return build_schedule("gpipe", stage, num_stages, num_microbatches)


def one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    return build_schedule("1f1b", stage, num_stages, num_microbatches)


def interleaved_1f1b(stage: int, num_stages: int, num_microbatches: int,
                     virtual_stages: int) -> list[Action]:
    return build_schedule("interleaved-1f1b", stage, num_stages, num_microbatches, virtual_stages)


def zb_h1(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    return build_schedule("zb-h1", stage, num_stages, num_microbatches)


def zb_v(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    return build_schedule("zb-v", stage, num_stages, num_microbatches, 2)


def _forward_only_compute(stage: int, p: int, m: int, v: int) -> list[Action]:
    # Micro-batches in rounds of p (the last round may be shorter); each round goes through
    # chunk 0, then chunk 1, ... (the interleaved schedule's forward order). Every forward
    # depends only on forwards earlier in (round, chunk, stage) order: no cycle (with V
    # placement too: a chunk waits only on its own chunk's neighbour or on the chunk before).
    return [Action(F, i, c) for r in range(0, m, p) for c in range(v) for i in range(r, min(r + p, m))]


def _check_forward_only_args(stage: int, num_stages: int, num_microbatches: int, virtual_stages: int) -> None:
    check_int("num_stages (pipeline-parallel size)", num_stages, minimum=1)
    check_int("num_microbatches (evaluation micro-batches)", num_microbatches, minimum=1)
    check_int("virtual_stages (model chunks per rank)", virtual_stages, minimum=1)
    check_int("stage", stage, minimum=0, maximum=num_stages - 1, fix=f"it is outside the {num_stages} stages")


@functools.lru_cache(maxsize=64)
def _build_all_forward_only(p: int, m: int, v: int, placement: str) -> tuple[tuple[Action, ...], ...]:
    compute = [_forward_only_compute(s, p, m, v) for s in range(p)]
    return tuple(tuple(row) for row in place_comms(compute, p, v, placement))


def build_all_forward_only(num_stages: int, num_microbatches: int, virtual_stages: int = 1,
                           placement: str = "loop") -> list[list[Action]]:
    """Every rank's forward-only action list (evaluation), indexed by pipeline rank;
    ``placement``: the training schedule's (:func:`placement_of`)."""
    _check_forward_only_args(0, num_stages, num_microbatches, virtual_stages)
    return [list(row) for row in _build_all_forward_only(num_stages, num_microbatches, virtual_stages, placement)]


def forward_only(stage: int, num_stages: int, num_microbatches: int, virtual_stages: int = 1,
                 placement: str = "loop") -> list[Action]:
    """Rank ``stage``'s evaluation schedule: only forwards (``F``) and the activation
    transfers between them, communication placed as for the training schedules."""
    _check_forward_only_args(stage, num_stages, num_microbatches, virtual_stages)
    return list(_build_all_forward_only(num_stages, num_microbatches, virtual_stages, placement)[stage])


def format_table(per_rank: Sequence[Sequence[Action]], compute_only: bool = True) -> str:
    """A stage x step table, one row per rank (``compute_only`` drops the comm actions)."""
    rows = [[str(a) for a in acts if a.is_compute or not compute_only] for acts in per_rank]
    width = max((len(c) for r in rows for c in r), default=1)
    return "\n".join(f"stage {s}: " + " ".join(c.ljust(width) for c in r).rstrip()
                     for s, r in enumerate(rows))


def schedule_table(name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1,
                   compute_only: bool = True) -> str:
    """``print(schedule_table("1f1b", 4, 8))`` shows the whole schedule as a table."""
    return format_table(build_all(name, num_stages, num_microbatches, virtual_stages), compute_only)
