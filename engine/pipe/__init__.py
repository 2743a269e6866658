"""DeepSpeed's ``deepspeed.pipe``: :class:`PipelineModule`, :class:`LayerSpec`,
:class:`TiedLayerSpec` (see :mod:`engine.pipe.module`)."""

from engine.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec"]
