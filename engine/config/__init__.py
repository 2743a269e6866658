"""Strict loading of DeepSpeed-format JSON configs into nested frozen dataclasses.

    from engine.config import load_config
    cfg = load_config("configs/default.json", world_size=8)
    cfg.zero.stage, cfg.pp, cfg.optimizer.params.lr, cfg.to_dict()

Every accepted key, default, rejected DeepSpeed key and no-op is listed in docs/config.md.
"""

from engine.config.loader import load_config, resolve_batch_sizes
from engine.config.schema import (
    ActivationCheckpointingConfig,
    AdamParams,
    BF16Config,
    CheckpointConfig,
    Config,
    ContextParallelConfig,
    CosineParams,
    CSVMonitorConfig,
    DataConfig,
    ExpertParallelConfig,
    FP8Config,
    FP16Config,
    LionParams,
    MonitorConfig,
    MuonParams,
    OptimizerConfig,
    PipelineConfig,
    SchedulerConfig,
    TensorBoardConfig,
    TensorParallelConfig,
    WandbConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
    WSDParams,
    ZeroConfig,
)
from engine.errors import ConfigError

__all__ = [
    "load_config", "resolve_batch_sizes", "Config", "ConfigError", "ContextParallelConfig", "ExpertParallelConfig",
    "ActivationCheckpointingConfig", "AdamParams", "BF16Config", "CheckpointConfig", "CosineParams", "DataConfig",
    "FP8Config", "FP16Config", "LionParams", "MuonParams", "OptimizerConfig", "PipelineConfig", "SchedulerConfig",
    "TensorParallelConfig", "WarmupCosineLRParams", "WarmupDecayLRParams", "WarmupLRParams", "WSDParams",
    "ZeroConfig", "MonitorConfig", "TensorBoardConfig", "CSVMonitorConfig", "WandbConfig",
]
