"""``deepspeed.runtime.pipe.module``: :mod:`engine.pipe`'s :class:`PipelineModule`,
:class:`LayerSpec`, :class:`TiedLayerSpec` (see docs/deepspeed_compat.md for the differences)."""

from engine.pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec"]
