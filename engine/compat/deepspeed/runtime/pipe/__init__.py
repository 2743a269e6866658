"""``deepspeed.runtime.pipe``: :class:`PipelineModule`, :class:`LayerSpec`,
:class:`TiedLayerSpec`, the topologies (:mod:`.topology`) and ``PipelineEngine`` (:mod:`.engine`)."""

from engine.compat.deepspeed.runtime.pipe import engine, module, topology
from engine.compat.deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from engine.compat.deepspeed.runtime.pipe.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology", "PipeDataParallelTopology",
           "PipeModelDataParallelTopology", "engine", "module", "topology"]
