"""Glue between the engine and :class:`engine.pipeline.executor.PipelineExecutor`.

Training runs the configured schedule through the executor (gradients accumulate into the
ZeRO optimizer's buffers through its hooks; the engine reduces and steps once after the
last micro-batch). Evaluation is forward-only: each micro-batch walks the chain of
virtual stages in order, one transfer per hop (a single token passing along the chain, so
it cannot deadlock). Each hop is a ``batch_isend_irecv`` on the pp group, as in training
(NCCL then uses the group's communicator instead of creating a pairwise one mid-run), and
the sender checks the activation's shape and dtype against the receiver's fixed buffer
before sending (the strict mode also exchanges a header): a mismatch is an error naming
both, not an NCCL hang or silent corruption.

Document masking (``data.document_masking``): stage boundaries still carry one hidden-state
tensor; the micro-batch's document ids (B, S) are data, and every stage of a data-parallel
replica is given the same micro-batches (the sampler ignores tp and pp), so each stage takes
them from its own copy (the executor's ``side_inputs``) and nothing extra is sent.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from engine.config import Config
from engine.data.device import move_to_device
from engine.data.microbatch import split_microbatch, to_microbatch
from engine.dist import comm
from engine.dist.groups import ParallelGroups
from engine.pipeline.actions import next_hop, prev_hop
from engine.pipeline.executor import PipelineExecutor
from engine.pipeline.stages import check_doc_ids

__all__ = ["PipelineRunner", "activation_shape", "microbatch_doc_ids"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def activation_shape(cfg: Config) -> tuple[int, int, int]:
    """What crosses a stage boundary: hidden states (micro_batch, S, H), or (micro_batch,
    S/tp, H) with sequence parallelism."""
    s = cfg.model.seq_len
    if cfg.tensor_parallel.sequence_parallel and cfg.tp > 1:
        s //= cfg.tp
    return (cfg.train_micro_batch_size_per_gpu, s, cfg.model.hidden_size)


def microbatch_doc_ids(mb: Any) -> Optional[torch.Tensor]:
    """The input document ids (B, S) of a micro-batch: ``engine.data.Batch.input_doc_ids``
    or a dict's ``"doc_ids"``; None when it has none."""
    return to_microbatch(mb).doc_ids


class PipelineRunner:
    """This rank's pipeline: ``train(microbatches)`` / ``evaluate(microbatches)`` return the
    per-step losses on the last stage and None elsewhere."""

    def __init__(self, chunks: Sequence[nn.Module], cfg: Config, groups: ParallelGroups, loss_fn: LossFn,
                 *, device: torch.device, dtype: torch.dtype, loss_scale: Callable[[], float] = lambda: 1.0,
                 boundary_shape: Optional[Sequence[int]] = None) -> None:
        """``boundary_shape`` / ``dtype``: what crosses the stage boundaries; the shape
        defaults to the config's model (:func:`activation_shape`)."""
        self._split = split_microbatch
        self.chunks = list(chunks)
        self.cfg, self.groups, self.loss_fn = cfg, groups, loss_fn
        self.device, self.dtype = device, dtype
        self.stage, self.num_stages = groups.pp_rank, cfg.pp
        self.stage_ranks = list(groups.pp_ranks)
        self.shape = tuple(boundary_shape) if boundary_shape is not None else activation_shape(cfg)
        self.document_masking = cfg.data.document_masking
        # The executor runs the backward itself, so the fp16 loss scale goes into the loss it
        # differentiates (the ZeRO optimizer divides the reduced gradients by it); the scale
        # is fixed within a step and a power of two, so unscaling the reported loss is exact.
        self._loss_scale = loss_scale
        self._scale = 1.0
        self.executor = PipelineExecutor(
            self.chunks, stage=self.stage, stage_ranks=self.stage_ranks, pp_group=groups.pp_group,
            num_microbatches=cfg.gradient_accumulation_steps, activation_shape=self.shape,
            loss_fn=self._scaled_loss,
            schedule=cfg.pipeline.schedule, activation_dtype=dtype, device=device,
            activation_checkpointing=False,  # the chunks checkpoint per block themselves
            broadcast_loss=False, record=False, side_inputs=self.document_masking)

    def prepare(self, microbatches: Sequence[Any]) -> None:
        """Setup before a step, outside its no-host-sync region: nothing here (the boundary
        shape comes from the config; :class:`engine.pipe.runner.LazyPipelineRunner` probes)."""

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def _scaled_loss(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(out, targets)
        return loss if self._scale == 1.0 else loss * self._scale

    def _side(self, mb: Any) -> dict:
        """Chunk keyword inputs of a micro-batch: ``{"doc_ids": (B, S)}`` with document masking."""
        doc_ids = microbatch_doc_ids(mb)
        check_doc_ids(doc_ids, self.document_masking)
        return {} if doc_ids is None else {"doc_ids": move_to_device(doc_ids, self.device)}

    def _item(self, mb: Any) -> tuple:
        inputs, targets = self._split(mb)
        side = self._side(mb)
        return (inputs, targets, side) if self.document_masking else (inputs, targets)

    def train(self, microbatches: Sequence[Any]) -> Optional[list[torch.Tensor]]:
        pairs = iter([self._item(mb) for mb in microbatches])
        self._scale = float(self._loss_scale())
        loss = self.executor.train_batch(pairs)
        if not self.is_last:
            return None
        return [loss if self._scale == 1.0 else loss / self._scale]

    @torch.no_grad()
    def evaluate(self, microbatches: Sequence[Any]) -> Optional[list[torch.Tensor]]:
        v = len(self.chunks)
        losses = []
        for mb in microbatches:
            inputs, targets = self._split(mb)
            side = self._side(mb)
            for c in range(v):
                prev = prev_hop(self.stage, c, self.num_stages)
                if prev is None:
                    x = move_to_device(inputs, self.device)
                else:
                    x = torch.empty(self.shape, dtype=self.dtype, device=self.device)  # (B, S, H)
                    self._transfer(comm.p2p_op(dist.irecv, x, self.stage_ranks[prev[0]], self.groups.pp_group))
                out = self.chunks[c](x, **side)
                nxt = next_hop(self.stage, c, self.num_stages, v)
                if nxt is None:
                    losses.append(self.loss_fn(out, move_to_device(targets, self.device)).detach())
                else:
                    self._check_boundary(out, c)
                    self._transfer(comm.p2p_op(dist.isend, out.contiguous(), self.stage_ranks[nxt[0]],
                                              self.groups.pp_group))
        return losses if self.is_last else None

    def _check_boundary(self, out: torch.Tensor, chunk: int) -> None:
        """The receiver allocates ``self.shape`` / ``self.dtype``: anything else must not be sent."""
        if tuple(out.shape) != self.shape or out.dtype != self.dtype:
            raise ValueError(f"pipeline evaluation: stage {self.stage} chunk {chunk} output is {tuple(out.shape)} "
                             f"{out.dtype} but the next stage receives {self.shape} {self.dtype} (micro-batch, seq, "
                             "hidden): evaluate with micro-batches of train_micro_batch_size_per_gpu rows of seq_len")

    @staticmethod
    def _transfer(op: dist.P2POp) -> None:
        for work in comm.batch_isend_irecv([op]):
            work.wait()
