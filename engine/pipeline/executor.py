"""Run one pipeline rank's action list with point-to-point communication.

``PipelineExecutor(chunks, ...)`` holds this rank's model chunk(s) (``nn.Module`` each;
one per virtual stage, so two or more for ``interleaved-1f1b``) and the schedule's
action list; :meth:`PipelineExecutor.train_batch` runs one optimizer step's worth of
microbatches through it (forward, backward, gradient accumulation - not the optimizer).

Communication model (what :mod:`engine.pipeline.simulate` checks): consecutive comm
actions are posted together with one ``dist.batch_isend_irecv`` and not waited for on
the spot. The posted batches form a FIFO stream: a compute that consumes a received
tensor waits for the batch holding that receive and for every batch posted before it
(they would finish first on an NCCL stream anyway); the rest are waited for at the end
of the step. A sent activation's values are released as soon as its batch has been
waited for. Transfers between two ranks are posted in the same order on both (the
schedule guarantees it), so order-matched backends (NCCL; gloo, one tag) pair them right.

Stage boundaries carry ONE tensor of a fixed shape and dtype (``activation_shape``,
``activation_dtype``, e.g. ``(micro_batch, seq, hidden)``): no shape header is sent.
A stage output of another shape is an error naming both shapes.

Data: ``train_batch(data_iter)`` draws exactly ``num_microbatches`` items
``(inputs, targets)`` on the ranks holding the first or the last virtual stage (the
first feeds ``inputs`` to its chunk, the last gives ``targets`` to ``loss_fn``); other
ranks may pass ``None``.

Step arithmetic (:mod:`engine.zero.step`, the one contract): the executor differentiates
``grads.scale_loss(loss, num_microbatches)`` for each microbatch (``loss / m`` times the
loss scale), keeps the unscaled loss for reporting, calls ``grads.set_boundary(True)``
around the last gradient-producing action (``B`` or ``W``) of each model chunk (of the later of
two chunks that share a parameter: V placement's tied embedding and head), so a ZeRO
optimizer launches that chunk's data-parallel reductions while the rest of the schedule
runs, and ``grads.finish_backward()`` after the last action (reductions completed, tied
weights summed). ``grads`` is the ZeRO optimizer, or :class:`engine.zero.step.LocalGradients`
for a plain ``torch.optim`` optimizer (the default: no tied weights). A step may bring its
own ``loss_fn`` (``train_batch`` / ``eval_batch``): the engine's token mean, engine.zero.step.

V placement (``schedule="zb-v"``, two chunks): rank 0 holds the first and the last stage, so
it draws the data and computes the loss; on rank ``p - 1`` chunk 0's output is handed to
chunk 1 in memory (detached, as a received activation would be) and chunk 1's input gradient
back to chunk 0 the same way: a local hop has no send or receive.

Evaluation: :meth:`PipelineExecutor.eval_batch` runs the forward-only schedule
(:func:`engine.pipeline.schedule.forward_only`, checked by the same simulator) through the
same dispatch and communication code, without autograd.

Side inputs (``side_inputs=True``): items are ``(inputs, targets, kwargs)`` and EVERY rank
draws them (every rank needs a data_iter); each chunk's forward of that microbatch is
called as ``chunk(x, **kwargs)``. This is how data-side tensors every stage needs (the
document ids of packed sequences) reach the middle stages without extra communication:
all stages of a data-parallel replica read the same micro-batches.

ZeRO-3 (``gather_params``, the optimizer's ``gather_for_modification``): a deferred weight
pass (``W``) restarts autograd below the unit's pre-backward gather, so the executor makes
its parameters whole first; the unit is released again when their gradients have arrived.

Memory: an output is kept only until its backward; its data is released as soon as its
send completes (the backward restarts from its autograd edge, which does not need the
values). ``activation_checkpointing=True`` recomputes each chunk's forward in backward.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd.graph import get_gradient_edge
from torch.utils.checkpoint import checkpoint

from engine.data.device import move_to_device
from engine.distributed import comm
from engine.distributed.groups import AxisGroup
from engine.pipeline.actions import Action, ActionKind, comm_batches, is_local_hop, next_hop, prev_hop, stage_and_chunk
from engine.pipeline.clock import make_clock
from engine.pipeline.schedule import build_schedule, forward_only, placement_of
from engine.pipeline.split_backward import SavedStore, backward_input, backward_weight, full_backward
from engine.zero.step import GradientStep, LocalGradients

__all__ = ["ActionRecord", "PipelineExecutor", "last_grad_actions"]

logger = logging.getLogger(__name__)
K = ActionKind
LossFn = Callable[[torch.Tensor, Any], torch.Tensor]


@dataclass(frozen=True)
class ActionRecord:
    """One timed action of the last step. ``name`` is the printable action or ``WAIT``."""

    name: str
    kind: str  # "F", "B", "I", "W", "SEND_ACT", ..., or "WAIT" (blocked on a receive)
    microbatch: int
    chunk: int
    start: float  # time.perf_counter() seconds (one clock for all processes of a host); on CUDA
    end: float    # from CUDA events resolved after the step (engine.pipeline.clock)


def last_grad_actions(actions: Sequence[Action]) -> dict[int, int]:
    """chunk -> index in ``actions`` of its last action that produces parameter gradients
    (``B``, or ``W`` for a split backward): where that chunk's gradients become final."""
    last: dict[int, int] = {}
    for i, a in enumerate(actions):
        if a.kind in (K.BACKWARD, K.BACKWARD_WEIGHT):
            last[a.chunk] = i
    return last


def _boundary_actions(actions: Sequence[Action], chunks: Sequence[torch.nn.Module]) -> dict[int, int]:
    """chunk -> index of the action around which its data-parallel reductions launch: its last
    gradient action, or, for chunks sharing a parameter (V placement's tied embedding and head,
    both on rank 0), the later of theirs, so that parameter's gradient is complete when reduced."""
    last = last_grad_actions(actions)
    params = [{id(p) for p in c.parameters()} for c in chunks]
    changed = True
    while changed:
        changed = False
        for a in last:
            for b in last:
                if a != b and params[a] & params[b] and last[a] < last[b]:
                    last[a], changed = last[b], True
    return last


class PipelineExecutor:
    """One pipeline rank: its chunk(s), its action list, and the state of the step in flight.

    ``stage_ranks``: global ranks of pipeline stages 0..p-1 for this rank's (dp, tp)
    coordinates (``ParallelGroups.pp_ranks`` or ``Topology.ranks_along("pp", rank)``).
    """

    def __init__(self, chunks: Sequence[torch.nn.Module], *, stage: int, stage_ranks: Sequence[int],  # noqa: PLR0913 (keyword-only, each option independent and defaulted)
                 pp_group: AxisGroup, num_microbatches: int,
                 activation_shape: Sequence[int], loss_fn: Optional[LossFn] = None,
                 schedule: str = "1f1b", activation_dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None, activation_checkpointing: bool = False,
                 free_sent_outputs: bool = True, grads: Optional[GradientStep] = None,
                 broadcast_loss: bool = True, record: bool = True, side_inputs: bool = False,
                 gather_params: Optional[Callable[[list[torch.nn.Parameter]], None]] = None) -> None:
        self.chunks = list(chunks)
        self.stage, self.num_stages = stage, len(stage_ranks)
        self.virtual_stages = len(self.chunks)
        if not self.chunks:
            raise ValueError("PipelineExecutor needs at least one model chunk")
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is outside the {self.num_stages} stage_ranks {list(stage_ranks)}")
        self.placement = placement_of(schedule)  # which model stage each (rank, chunk) holds
        if self.is_last_holder and loss_fn is None:
            raise ValueError("the last pipeline stage needs loss_fn(output, targets) -> scalar loss")
        self.stage_ranks = list(stage_ranks)
        self.pp_group = pp_group
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        self.actions: list[Action] = build_schedule(schedule, stage, self.num_stages, num_microbatches,
                                                    self.virtual_stages)
        self.activation_shape = tuple(activation_shape)
        self.activation_dtype = activation_dtype
        self.loss_fn = loss_fn
        self._step_loss_fn = loss_fn  # the run in progress's (train_batch / eval_batch may give one)
        params = [p for c in self.chunks for p in c.parameters()]
        self.device = device or (params[0].device if params else torch.device("cpu"))
        self.activation_checkpointing = activation_checkpointing
        self.free_sent_outputs = free_sent_outputs
        self.grads: GradientStep = grads if grads is not None else LocalGradients()
        if (isinstance(self.grads, LocalGradients) and self.grads.tied_params and self.num_stages > 1
                and self.grads.embedding_group.size == 1):
            raise ValueError("tied parameters on a multi-stage pipeline need LocalGradients(tied, embedding_group) "
                             "with the first and last stage's group (ParallelGroups.embedding_group) to sum "
                             "their gradients over")
        self._last_grad = _boundary_actions(self.actions, self.chunks)  # chunk -> its boundary action
        # (microbatch, chunk) whose backward is split (I now, W later): their forwards save
        # into a SavedStore, so the input pass can drop what only it reads
        self._split = {(a.microbatch, a.chunk) for a in self.actions if a.kind is K.BACKWARD_INPUT}
        self._eval = False  # running the forward-only schedule
        self._m = num_microbatches  # microbatches of the run in progress
        self.broadcast_loss = broadcast_loss
        self.record = record
        self.side_inputs = side_inputs
        self.gather_params = gather_params  # ZeRO-3: make parameters whole before a W pass
        self.records: list[ActionRecord] = []
        self._clock = make_clock(self.device)
        self._raw: list[tuple] = []  # (name, kind, mb, chunk, start mark, end mark) until resolved
        self._hooks: list[Callable[[], None]] = []
        self._warmed_up = False
        self._dispatch = {K.FORWARD: self._forward, K.BACKWARD: self._backward,
                          K.BACKWARD_INPUT: self._backward_input, K.BACKWARD_WEIGHT: self._backward_weight}

    # ------------------------------------------------------------------ geometry
    @property
    def is_first_holder(self) -> bool:
        """This rank holds virtual stage 0 (feeds the inputs)."""
        return self.stage == 0

    @property
    def loss_rank(self) -> int:
        """Pipeline rank holding the last virtual stage (0 with V placement, else p - 1)."""
        return stage_and_chunk(self.num_stages * self.virtual_stages - 1, self.num_stages, self.placement)[0]

    @property
    def is_last_holder(self) -> bool:
        """This rank holds the last virtual stage (computes the loss)."""
        return self.stage == self.loss_rank

    def _prev(self, chunk: int) -> Optional[tuple[int, int]]:
        return prev_hop(self.stage, chunk, self.num_stages, self.placement)

    def _next(self, chunk: int) -> Optional[tuple[int, int]]:
        return next_hop(self.stage, chunk, self.num_stages, self.virtual_stages, self.placement)

    def _is_first(self, chunk: int) -> bool:
        return self._prev(chunk) is None

    def _is_last(self, chunk: int) -> bool:
        return self._next(chunk) is None

    def _peer(self, a: Action) -> int:
        towards_next = a.kind in (K.SEND_ACT, K.RECV_GRAD)
        hop = self._next(a.chunk) if towards_next else self._prev(a.chunk)
        assert hop is not None, f"{a} on stage {self.stage} has no peer"
        return self.stage_ranks[hop[0]]

    def register_backward_end_hook(self, fn: Callable[[], None]) -> None:
        """``fn()`` runs once per step after the last microbatch's backward on this rank
        (and after the tied-gradient sum): where the data-parallel reduction goes."""
        self._hooks.append(fn)

    # ------------------------------------------------------------------ the step
    def train_batch(self, data_iter: Optional[Iterator], loss_fn: Optional[LossFn] = None) -> Optional[torch.Tensor]:
        """Forward and backward of ``num_microbatches`` microbatches; gradients accumulate.
        ``loss_fn``: this step's loss on the last stage (default: the executor's).

        Returns the mean loss (a 0-dim tensor) on the last stage - on every pipeline rank
        when ``broadcast_loss`` - else None. Does not step the optimizer or zero grads.
        """
        self._run(self.actions, self.num_microbatches, data_iter, "train_batch", loss_fn)
        self.grads.finish_backward()
        for fn in self._hooks:
            fn()
        return self._step_loss()

    @torch.no_grad()
    def eval_batch(self, data_iter: Optional[Iterator], num_microbatches: Optional[int] = None,
                   loss_fn: Optional[LossFn] = None) -> list[torch.Tensor]:
        """Forward of ``num_microbatches`` (default: the training count) microbatches through
        the forward-only schedule, without autograd. Returns each microbatch's loss on the
        rank holding the last virtual stage, an empty list elsewhere; no gradient changes.
        ``loss_fn``: as for :meth:`train_batch`."""
        m = self.num_microbatches if num_microbatches is None else num_microbatches
        actions = forward_only(self.stage, self.num_stages, m, self.virtual_stages, self.placement)
        self._eval = True
        try:
            self._run(actions, m, data_iter, "eval_batch", loss_fn)
        finally:
            self._eval = False
        return list(self._losses) if self.is_last_holder else []

    def _run(self, actions: Sequence[Action], m: int, data_iter: Optional[Iterator], what: str,
             loss_fn: Optional[LossFn] = None) -> None:
        """Run one action list over ``m`` microbatches (training or the forward-only schedule)
        with ``loss_fn`` on the last stage (default: the executor's)."""
        needs_data = self.is_first_holder or self.is_last_holder or self.side_inputs
        if needs_data and data_iter is None:
            raise ValueError(f"stage {self.stage} feeds inputs or targets (or side inputs): {what} needs a data_iter")
        if not self._warmed_up:
            # NCCL wants every rank of a group in its first collective; batched p2p may not be it.
            comm.all_reduce(torch.zeros(1, device=self.device), self.pp_group)
            self._warmed_up = True
        self._m = m
        self._step_loss_fn = loss_fn or self.loss_fn
        self._reset(data_iter)
        self.records, self._raw = [], []
        if self.record:
            self._clock.start_step()
        boundary = {i: c for c, i in self._last_grad.items()} if not self._eval else {}
        if not self._eval:
            self.grads.set_boundary(False)  # only each chunk's last gradient action reduces
        index = 0  # position in ``actions`` of the batch's first action
        for is_comm, acts in comm_batches(list(actions)):
            if is_comm:
                self._post(acts)
            else:
                a = acts[0]
                self._await_inputs(a)  # blocked time is recorded as WAIT, not as compute
                t0 = self._mark()
                last = index in boundary  # this chunk's gradients become final in this action
                if last:
                    self.grads.set_boundary(True)  # its DP reductions launch as buckets fill
                self._dispatch[a.kind](a.microbatch, a.chunk)
                if last:
                    self.grads.set_boundary(False)
                self._note(str(a), a.kind.value, a.microbatch, a.chunk, t0)
            index += len(acts)
        self._complete_upto(len(self._posted) - 1)
        self._resolve_records()
        if needs_data and self._drawn != m:
            raise RuntimeError(f"stage {self.stage} drew {self._drawn} microbatches, expected {m}")
        leftovers = [k for k, v in self._state.items() if v] + (["side"] if self._side else [])
        assert not leftovers, f"state left after the step: {leftovers}"

    def _reset(self, data_iter: Optional[Iterator]) -> None:
        self._data_iter, self._drawn = data_iter, 0
        self._batches: dict[int, list[Any]] = {}  # microbatch -> [inputs, targets], None once used
        self._side: dict[int, list] = {}  # microbatch -> [kwargs, forwards left on this rank]
        self._losses: list[torch.Tensor] = []
        # per (microbatch, chunk): stage input, forward root (output edge or scaled loss),
        # output kept for its send, input grad to send, zero-bubble W state
        self._state: dict[str, dict] = {n: {} for n in ("input", "root", "out", "dx", "w", "saved")}
        self._recvs: dict[tuple, tuple[torch.Tensor, int]] = {}  # key -> (buffer, batch index)
        self._posted: list[_Posted] = []
        self._arrived: dict[tuple, torch.Tensor] = {}  # received and waited for, not yet consumed
        self._done = 0  # batches before this index have completed

    def _mark(self) -> Any:
        return self._clock.mark() if self.record else None

    def _note(self, name: str, kind: str, mb: int, chunk: int, t0: Any) -> None:
        if self.record:
            self._raw.append((name, kind, mb, chunk, t0, self._clock.mark()))

    def _resolve_records(self) -> None:
        """Turn the step's marks into records (on CUDA: one wait for the last event)."""
        if not self._raw:
            return
        times = self._clock.resolve([m for r in self._raw for m in r[4:]])
        for i, (name, kind, mb, chunk, _, _) in enumerate(self._raw):
            start, end = times[2 * i], times[2 * i + 1]
            if kind != "WAIT" or end - start > 1e-5:  # a wait that did not block is no record
                self.records.append(ActionRecord(name, kind, mb, chunk, start, end))
        self._raw = []

    def _step_loss(self) -> Optional[torch.Tensor]:
        loss = None
        if self.is_last_holder:
            loss = torch.stack(self._losses).mean()
        if self.broadcast_loss and self.num_stages > 1:
            buf = loss.clone() if loss is not None else torch.zeros((), device=self.device)
            comm.broadcast(buf, self.stage_ranks[self.loss_rank], self.pp_group)
            loss = buf
        return loss

    # ------------------------------------------------------------------ data
    def _microbatch(self, mb: int) -> list[Any]:
        self._draw_upto(mb)
        return self._batches[mb]

    def _draw_upto(self, mb: int) -> None:
        while self._drawn <= mb:
            try:
                item = next(self._data_iter)  # type: ignore[arg-type]
            except StopIteration:
                raise RuntimeError(f"data_iter ran out after {self._drawn} of {self._m} "
                                   f"microbatches: it must yield gradient_accumulation_steps items per step") from None
            if self.side_inputs:
                if not (isinstance(item, (tuple, list)) and len(item) == 3 and isinstance(item[2], dict)):
                    raise TypeError("with side_inputs=True data_iter must yield (inputs, targets, kwargs dict) "
                                    f"triples, got {type(item).__name__}")
            elif not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise TypeError(f"data_iter must yield (inputs, targets) pairs, got {type(item).__name__}")
            if self.is_first_holder or self.is_last_holder:
                self._batches[self._drawn] = [move_to_device(item[0], self.device),
                                              move_to_device(item[1], self.device)]
            if self.side_inputs:
                self._side[self._drawn] = [move_to_device(item[2], self.device), self.virtual_stages]
            self._drawn += 1

    def _side_kwargs(self, mb: int) -> dict:
        """Keyword inputs of microbatch ``mb`` for one chunk forward; dropped after the last chunk's."""
        if not self.side_inputs:
            return {}
        self._draw_upto(mb)
        entry = self._side[mb]
        entry[1] -= 1
        if entry[1] == 0:
            del self._side[mb]
        return entry[0]

    def _take(self, mb: int, index: int) -> Any:
        """inputs (index 0) or targets (1) of microbatch ``mb``; the batch is dropped after its last use."""
        batch = self._microbatch(mb)
        value, batch[index] = batch[index], None
        still_needed = (self.is_first_holder and batch[0] is not None) or (self.is_last_holder and batch[1] is not None)
        if not still_needed:
            del self._batches[mb]
        return value

    # ------------------------------------------------------------------ compute
    def _run_chunk(self, chunk: int, x: Any, kwargs: dict, free_input: bool = False) -> torch.Tensor:
        """The chunk on a copy of ``x`` when its layers may change their input (see ``_forward``;
        a user's layers, ``StageChunk.inputs_may_change``); ``free_input``: ``x``'s storage is
        released once copied, unless a checkpoint keeps ``x`` for the recomputation."""
        module = self.chunks[chunk]
        checkpointed = self.activation_checkpointing and not self._eval
        if not getattr(module, "inputs_may_change", True):  # the reference model's chunks: no copy
            return checkpoint(module, x, use_reentrant=False, **kwargs) if checkpointed else module(x, **kwargs)

        def run(inp: Any, **kw: Any) -> torch.Tensor:
            copy = _copy(inp)
            if free_input and not checkpointed and copy is not inp:
                inp.untyped_storage().resize_(0)
            return module(copy, **kw)

        if checkpointed:
            return checkpoint(run, x, use_reentrant=False, **kwargs)
        return run(x, **kwargs)

    def _forward(self, mb: int, chunk: int) -> None:
        key, st = (mb, chunk), self._state
        # A user's chunk runs on a copy of its input, as DeepSpeed's pipeline engine: a first layer
        # that works in place (nn.ReLU(inplace=True), x.add_) must neither change the user's
        # micro-batch nor hit the received leaf that collects d(loss)/d(input) (autograd
        # refuses an in-place op on a leaf that requires grad), nor a V turn's input, which
        # shares storage with the previous chunk's output its backward may need.
        # (_run_chunk copies the input inside the recomputed function: a checkpoint keeps the original.)
        if self._is_first(chunk):
            x = self._take(mb, 0)
        elif self._eval:
            x = self._arrived.pop((K.RECV_ACT, mb, chunk))
        else:
            x = self._arrived.pop((K.RECV_ACT, mb, chunk)).requires_grad_()
            st["input"][key] = x
        # a received buffer of its own (not the user's batch, not a V turn's output) is not read
        # again once copied (only its grad is), so its storage goes and the copy costs no memory
        own = not self._is_first(chunk) and not is_local_hop(self.stage, self._prev(chunk))
        # (a checkpoint keeps only its input already; the first chunk's W is a whole backward)
        split = (key in self._split and not self._eval and not self.activation_checkpointing
                 and isinstance(x, torch.Tensor) and x.requires_grad)
        saved = SavedStore() if split else None
        if saved is not None:
            st["saved"][key] = saved
        with saved.hooks() if saved is not None else contextlib.nullcontext():
            out = self._run_chunk(chunk, x, self._side_kwargs(mb), free_input=own)
        if self._is_last(chunk):
            loss = self._step_loss_fn(out, self._take(mb, 1))  # type: ignore[misc]
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
            self._losses.append(loss.detach())  # reported unscaled
            if not self._eval:  # loss / m * loss scale (engine.zero.step)
                st["root"][key] = self.grads.scale_loss(loss, self.num_microbatches)
            return
        if tuple(out.shape) != self.activation_shape or out.dtype != self.activation_dtype:
            raise ValueError(
                f"stage {self.stage} chunk {chunk} output is {tuple(out.shape)} {out.dtype} but the executor "
                f"was built for activation_shape={self.activation_shape} {self.activation_dtype}: every stage "
                f"boundary must carry one tensor of that shape and dtype (evaluation included: micro-batches "
                f"of the training micro-batch size)")
        nxt = self._next(chunk)
        if is_local_hop(self.stage, nxt):  # V's turn: the next chunk is here; it takes a detached input
            assert nxt is not None
            self._arrived[(K.RECV_ACT, mb, nxt[1])] = out.detach()
            if not self._eval:
                st["root"][key] = self._root_of(out, chunk)
            return
        if self._eval:
            st["out"][key] = out  # kept until its send completes
            return
        st["out"][key] = out
        # The backward restarts from the output's autograd edge, so the output's values
        # can be dropped once sent.
        st["root"][key] = self._root_of(out, chunk)

    def _root_of(self, out: torch.Tensor, chunk: int) -> Any:
        if out.grad_fn is None:
            raise ValueError(f"stage {self.stage} chunk {chunk} output does not require grad: "
                             f"a non-final chunk must have trainable parameters or a grad-requiring input")
        return get_gradient_edge(out)

    def _keep_input_grad(self, mb: int, chunk: int, dx: Optional[torch.Tensor]) -> None:
        """The input gradient goes to the send, or across a local hop straight to the previous chunk."""
        if dx is None:
            return
        prev = self._prev(chunk)
        if is_local_hop(self.stage, prev):
            assert prev is not None
            self._arrived[(K.RECV_GRAD, mb, prev[1])] = dx
        else:
            self._state["dx"][(mb, chunk)] = dx

    def _output_grad(self, mb: int, chunk: int) -> Optional[torch.Tensor]:
        return None if self._is_last(chunk) else self._arrived.pop((K.RECV_GRAD, mb, chunk))

    def _await_inputs(self, a: Action) -> None:
        """Wait for the received tensor compute ``a`` consumes, if any (a local hop's is there)."""
        if a.kind is K.FORWARD and not self._is_first(a.chunk) and not is_local_hop(self.stage, self._prev(a.chunk)):
            key = (K.RECV_ACT, a.microbatch, a.chunk)
        elif (a.kind in (K.BACKWARD, K.BACKWARD_INPUT) and not self._is_last(a.chunk)
              and not is_local_hop(self.stage, self._next(a.chunk))):
            key = (K.RECV_GRAD, a.microbatch, a.chunk)
        else:
            return
        self._arrived[key] = self._wait_recv(key)

    def _backward(self, mb: int, chunk: int) -> None:
        key, st = (mb, chunk), self._state
        grad = self._output_grad(mb, chunk)
        x = st["input"].pop(key, None)
        st["saved"].pop(key, None)  # (the graph holds the store until it is freed)
        full_backward(st["root"].pop(key), grad)
        st["out"].pop(key, None)
        if x is not None:
            self._keep_input_grad(mb, chunk, x.grad)

    def _backward_input(self, mb: int, chunk: int) -> None:
        key, st = (mb, chunk), self._state
        grad = self._output_grad(mb, chunk)
        x = st["input"].pop(key, None)
        params = [p for p in self.chunks[chunk].parameters()]
        dx, st["w"][key] = backward_input(st["root"].pop(key), grad, x, params, st["saved"].pop(key, None))
        st["out"].pop(key, None)
        self._keep_input_grad(mb, chunk, dx)

    def _backward_weight(self, mb: int, chunk: int) -> None:
        backward_weight(self._state["w"].pop((mb, chunk)), self.gather_params)

    # ------------------------------------------------------------------ communication
    def _post(self, acts: list[Action]) -> None:
        """Post one batch of sends and receives; nothing waits here."""
        t0 = self._mark()
        ops, batch = [], _Posted(index=len(self._posted))
        for a in acts:
            peer = self._peer(a)
            key = (a.microbatch, a.chunk)
            if a.kind in (K.RECV_ACT, K.RECV_GRAD):
                buf = torch.empty(self.activation_shape, dtype=self.activation_dtype, device=self.device)
                ops.append(comm.p2p_op(dist.irecv, buf, peer, self.pp_group))
                self._recvs[(a.kind, a.microbatch, a.chunk)] = (buf, batch.index)
            else:
                src = self._state["out"][key] if a.kind is K.SEND_ACT else self._state["dx"].pop(key)
                t = src.detach()  # (B, S, H) activation or input grad; kept alive until sent
                ops.append(comm.p2p_op(dist.isend, t, peer, self.pp_group))
                batch.sends.append((a, t))
        batch.works = comm.batch_isend_irecv(ops)
        self._posted.append(batch)
        self._note(" ".join(map(str, acts)), "COMM", acts[0].microbatch, acts[0].chunk, t0)

    def _wait_recv(self, key: tuple) -> torch.Tensor:
        try:
            buf, index = self._recvs.pop(key)
        except KeyError:
            raise RuntimeError(f"stage {self.stage}: {Action(*key)} was never posted before its use "
                               f"(schedule bug)") from None
        t0 = self._mark()
        self._complete_upto(index)
        self._note("WAIT", "WAIT", key[1], key[2], t0)
        return buf

    def _complete_upto(self, index: int) -> None:
        """Wait for every batch posted up to ``index``, oldest first, as a FIFO stream does.

        The simulator's model: a batch finishes only after the ones before it, so waiting for
        them here adds no dependency the schedule was not checked against. Each work is
        waited exactly once (a gloo work's wait() would block for a second message).
        """
        while self._done < len(self._posted) and self._done <= index:
            batch = self._posted[self._done]
            for w in batch.works:
                w.wait()
            for a, _ in batch.sends:
                if self._eval and a.kind is K.SEND_ACT:  # no backward will need it
                    self._state["out"].pop((a.microbatch, a.chunk), None)
                    continue
                out = self._state["out"].get((a.microbatch, a.chunk)) if a.kind is K.SEND_ACT else None
                if out is not None and self.free_sent_outputs and out._base is None:
                    # sent: the values are no longer needed (backward starts from the edge)
                    out.data = torch.empty(0, dtype=out.dtype, device=out.device)
            batch.works, batch.sends = [], []
            self._done += 1


@dataclass
class _Posted:
    """One posted batch of point-to-point ops."""

    index: int
    works: list = field(default_factory=list)
    sends: list = field(default_factory=list)  # (action, tensor kept alive until sent)


def _copy(x: Any) -> Any:
    """A tensor micro-batch input cloned (other inputs as they are): see ``_forward``."""
    return x.clone() if isinstance(x, torch.Tensor) else x
