"""Tensor parallelism: conjugate communication ops (mappings), parallel layers and
vocab-parallel cross-entropy. A parameter's layout is its placement (engine.placement)."""

from engine.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from engine.tensor_parallel.layers import (
    ColumnParallelLinear,
    NormalInit,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_full_tensor,
    pad_vocab_size,
)
from engine.tensor_parallel.mappings import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)

__all__ = [
    "vocab_parallel_cross_entropy",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "NormalInit",
    "gather_full_tensor", "pad_vocab_size",
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
]
