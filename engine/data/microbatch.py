"""One micro-batch type, converted once where data enters the engine.

A user's DataLoader (or the engine's, or ``launch/train.py``'s sampler) yields micro-batches
in one of the formats DeepSpeed scripts use:

- an :class:`engine.data.Batch` (or anything with ``.inputs`` and ``.targets``; a packed
  batch's ``.input_doc_ids`` (B, S) are its document ids);
- an ``(inputs, targets)`` pair, or any other tuple / list (the module's positional inputs);
- a dict (the module's keyword inputs; ``input_ids`` and ``labels`` are the inputs and
  targets, ``doc_ids`` the document ids);
- a single tensor (the module's one input).

:func:`to_microbatch` is the only place that looks at the format: the engine converts each
micro-batch as it draws it (``train_batch`` / ``eval_batch``), and everything after (the
DeepSpeed loop's forward, the pipeline runner) reads the :class:`MicroBatch` fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

from engine.data.device import move_to_device

__all__ = ["MicroBatch", "to_microbatch", "split_microbatch"]


@dataclass(frozen=True)
class MicroBatch:
    """A micro-batch as the module is called with it: ``module(*args, **kwargs)``.

    ``inputs`` / ``targets``: what the first pipeline stage and a ``loss_fn`` take (None when
    the format has no such pair: a lone tensor, a tuple of another length, a dict without
    ``input_ids`` and ``labels``); ``doc_ids`` (B, S): the packed rows' document ids, or None.
    """

    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def inputs(self) -> Optional[Any]:
        pair = self._pair()
        return None if pair is None else pair[0]

    @property
    def targets(self) -> Optional[Any]:
        pair = self._pair()
        return None if pair is None else pair[1]

    @property
    def doc_ids(self) -> Optional[torch.Tensor]:
        return self.kwargs.get("doc_ids")

    def _pair(self) -> Optional[tuple[Any, Any]]:
        if len(self.args) == 2:
            return self.args[0], self.args[1]
        if not self.args and "input_ids" in self.kwargs and "labels" in self.kwargs:
            return self.kwargs["input_ids"], self.kwargs["labels"]
        return None

    def split(self) -> tuple[Any, Any]:
        """``(inputs, targets)``; a clear error when the micro-batch has no such pair."""
        pair = self._pair()
        if pair is None:
            raise TypeError("a micro-batch must be an engine.data.Batch, an (inputs, targets) pair or a dict with "
                            f"input_ids and labels; got positional inputs of length {len(self.args)} and keyword "
                            f"inputs {sorted(self.kwargs)}")
        return pair

    def to(self, device: torch.device) -> MicroBatch:
        """Every tensor inside on ``device`` (non-blocking from pinned memory; see
        :func:`engine.data.device.move_to_device`); each tensor is moved once."""
        return MicroBatch(tuple(move_to_device(a, device) for a in self.args),
                          {k: move_to_device(v, device) for k, v in self.kwargs.items()})


def to_microbatch(mb: Any) -> MicroBatch:
    """The one conversion of a user's micro-batch (see the module docstring)."""
    if isinstance(mb, MicroBatch):
        return mb
    if hasattr(mb, "inputs") and hasattr(mb, "targets"):  # engine.data.Batch and look-alikes
        doc_ids = getattr(mb, "input_doc_ids", None)
        return MicroBatch((mb.inputs, mb.targets), {} if doc_ids is None else {"doc_ids": doc_ids})
    if isinstance(mb, (tuple, list)):
        return MicroBatch(tuple(mb))
    if isinstance(mb, Mapping):
        return MicroBatch((), dict(mb))
    return MicroBatch((mb,))


def split_microbatch(mb: Any) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a micro-batch in any of the accepted formats."""
    return to_microbatch(mb).split()
