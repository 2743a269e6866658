"""The reference GPT/Llama-style decoder built from the tensor-parallel layers (see gpt.py)."""

from engine.models.config import ModelConfig
from engine.models.gpt import (
    GPT,
    FinalNormAndHead,
    build_stage_layers,
    flops_per_token,
    num_stage_layers,
    param_count,
)

__all__ = ["ModelConfig", "GPT", "FinalNormAndHead", "build_stage_layers", "num_stage_layers",
           "param_count", "flops_per_token"]
