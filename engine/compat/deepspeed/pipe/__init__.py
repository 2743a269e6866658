"""``deepspeed.pipe``: :class:`PipelineModule`, :class:`LayerSpec`, :class:`TiedLayerSpec`
(:mod:`engine.pipe`) and the topologies ``ProcessTopology``,
``PipeDataParallelTopology``, ``PipeModelDataParallelTopology``, as DeepSpeed exports them."""

from engine.compat.deepspeed.runtime.pipe import (
    LayerSpec,
    PipeDataParallelTopology,
    PipelineModule,
    PipeModelDataParallelTopology,
    ProcessTopology,
    TiedLayerSpec,
)

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology", "PipeDataParallelTopology",
           "PipeModelDataParallelTopology"]
