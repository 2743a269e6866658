"""Mixture of experts: the top-k router, grouped SwiGLU experts, the expert-parallel token
dispatcher, load balancing and the per-step statistics (docs/moe.md).

- :mod:`engine.moe.config`: :class:`MoEConfig` (``model.moe``; a leaf the model config imports);
- :mod:`engine.moe.context`: :class:`MoEContext` (the groups and factors a layer is given);
- :mod:`engine.moe.layer`: ``MoELayer`` (hidden -> hidden, the reference GPT's MoE MLP);
- :mod:`engine.moe.router`, :mod:`engine.moe.experts`, :mod:`engine.moe.dispatch`,
  :mod:`engine.moe.balancing`: its parts;
- :mod:`engine.moe.stats`: ``moe_step_end`` (once per optimizer step: statistics, aux-free update).

This package's ``__init__`` imports only the two leaves, so that ``engine.models.config`` can
import :class:`MoEConfig` without a cycle (the layer imports the model's blocks).
"""

from engine.moe.config import LOAD_BALANCING, MoEConfig
from engine.moe.context import LOCAL_MOE, NO_EP, MoEContext

__all__ = ["MoEConfig", "LOAD_BALANCING", "MoEContext", "LOCAL_MOE", "NO_EP"]
