"""``expert_parallel``: parsed, and checked against the mesh and the model before any rank
starts (docs/expert_parallel.md).

``"expert_parallel": {"size": EP}`` splits the experts of every mixture-of-experts layer over
``EP`` ranks carved out of the data x context ranks (:meth:`engine.topology.Topology.expert_mesh`):
``EP`` must divide ``dp * cp`` and the model's ``num_experts``. Every impossible combination is
a :class:`ConfigError` naming the key and the fix; the loader runs on every rank with the same
input, so every rank raises it before any collective.
"""

from __future__ import annotations

from typing import Optional

from engine.config.reader import Section
from engine.config.schema import ExpertParallelConfig
from engine.errors import ConfigError
from engine.models.config import ModelConfig
from engine.topology import Topology

__all__ = ["parse_expert_parallel", "check_expert_parallel", "EP_KEYS", "model_num_experts"]

EP_KEYS = ("size",)


def parse_expert_parallel(top: Section) -> ExpertParallelConfig:
    """The ``expert_parallel`` section (absent or null: size 1)."""
    s = top.sub("expert_parallel", EP_KEYS)
    return ExpertParallelConfig(size=s.int("size", 1, min=1))


def model_num_experts(model: Optional[ModelConfig]) -> Optional[int]:
    """The reference GPT's experts per MoE layer; None without a model section or without
    ``model.moe`` (a dense model)."""
    moe = getattr(model, "moe", None)  # the MoE section (engine.models.config), when the model has one
    return None if moe is None else int(moe.num_experts)


def check_expert_parallel(ep: ExpertParallelConfig, topology: Topology, model: Optional[ModelConfig]) -> None:
    """``size`` divides the data x context ranks and the model's experts; a model section
    without experts takes no expert parallelism. A user's module (no model section) is checked
    at assembly, where its expert parameters are seen."""
    size = ep.size
    if size == 1:
        return
    data = topology.dp * topology.cp
    if data % size:
        cp = f" x context_parallel.size {topology.cp}" if topology.cp > 1 else ""
        divisors = [d for d in range(1, data + 1) if data % d == 0]
        raise ConfigError(
            f"expert_parallel.size = {size} does not divide the data x context ranks = {data} (data-parallel size "
            f"{topology.dp}{cp}): the expert groups are carved out of those ranks; choose expert_parallel.size in "
            f"{divisors}, or launch more ranks")
    if model is None:
        return
    experts = model_num_experts(model)
    if experts is None:
        raise ConfigError(
            f"expert_parallel.size = {size} but the model section has no mixture-of-experts layers (model.moe): "
            "add a model.moe section, or remove expert_parallel")
    if experts % size:
        raise ConfigError(
            f"model.moe.num_experts = {experts} is not divisible by expert_parallel.size = {size}: every expert-"
            f"parallel rank holds num_experts / size experts; choose a size that divides {experts}")
