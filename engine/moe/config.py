"""The ``model.moe`` section: a mixture-of-experts MLP in the reference GPT's blocks.

    "model": {"moe": {"num_experts": 8, "top_k": 2, "expert_hidden_size": 128, "layer_freq": 1,
                      "shared_experts": 0, "load_balancing": "aux_loss", "aux_loss_coef": 0.01,
                      "z_loss_coef": 0.0, "capacity_factor": null}}

Every key but ``num_experts`` and ``expert_hidden_size`` has the default shown. A leaf
module (pure values and checks): :mod:`engine.models.config` holds one as ``ModelConfig.moe``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

from engine.errors import ConfigError
from engine.validate import check_int

__all__ = ["MoEConfig", "LOAD_BALANCING", "AUX_FREE_BIAS_RATE"]

# model.moe.load_balancing: the sequence-wise auxiliary loss, DeepSeek-V3's auxiliary-loss-free
# per-expert bias, or nothing (see engine.moe.balancing)
LOAD_BALANCING: tuple[str, ...] = ("aux_loss", "aux_free", "none")

# gamma of aux-free balancing: each step every expert's routing bias moves by this much toward
# balance (DeepSeek-V3 uses 0.001 over thousands of steps; not a config key today)
AUX_FREE_BIAS_RATE = 1e-3


@dataclass(frozen=True)
class MoEConfig:
    """``model.moe`` (module docstring). ``layer_freq`` N: blocks 0, N, 2N, ... get the MoE
    MLP, the others the dense SwiGLU (Megatron's ``moe_layer_freq``). ``shared_experts``: that
    many always-active SwiGLU experts of ``expert_hidden_size`` added to every token's output
    (DeepSeek's shared experts). ``capacity_factor``: None = dropless; a number c caps every
    expert at ``ceil(c * tokens * top_k / num_experts)`` assignments per rank and micro-batch,
    the rest are dropped (their share of the output is zero) and counted."""

    num_experts: int
    expert_hidden_size: int
    top_k: int = 2
    layer_freq: int = 1
    shared_experts: int = 0
    load_balancing: str = "aux_loss"
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    capacity_factor: Optional[float] = None

    def __post_init__(self) -> None:
        check_int("model.moe.num_experts", self.num_experts, minimum=1)
        check_int("model.moe.expert_hidden_size", self.expert_hidden_size, minimum=1)
        check_int("model.moe.top_k", self.top_k, minimum=1)
        check_int("model.moe.layer_freq", self.layer_freq, minimum=1)
        check_int("model.moe.shared_experts", self.shared_experts, minimum=0)
        if self.top_k > self.num_experts:
            raise ConfigError(f"model.moe.top_k ({self.top_k}) is greater than model.moe.num_experts "
                              f"({self.num_experts}): each token picks top_k distinct experts; lower top_k")
        if self.load_balancing not in LOAD_BALANCING:
            raise ConfigError(f"model.moe.load_balancing = {self.load_balancing!r}: must be one of "
                              f"{list(LOAD_BALANCING)}")
        for name in ("aux_loss_coef", "z_loss_coef"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ConfigError(f"model.moe.{name} must be a number >= 0, got {v!r}")
        c = self.capacity_factor
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0):
            raise ConfigError(f"model.moe.capacity_factor must be a number > 0 (or null: dropless), got {c!r}")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) has the MoE MLP."""
        return layer % self.layer_freq == 0

    @property
    def aux_coef(self) -> float:
        """The auxiliary loss's coefficient in effect (0 unless load_balancing is "aux_loss")."""
        return float(self.aux_loss_coef) if self.load_balancing == "aux_loss" else 0.0

    @classmethod
    def from_dict(cls, d: Any) -> "MoEConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"model.moe must be an object with num_experts and expert_hidden_size, got {d!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown key(s) in model.moe: {unknown}; accepted: {sorted(known)}")
        missing = sorted(k for k in ("num_experts", "expert_hidden_size") if k not in d)
        if missing:
            raise ConfigError(f"model.moe needs {missing}: the number of routed experts and each expert's "
                              "SwiGLU inner size")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
