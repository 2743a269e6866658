"""Upper bounds on sizes and counts, checked when the config is loaded (issue 30).

A typo such as ``train_micro_batch_size_per_gpu: 1e300`` or ``model.hidden_size: 1e7`` is
an integer JSON accepts; without a bound it passes the loader and fails at step 1 with a
traceback (an allocation of 10^14 elements), after the output folder was written. Each
bound is far above any real model (the largest published dense models: hidden 16384-25600,
126 layers, 128 heads, vocabularies of 256k, contexts of 1M tokens) and far below what
fits in any machine's memory as one tensor, so a legitimate config never meets one; the
error names the key, the value and the bound.
"""

from __future__ import annotations

from typing import Any, Mapping

from engine.errors import ConfigError

__all__ = ["MODEL_LIMITS", "BATCH_LIMITS", "MAX_PARAMETERS", "check_model_limits", "check_batch_limits",
           "check_parameter_count"]

MODEL_LIMITS: Mapping[str, int] = {
    "vocab_size": 2**22,        # 4M tokens (the largest vocabularies: 256k)
    "hidden_size": 2**17,       # 131072 (the largest dense models: 16384-25600)
    "num_layers": 2**12,        # 4096 (the deepest: 126-160)
    "num_heads": 2**12,
    "num_kv_heads": 2**12,
    "seq_len": 2**24,           # 16M tokens per sequence (context parallelism of 1M-token contexts)
    "ffn_hidden_size": 2**19,
}
BATCH_LIMITS: Mapping[str, int] = {
    "train_micro_batch_size_per_gpu": 2**16,
    "gradient_accumulation_steps": 2**20,
    "train_batch_size": 2**26,
}
MAX_PARAMETERS = 10**13  # 10 trillion: ~10x the largest models trained


def _bound(key: str, value: Any, limit: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return  # its type is the section parser's to report
    if value > limit:
        raise ConfigError(f"{key} = {value:g} is above the limit {limit} of this engine (docs/config.md, "
                          "\"Limits\"): a typo? set a real size")


def check_model_limits(raw: Mapping[str, Any]) -> None:
    """The raw ``model`` section, before the model config is built from it."""
    for key, limit in MODEL_LIMITS.items():
        if key in raw and raw[key] is not None:
            _bound(f"model.{key}", raw[key], limit)


def check_batch_limits(values: Mapping[str, Any]) -> None:
    for key, limit in BATCH_LIMITS.items():
        if values.get(key) is not None and values[key] != "auto":
            _bound(key, values[key], limit)


def check_parameter_count(n: int) -> None:
    if n > MAX_PARAMETERS:
        raise ConfigError(f"the model section describes {n:.3g} parameters, above the limit {MAX_PARAMETERS:.0e} of "
                          "this engine (docs/config.md, \"Limits\"): a typo in its sizes?")
