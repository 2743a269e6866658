"""The pipeline instruction set: small frozen actions with a short printable form.

A schedule (see :mod:`engine.pipeline.schedule`) is a list of these per pipeline rank;
the simulator (:mod:`engine.pipeline.simulate`) checks and times them without processes,
and the executor (:mod:`engine.pipeline.executor`) runs them through a dispatch table.

Printable form: ``<KIND><microbatch>`` with ``.<chunk>`` appended for model chunks other
than 0 (interleaved schedules), e.g. ``F3``, ``B2``, ``I5``, ``W5``, ``SEND_ACT3``,
``RECV_GRAD2.1``. :func:`parse_action` inverts it.

Virtual stages. With ``v`` model chunks per rank and ``p`` ranks, the model is cut into
``p * v`` virtual stages; chunk ``c`` on rank ``s`` is virtual stage ``c * p + s``, so a
microbatch's route is rank 0 chunk 0 -> rank 1 chunk 0 -> ... -> rank p-1 chunk 0 ->
rank 0 chunk 1 -> ... (Megatron's interleaved layout, placement ``"loop"``). With ``v == 1``
the virtual stage is the rank.

V placement (``"v"``, the V-shaped schedules zb-v and dualpipe-v): chunk ``c`` runs down the
ranks on even ``c`` and back up on odd ``c``, so with ``v == 2`` rank ``s`` holds model stages
``s`` and ``2p - 1 - s``: the first and the last stage (embedding and loss head) are both on
rank 0, and the hand-off from chunk 0 to chunk 1 on rank ``p - 1`` stays on that rank (a
*local* hop: no send or receive, see :func:`is_local_hop`).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Optional

from engine.validate import check_int

__all__ = [
    "ScheduleError",
    "ActionKind",
    "Action",
    "parse_action",
    "COMPUTE_KINDS",
    "COMM_KINDS",
    "PLACEMENTS",
    "virtual_stage",
    "stage_and_chunk",
    "is_local_hop",
    "next_hop",
    "prev_hop",
    "comm_batches",
]


class ScheduleError(ValueError):
    """A schedule that is malformed (missing / duplicated / misordered action) or deadlocks."""


class ActionKind(str, enum.Enum):
    """What one action does. The value is the printable prefix."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input grad and weight grad together
    BACKWARD_INPUT = "I"  # zero-bubble: grad w.r.t. the stage input only
    BACKWARD_WEIGHT = "W"  # zero-bubble: grad w.r.t. the parameters (deferred)
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self in COMM_KINDS


COMPUTE_KINDS = frozenset(
    {ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT}
)
COMM_KINDS = frozenset(
    {ActionKind.SEND_ACT, ActionKind.RECV_ACT, ActionKind.SEND_GRAD, ActionKind.RECV_GRAD}
)


@dataclass(frozen=True, order=True)
class Action:
    """One instruction for one pipeline rank: ``kind`` applied to ``microbatch`` on local ``chunk``."""

    kind: ActionKind
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActionKind):
            object.__setattr__(self, "kind", ActionKind(self.kind))
        for name in ("microbatch", "chunk"):
            check_int(f"Action.{name}", getattr(self, name), minimum=0, error=ValueError)

    @property
    def is_compute(self) -> bool:
        return self.kind.is_compute

    @property
    def is_comm(self) -> bool:
        return self.kind.is_comm

    def __str__(self) -> str:
        suffix = f".{self.chunk}" if self.chunk else ""
        return f"{self.kind.value}{self.microbatch}{suffix}"

    def __repr__(self) -> str:
        return f"Action({self})"


_ACTION_RE = re.compile(r"^(SEND_ACT|RECV_ACT|SEND_GRAD|RECV_GRAD|F|B|I|W)(\d+)(?:\.(\d+))?$")


def parse_action(text: str) -> Action:
    """``"SEND_ACT3.1"`` -> ``Action(SEND_ACT, 3, chunk=1)``; the inverse of ``str(action)``."""
    m = _ACTION_RE.match(text.strip())
    if m is None:
        raise ValueError(
            f"cannot parse pipeline action {text!r}: expected <KIND><microbatch>[.<chunk>] with KIND "
            f"one of {', '.join(k.value for k in ActionKind)} (e.g. 'F3', 'SEND_GRAD2.1')"
        )
    kind, mb, chunk = m.groups()
    return Action(ActionKind(kind), int(mb), int(chunk) if chunk else 0)


# ------------------------------------------------------------------ virtual stages
PLACEMENTS = ("loop", "v")  # how model stages are laid over (rank, chunk); the module docstring


def _check_placement(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown stage placement {placement!r}: choose one of {', '.join(PLACEMENTS)}")


def virtual_stage(stage: int, chunk: int, num_stages: int, placement: str = "loop") -> int:
    """The model stage that chunk ``chunk`` of rank ``stage`` holds: ``chunk * num_stages + stage``
    (loop), or with V placement ``num_stages - 1 - stage`` in place of ``stage`` on odd chunks."""
    _check_placement(placement)
    if placement == "v" and chunk % 2 == 1:
        return chunk * num_stages + num_stages - 1 - stage
    return chunk * num_stages + stage


def stage_and_chunk(vstage: int, num_stages: int, placement: str = "loop") -> tuple[int, int]:
    """Inverse of :func:`virtual_stage`: ``(rank, chunk)``."""
    _check_placement(placement)
    rank, chunk = vstage % num_stages, vstage // num_stages
    if placement == "v" and chunk % 2 == 1:
        rank = num_stages - 1 - rank
    return rank, chunk


def next_hop(stage: int, chunk: int, num_stages: int, virtual_stages: int,
             placement: str = "loop") -> Optional[tuple[int, int]]:
    """``(rank, chunk)`` that consumes this chunk's output; None for the very last virtual stage."""
    vs = virtual_stage(stage, chunk, num_stages, placement) + 1
    return None if vs >= num_stages * virtual_stages else stage_and_chunk(vs, num_stages, placement)


def prev_hop(stage: int, chunk: int, num_stages: int, placement: str = "loop") -> Optional[tuple[int, int]]:
    """``(rank, chunk)`` that produces this chunk's input; None for virtual stage 0."""
    vs = virtual_stage(stage, chunk, num_stages, placement) - 1
    return None if vs < 0 else stage_and_chunk(vs, num_stages, placement)


def is_local_hop(stage: int, hop: Optional[tuple[int, int]]) -> bool:
    """The neighbour chunk ``hop`` is on this very rank (V placement's turn on rank p-1, or any
    hop when p == 1): its tensor is handed over in memory, never sent."""
    return hop is not None and hop[0] == stage


def comm_batches(actions: list[Action]) -> list[tuple[bool, list[Action]]]:
    """Split an action list into runs: ``(True, [comm...])`` or ``(False, [one compute])``.

    A maximal run of consecutive communication actions is ONE batch: the executor posts
    it with a single ``batch_isend_irecv`` and waits for all of it before moving on, and
    the simulator times it the same way. Batching a send with the receive that follows
    it (e.g. ``SEND_ACT4 RECV_GRAD1``, Megatron's send-forward-recv-backward) is what
    keeps neighbouring ranks from each waiting on the other.
    """
    out: list[tuple[bool, list[Action]]] = []
    for a in actions:
        if a.is_comm and out and out[-1][0]:
            out[-1][1].append(a)
        else:
            out.append((a.is_comm, [a]))
    return out
