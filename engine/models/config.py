"""The `model` section of the JSON config, as a frozen dataclass.

Field names are the JSON keys. ``engine.config`` parses the section into this class;
the reference model (``engine.models``) is built from it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

from engine.errors import ConfigError
from engine.moe.config import MoEConfig
from engine.validate import check_int

__all__ = ["ModelConfig", "MLP_KINDS", "DEFAULT_MLP"]

# The block MLPs a config may name (``model.mlp``); engine.models.blocks.MLPS builds each.
DEFAULT_MLP = "swiglu"
MLP_KINDS: tuple[str, ...] = (DEFAULT_MLP,)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    seq_len: int
    # SwiGLU inner size; None -> 8/3 * hidden rounded up to a multiple of 64 (Llama's rule,
    # and divisible by every TP degree up to 64).
    ffn_hidden_size: Optional[int] = None
    # Grouped-query attention; None -> num_heads (plain multi-head attention).
    num_kv_heads: Optional[int] = None
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # The blocks' MLP, one of MLP_KINDS. Written by to_dict only when not the default, so
    # the model section of configs and checkpoint metadata is what it was before the key.
    mlp: str = DEFAULT_MLP
    # Mixture of experts (engine.moe.config.MoEConfig; a dict is parsed); None: dense blocks.
    # Written by to_dict only when set.
    moe: Optional[MoEConfig] = None

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):
            object.__setattr__(self, "moe", MoEConfig.from_dict(self.moe))
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise ConfigError(f"model.moe must be an object (num_experts, expert_hidden_size, ...) or absent, "
                              f"got {self.moe!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "seq_len"):
            _positive_int(name, getattr(self, name))
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", _round_up(8 * self.hidden_size // 3, 64))
        _positive_int("ffn_hidden_size", self.ffn_hidden_size)
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        _positive_int("num_kv_heads", self.num_kv_heads)
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"model.hidden_size ({self.hidden_size}) must be divisible by "
                              f"model.num_heads ({self.num_heads})")
        if (self.hidden_size // self.num_heads) % 2:
            raise ConfigError(f"model head size hidden_size/num_heads = {self.hidden_size // self.num_heads} "
                              "must be even for rotary embeddings: change model.num_heads or hidden_size")
        if self.num_heads % self.kv_heads:
            raise ConfigError(f"model.num_heads ({self.num_heads}) must be divisible by "
                              f"model.num_kv_heads ({self.num_kv_heads})")
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError(f"model.tie_embeddings must be true or false, got {self.tie_embeddings!r}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ConfigError(f"model.{name} must be a positive number, got {v!r}")
        if self.mlp not in MLP_KINDS:
            raise ConfigError(f"model.mlp = {self.mlp!r}: must be one of {list(MLP_KINDS)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    # The two fields whose None means "derive it", as the ints __post_init__ resolved them to.
    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def ffn_size(self) -> int:
        return _round_up(8 * self.hidden_size // 3, 64) if self.ffn_hidden_size is None else self.ffn_hidden_size

    def check_parallel(self, tp: int, pp: int) -> None:
        """Errors for a (tp, pp) this model cannot be split into, naming the key and the fix."""
        for name in ("num_heads", "num_kv_heads", "hidden_size", "ffn_hidden_size"):
            v = getattr(self, name)
            if v % tp:
                raise ConfigError(f"the tensor-parallel degree {tp} (tensor_parallel.autotp_size) does not "
                                  f"divide model.{name} = {v}: pick a TP degree that divides it")
        if self.moe is not None and self.moe.shared_experts and \
                (self.moe.shared_experts * self.moe.expert_hidden_size) % tp:
            raise ConfigError(f"the tensor-parallel degree {tp} does not divide the shared experts' inner size "
                              f"model.moe.shared_experts * expert_hidden_size = "
                              f"{self.moe.shared_experts * self.moe.expert_hidden_size} (the shared experts are "
                              "tensor-parallel like the dense MLP): change expert_hidden_size or the TP degree")
        if pp > self.num_layers:
            raise ConfigError(f"pipeline.stages = {pp} is greater than model.num_layers = {self.num_layers}: "
                              "every stage needs at least one layer")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown key(s) in model: {unknown}; accepted: {sorted(known)}")
        try:
            return cls(**d)
        except TypeError as e:  # a required key is missing
            raise ConfigError(f"model section: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["mlp"] == DEFAULT_MLP:  # older checkpoints' metadata has no such key; keep dicts equal
            del d["mlp"]
        if d["moe"] is None:  # dense models' dicts stay what they were before the key
            del d["moe"]
        return d


def _positive_int(name: str, v: Any) -> None:
    check_int(f"model.{name}", v, minimum=1)
