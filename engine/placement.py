"""Where a parameter lives: one frozen value each parameter carries (issue "Roles, not axes").

A parameter this rank holds is a piece of one logical tensor of the single-process
reference model. :class:`Placement` says which piece, in DTensor's spirit (``Shard(dim)`` /
``Replicate()``, one entry per concern rather than per mesh axis):

- ``tp``: :class:`TPShard` when the parameter is this rank's slice of a tensor split over the
  tensor-parallel group along ``dim`` (rank r of p holds the r-th of p equal pieces; a fused
  weight's parts -- q/k/v, gate/up -- are each split separately, so rank r holds
  ``[q_r; k_r; v_r]``; a padded partition dim -- the vocabulary -- records its true size).
  ``None`` is DTensor's ``Replicate()``: identical on every TP rank (norm weights,
  row-parallel biases), so norms and checkpoints count it once per TP group.
- ``tied_copy``: a pipeline stage's duplicate of a tied weight held on another stage (the
  LM head on the last stage tied to the first stage's embedding). The pipeline keeps it equal
  to the original by summing the two gradients over the embedding group; norms skip it and
  checkpoints save it as an alias of the original.
- ``expert``: :class:`ExpertShard` when the parameter holds a range of the experts of a
  mixture-of-experts layer (expert parallelism), stacked along dim 0 (``(count, ...)``: row
  ``i`` is global expert ``first + i``). ZeRO reduces and partitions its gradient over the
  expert-gradient role (the replicas of this expert range) instead of the grad role, the
  initial broadcast reaches those replicas only, and checkpoints write it by global expert
  index. :func:`set_expert_placement` also sets DeepSpeed's two attributes for MoE
  parameters (``allreduce = False``, ``group_name = "ep_size_{EP}"``), which DeepSpeed-style
  code (e.g. ``split_params_into_different_moe_groups_for_optimizer``) reads.

ZeRO partitioning is not part of this value: ZeRO owns it and describes it itself. Stages
1 and 2 cut the flat TP-local tensors of many parameters into DP shards (their shard view,
:mod:`engine.zero.shard_view`, says which fragment lies where); stage 3's ``zero.Init``
records DeepSpeed's ``ds_*`` attributes on the parameter (:mod:`engine.zero.init`). Either way
ZeRO slices the TP-local tensor this placement describes, so the two compose: the placement
maps the TP-local tensor into the full one, ZeRO maps its own shards into the TP-local one.

The value is stored on the tensor object itself, as the loose tags it replaces were, so it
survives what they survived: ``module.to()`` / ``.cuda()`` and ``p.data = ...`` (the same
Parameter object, as in ``zero.Init``). A new tensor made from a placed one (``nn.Parameter(
t)``, ``clone()``, ``to_empty`` across devices) does not carry it: copy it with
:func:`set_placement` (``set_placement(new, placement_of(old))``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["TPShard", "ExpertShard", "Placement", "REPLICATED", "set_placement", "placement_of", "has_placement",
           "tp_shard", "set_expert_placement", "expert_group_name"]

# one attribute on the tensor object (torch allows Python attributes on tensors)
_ATTR = "_engine_placement"


@dataclass(frozen=True)
class TPShard:
    """Split over the tensor-parallel group along ``dim`` of the full tensor.

    ``fused_parts``: full sizes along ``dim`` of the parts of a fused weight, each split
    separately (None: one part); ``unpadded_size``: the true size of ``dim`` when the full
    tensor was padded to a multiple of the TP degree (the vocabulary), None otherwise.
    """

    dim: int
    fused_parts: Optional[tuple[int, ...]] = None
    unpadded_size: Optional[int] = None

    def __post_init__(self) -> None:
        if self.dim < 0:
            raise ValueError(f"TPShard dim {self.dim}: must be >= 0 (a dim of the full tensor)")
        if self.fused_parts is not None and (not self.fused_parts or any(p <= 0 for p in self.fused_parts)):
            raise ValueError(f"TPShard fused_parts {self.fused_parts}: positive sizes, or None for one part")
        if self.unpadded_size is not None and self.unpadded_size <= 0:
            raise ValueError(f"TPShard unpadded_size {self.unpadded_size}: must be positive")


@dataclass(frozen=True)
class ExpertShard:
    """Experts ``[first, first + count)`` of a layer's ``num_experts``, held by this rank's
    place in the expert-parallel role, stacked along the parameter's dim 0 (module docstring)."""

    first: int
    count: int
    num_experts: int

    def __post_init__(self) -> None:
        if not (0 <= self.first and self.count >= 1 and self.first + self.count <= self.num_experts):
            raise ValueError(f"ExpertShard experts [{self.first}, {self.first + self.count}) do not lie in "
                             f"[0, {self.num_experts})")


@dataclass(frozen=True)
class Placement:
    """A parameter's placement (module docstring). The default is replicated everywhere."""

    tp: Optional[TPShard] = None
    tied_copy: bool = False
    expert: Optional[ExpertShard] = None

    @property
    def tp_sharded(self) -> bool:
        """Split over the TP group (else replicated over it)."""
        return self.tp is not None

    @property
    def expert_sharded(self) -> bool:
        """Holds a range of a layer's experts (else every expert, or not an expert weight)."""
        return self.expert is not None


REPLICATED = Placement()


def tp_shard(dim: int, fused_parts: Optional[Sequence[int]] = None, unpadded_size: Optional[int] = None) -> Placement:
    """The placement of a parameter TP-sharded along ``dim`` (:class:`TPShard`'s fields;
    an empty ``fused_parts`` is None)."""
    parts = tuple(int(p) for p in fused_parts) if fused_parts else None
    return Placement(tp=TPShard(dim, parts, unpadded_size))


def set_placement(param: torch.Tensor, placement: Placement) -> None:
    """Record ``placement`` on ``param`` (replacing any earlier one)."""
    if not isinstance(placement, Placement):
        raise TypeError(f"set_placement takes a Placement, got {type(placement).__name__}")
    setattr(param, _ATTR, placement)


def placement_of(param: torch.Tensor) -> Placement:
    """``param``'s placement; :data:`REPLICATED` when none was recorded."""
    return getattr(param, _ATTR, REPLICATED)


def has_placement(param: torch.Tensor) -> bool:
    """Whether a placement was recorded on ``param`` (the model's layers place every parameter)."""
    return isinstance(getattr(param, _ATTR, None), Placement)


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's name of the expert-parallel group of size ``ep_size`` (``param.group_name``)."""
    return f"ep_size_{ep_size}"


def set_expert_placement(param: torch.Tensor, shard: ExpertShard, ep_size: int,
                         tp: Optional[TPShard] = None) -> None:
    """Mark ``param`` as holding experts ``shard`` (stacked along dim 0) of a layer split over
    ``ep_size`` ranks: its :class:`Placement` (``tp``: its TP split, None when the experts are
    replicated over TP) and DeepSpeed's MoE attributes ``allreduce = False`` and
    ``group_name = "ep_size_{ep_size}"``. Call it in the constructor that registers the
    parameter (``engine.zero.Init`` partitions a parameter when that constructor returns, over
    the expert-gradient group only when it already carries this placement)."""
    if ep_size < 1 or shard.num_experts % ep_size or shard.count * ep_size != shard.num_experts:
        raise ValueError(f"ExpertShard {shard} does not hold num_experts / ep_size = {shard.num_experts} / "
                         f"{ep_size} experts: every expert-parallel rank holds the same number of experts")
    if param.dim() < 1 or param.shape[0] != shard.count:
        raise ValueError(f"an expert parameter stacks its {shard.count} experts along dim 0, got shape "
                         f"{tuple(param.shape)}")
    set_placement(param, Placement(tp=tp, expert=shard))
    param.allreduce = False  # type: ignore[attr-defined]  # DeepSpeed's MoE attributes
    param.group_name = expert_group_name(ep_size)  # type: ignore[attr-defined]
