"""What the planner plans for: the hardware (:class:`Cluster`) and named presets of
clusters and models.

Bandwidths are per device and per direction, as a ring collective sees them (NCCL's "bus
bandwidth"): a ring all-reduce of ``S`` bytes over ``n`` devices takes
``2 (n-1)/n * S / bw`` seconds plus ``2 (n-1)`` latency steps. A group that spans nodes
runs at ``inter_node_bw`` (each GPU has its own NIC in the usual 8-GPU node).

The preset numbers are the vendors' data-sheet peaks (dense, no sparsity) and typical
achieved collective bandwidths; ``compute_efficiency`` is the fraction of peak the
model's layers achieve on a device (GEMMs, attention and the elementwise ops together,
before communication and bubbles) - the one number to calibrate per system
(:mod:`engine.planner.calibrate` fits it on measured runs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from engine.errors import ConfigError
from engine.models.config import ModelConfig
from engine.validate import check_int

__all__ = ["Cluster", "CLUSTERS", "MODELS", "cluster_preset", "model_preset", "GiB"]

GiB = float(2 ** 30)


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` identical devices.

    ``memory_bytes``: usable device memory; ``reserved_bytes`` of it are taken by the
    runtime (CUDA context, communication buffers, allocator fragmentation).
    ``peak_flops``: per device, in the compute dtype. ``hbm_bw``: device memory bandwidth
    (the optimizer step is bandwidth-bound). ``comm_overlap``: fraction of the
    data-parallel communication that can hide behind the backward (1 with NCCL on its own
    stream; 0 on CPUs, where communication and compute share the cores).
    """

    name: str
    gpus_per_node: int
    nodes: int
    memory_bytes: float
    peak_flops: float
    intra_node_bw: float
    inter_node_bw: float
    hbm_bw: float
    compute_efficiency: float = 0.6
    latency_s: float = 20e-6
    reserved_bytes: float = 5 * GiB
    comm_overlap: float = 1.0

    def __post_init__(self) -> None:
        for f in ("gpus_per_node", "nodes"):
            check_int(f"cluster {f}", getattr(self, f), minimum=1)
        for f in ("memory_bytes", "peak_flops", "intra_node_bw", "inter_node_bw", "hbm_bw"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"cluster {f} must be a positive number, got {v!r}")
        if not 0 < self.compute_efficiency <= 1:
            raise ConfigError(f"cluster compute_efficiency must be in (0, 1], got {self.compute_efficiency!r}")
        if not 0 <= self.comm_overlap <= 1:
            raise ConfigError(f"cluster comm_overlap must be in [0, 1], got {self.comm_overlap!r}")
        if self.reserved_bytes < 0 or self.reserved_bytes >= self.memory_bytes:
            raise ConfigError(f"cluster reserved_bytes ({self.reserved_bytes:.3g}) must be >= 0 and below "
                              f"memory_bytes ({self.memory_bytes:.3g})")

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def with_nodes(self, nodes: int, gpus_per_node: Optional[int] = None) -> "Cluster":
        return replace(self, nodes=nodes, gpus_per_node=gpus_per_node or self.gpus_per_node)


# Per-device data-sheet peaks (dense bf16) and achievable ring bandwidths: NVLink 4 moves
# 450 GB/s per direction per H100/H200 (NCCL reaches ~360-480 GB/s bus bandwidth on 8
# GPUs); a 400 Gb/s NDR NIC per GPU gives ~45 GB/s between nodes; NVLink 3 (A100) 300 GB/s
# per direction, HDR 200 Gb/s per GPU between nodes.
CLUSTERS: dict[str, Cluster] = {
    "h100": Cluster("H100 SXM 80GB, NVLink 4, 8x400Gb/s IB", gpus_per_node=8, nodes=8,
                    memory_bytes=79.6 * GiB, peak_flops=989e12, intra_node_bw=400e9, inter_node_bw=45e9,
                    hbm_bw=3.35e12),
    "h200": Cluster("H200 SXM 141GB, NVLink 4, 8x400Gb/s IB", gpus_per_node=8, nodes=1,
                    memory_bytes=140.4 * GiB, peak_flops=989e12, intra_node_bw=400e9, inter_node_bw=45e9,
                    hbm_bw=4.8e12),
    "a100": Cluster("A100 SXM 80GB, NVLink 3, 8x200Gb/s IB", gpus_per_node=8, nodes=8,
                    memory_bytes=79.2 * GiB, peak_flops=312e12, intra_node_bw=230e9, inter_node_bw=22e9,
                    hbm_bw=2.0e12),
    "a100-40g": Cluster("A100 SXM 40GB, NVLink 3, 8x200Gb/s IB", gpus_per_node=8, nodes=8,
                        memory_bytes=39.4 * GiB, peak_flops=312e12, intra_node_bw=230e9, inter_node_bw=22e9,
                        hbm_bw=1.55e12),
}

# Published architectures (Llama 3: Dubey et al. 2024, table 3; Llama 2: Touvron et al. 2023).
MODELS: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                             ffn_hidden_size=14336, seq_len=8192, tie_embeddings=False, rope_theta=500000.0),
    "llama3-70b": ModelConfig(vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                              ffn_hidden_size=28672, seq_len=8192, tie_embeddings=False, rope_theta=500000.0),
    "llama3-405b": ModelConfig(vocab_size=128256, hidden_size=16384, num_layers=126, num_heads=128,
                               num_kv_heads=8, ffn_hidden_size=53248, seq_len=8192, tie_embeddings=False,
                               rope_theta=500000.0),
    "llama2-70b": ModelConfig(vocab_size=32000, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                              ffn_hidden_size=28672, seq_len=4096, tie_embeddings=False),
    "gpt-1b": ModelConfig(vocab_size=32768, hidden_size=2048, num_layers=20, num_heads=16, seq_len=2048),
}


def cluster_preset(name: str, nodes: Optional[int] = None) -> Cluster:
    if name not in CLUSTERS:
        raise ConfigError(f"unknown cluster preset {name!r}: choose one of {', '.join(CLUSTERS)}")
    c = CLUSTERS[name]
    return c.with_nodes(nodes) if nodes is not None else c


def model_preset(name: str) -> ModelConfig:
    if name not in MODELS:
        raise ConfigError(f"unknown model preset {name!r}: choose one of {', '.join(MODELS)}")
    return MODELS[name]
