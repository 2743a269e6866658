"""Glue between the engine and :class:`engine.pipeline.executor.PipelineExecutor`: one
path for training and evaluation.

Training runs the configured schedule through the executor; evaluation runs the
forward-only schedule (:func:`engine.pipeline.schedule.forward_only`) through the same
executor, so both use the same ``batch_isend_irecv`` transfers on the pp group with fixed
boundary shapes (a stage output of another shape is an error naming both). The step
arithmetic (loss / ga * loss scale, the DP reduction, the tied-weight sum) is the
optimizer's (:mod:`engine.zero.step`): the runner hands the ZeRO optimizer to the executor
as its ``grads``; the engine steps it after the schedule.

Document masking (``data.document_masking``): stage boundaries still carry one hidden-state
tensor; the micro-batch's document ids (B, S) are data, and every stage of a data-parallel
replica is given the same micro-batches (the sampler ignores tp and pp), so each stage takes
them from its own copy (the executor's ``side_inputs``) and nothing extra is sent.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, cast

import torch
import torch.nn as nn

from engine.config import Config
from engine.context_parallel.data import SEQUENCE_KWARGS
from engine.data.device import move_to_device
from engine.data.microbatch import split_microbatch, to_microbatch
from engine.distributed.groups import ParallelGroups
from engine.pipeline.executor import PipelineExecutor
from engine.pipeline.probe import probe_boundary
from engine.pipeline.schedule import loss_stage, placement_of
from engine.pipeline.stages import check_doc_ids
from engine.zero.stage3 import Zero3Optimizer
from engine.zero.step import GradientStep

__all__ = ["PipelineRunner", "activation_shape", "microbatch_doc_ids"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def activation_shape(cfg: Config) -> tuple[int, int, int]:
    """What crosses a stage boundary: hidden states (micro_batch, S/cp, H), or (micro_batch,
    S/(cp*tp), H) with sequence parallelism (the SP shard is within the CP shard)."""
    model = cfg.model
    assert model is not None  # only the reference GPT's pipeline asks (it needs a model section)
    s = model.seq_len // cfg.cp  # context parallelism: this rank's shard of the sequence
    if cfg.tensor_parallel.sequence_parallel and cfg.tp > 1:
        s //= cfg.tp
    return (cfg.train_micro_batch_size_per_gpu, s, model.hidden_size)


def microbatch_doc_ids(mb: Any) -> Optional[torch.Tensor]:
    """The input document ids (B, S) of a micro-batch: ``engine.data.Batch.input_doc_ids``
    or a dict's ``"doc_ids"``; None when it has none."""
    return to_microbatch(mb).doc_ids


def _weight_pass_gather(grads: GradientStep) -> Optional[Callable[[list[nn.Parameter]], None]]:
    """ZeRO-3 releases a unit between uses: a deferred weight pass (zb-h1, zb-v) makes its
    parameters whole first (the executor's ``gather_params``); None for the other stages."""
    if not isinstance(grads, Zero3Optimizer):
        return None
    opt = grads

    def gather(params: list[nn.Parameter]) -> None:
        opt.gather_for_modification(cast(list[torch.Tensor], params))

    return gather


class PipelineRunner:
    """This rank's pipeline: ``train(microbatches)`` / ``evaluate(microbatches)`` return the
    per-step losses on the rank holding the last model stage (``loss_stage``: ``p - 1``, or 0
    in V placement) and None elsewhere."""

    def __init__(self, chunks: Sequence[nn.Module], cfg: Config, groups: ParallelGroups, loss_fn: LossFn,
                 *, device: torch.device, dtype: torch.dtype, grads: GradientStep,
                 boundary_shape: Optional[Sequence[int]] = None, measure_boundary: bool = False) -> None:
        """``grads``: the owner of the step arithmetic (the engine's ZeRO optimizer).
        ``boundary_shape`` / ``dtype``: what crosses the stage boundaries; the shape
        defaults to the config's model (:func:`activation_shape`). ``measure_boundary``:
        the shape and dtype are not known (a PipelineModule): :meth:`prepare` measures them
        on the first micro-batch (:func:`engine.pipeline.probe.probe_boundary`) and builds
        the executor then."""
        self._split = split_microbatch
        self.chunks = list(chunks)
        self.cfg, self.groups, self.loss_fn, self.grads = cfg, groups, loss_fn, grads
        self.device, self.dtype = device, dtype
        self.stage, self.num_stages = groups.pp_rank, cfg.pp
        # the pipeline rank with the head and the loss: p - 1, or 0 in V placement (zb-v)
        self.loss_stage = loss_stage(cfg.pipeline.schedule, cfg.pp, cfg.pipeline.virtual_stages)
        self.stage_ranks = list(groups.pp_ranks)
        self.document_masking = cfg.data.document_masking
        # data-side inputs every stage takes from its own copy of the micro-batch: the document ids,
        # and under context parallelism the shard's positions
        self.side_inputs = self.document_masking or cfg.cp > 1
        self._executor: Optional[PipelineExecutor] = None
        if not measure_boundary:
            self._build(tuple(boundary_shape) if boundary_shape is not None else activation_shape(cfg), dtype)

    def _build(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype
        self._executor = PipelineExecutor(
            self.chunks, stage=self.stage, stage_ranks=self.stage_ranks, pp_group=self.groups.pp_group,
            num_microbatches=self.cfg.gradient_accumulation_steps, activation_shape=shape,
            loss_fn=self.loss_fn, grads=self.grads,
            schedule=self.cfg.pipeline.schedule, activation_dtype=dtype, device=self.device,
            activation_checkpointing=False,  # the chunks checkpoint per block themselves
            broadcast_loss=False, record=False, side_inputs=self.side_inputs,
            gather_params=_weight_pass_gather(self.grads))

    def prepare(self, microbatches: Sequence[Any]) -> None:
        """One-time setup before a step, outside its no-host-sync region: the boundary-shape
        probe when the shape is measured (its collectives and its host read of the shape
        headers happen here; see :mod:`engine.distributed.strict`, rule 6); nothing otherwise."""
        if self._executor is None:
            inputs, _ = self._split(microbatches[0])
            self._build(*probe_boundary(self.chunks, inputs, self.groups, self.num_stages, self.device,
                                        placement_of(self.cfg.pipeline.schedule)))

    @property
    def executor(self) -> PipelineExecutor:
        if self._executor is None:
            raise RuntimeError("the boundary shape is measured on the first micro-batch: call prepare() first")
        return self._executor

    @property
    def is_last(self) -> bool:
        """This rank computes the loss (holds the last model stage; rank 0 in V placement)."""
        return self.stage == self.loss_stage

    def _side(self, mb: Any) -> dict:
        """Chunk keyword inputs of a micro-batch: ``{"doc_ids": (B, S)}`` with document masking;
        under context parallelism also the shard's ``positions`` (and ``position_ids``)."""
        m = to_microbatch(mb)
        check_doc_ids(m.doc_ids, self.document_masking)
        return {k: move_to_device(m.kwargs[k], self.device) for k in SEQUENCE_KWARGS if k in m.kwargs}

    def _item(self, mb: Any) -> tuple:
        inputs, targets = self._split(mb)
        side = self._side(mb)
        return (inputs, targets, side) if self.side_inputs else (inputs, targets)

    def train(self, microbatches: Sequence[Any], loss_fn: Optional[LossFn] = None) -> Optional[list[torch.Tensor]]:
        """One step's forward and backward; the mean loss (unscaled) on the last stage.
        ``loss_fn``: this step's loss (the engine's token mean) instead of the runner's."""
        self.prepare(microbatches)
        loss = self.executor.train_batch(iter([self._item(mb) for mb in microbatches]), loss_fn=loss_fn)
        if not self.is_last:
            return None
        assert loss is not None  # the last stage computes the loss
        return [loss]

    def evaluate(self, microbatches: Sequence[Any], loss_fn: Optional[LossFn] = None) -> Optional[list[torch.Tensor]]:
        """The forward-only schedule over ``microbatches``: each one's loss on the last stage
        (``loss_fn``: as for :meth:`train`)."""
        self.prepare(microbatches)
        losses = self.executor.eval_batch(iter([self._item(mb) for mb in microbatches]), len(microbatches),
                                          loss_fn=loss_fn)
        return losses if self.is_last else None
