"""``context_parallel`` and DeepSpeed's ``sequence_parallel_size``: parsed, and checked against
the model and the other degrees before any rank starts (docs/context_parallel.md).

- ``"context_parallel": {"size": C, "mode": "ring" | "ulysses" | "hybrid", "ulysses_size": U}``;
  ``mode`` defaults to ``"ring"``; ``ulysses_size`` is 1 for ring, C for Ulysses (the default
  for each), and must be given for hybrid (1 < U < C, U divides C).
- ``"sequence_parallel_size": C`` (DeepSpeed-Ulysses' key) means ``{"size": C, "mode": "ulysses"}``;
  given with a ``context_parallel`` section that says otherwise it is an error.

Every impossible combination is a :class:`ConfigError` naming the key and the fix.
"""

from __future__ import annotations

from typing import Optional

from engine.config.reader import Section
from engine.config.schema import ContextParallelConfig
from engine.errors import ConfigError
from engine.models.config import ModelConfig

__all__ = ["parse_context_parallel", "check_context_parallel", "CP_KEYS"]

CP_KEYS = ("size", "mode", "ulysses_size")
_MODES = ("ring", "ulysses", "hybrid")


def parse_context_parallel(top: Section) -> ContextParallelConfig:
    """The ``context_parallel`` section, or the one ``sequence_parallel_size`` implies."""
    s = top.sub("context_parallel", CP_KEYS)
    sps = top.int("sequence_parallel_size", None, min=1, nullable=True)
    given = top.has("context_parallel") and top.raw("context_parallel") is not None
    if sps is not None and given:
        size = s.int("size", 1, min=1)
        mode = s.choice("mode", _MODES, "ulysses")
        if size != sps or (size > 1 and mode != "ulysses"):
            raise ConfigError(
                f"sequence_parallel_size = {sps} (DeepSpeed-Ulysses of size {sps}) disagrees with context_parallel "
                f"(size {size}, mode \"{mode}\"): give one of the two, or make context_parallel "
                f"{{\"size\": {sps}, \"mode\": \"ulysses\"}}")
    if sps is not None and not given:
        return ContextParallelConfig(size=sps, mode="ulysses" if sps > 1 else "ring", ulysses_size=sps)
    size = s.int("size", 1, min=1)
    mode = s.choice("mode", _MODES, "ring")
    default_u = size if mode == "ulysses" else 1
    u = s.int("ulysses_size", default_u, min=1)
    if size == 1:
        if u != 1:
            raise s.error("ulysses_size", f"is {u} but context_parallel.size is 1: remove ulysses_size or raise size")
        return ContextParallelConfig(1, mode, 1)
    if mode == "ring" and u != 1:
        raise s.error("ulysses_size", f"is {u} but mode is \"ring\" (no all-to-all): remove it, or set mode "
                                      f"\"hybrid\" (Ulysses within groups of {u}, ring across them)")
    if mode == "ulysses" and u != size:
        raise s.error("ulysses_size", f"is {u} but mode \"ulysses\" spans the whole context_parallel.size {size}: "
                                      f"remove it, or set mode \"hybrid\" for Ulysses groups of {u}")
    if mode == "hybrid":
        if not s.has("ulysses_size"):
            raise s.error("ulysses_size", f"is required with mode \"hybrid\": the size of the Ulysses groups, a "
                                          f"divisor of context_parallel.size {size} between 2 and {size // 2}")
        if not 1 < u < size or size % u:
            raise s.error("ulysses_size", f"is {u}: with mode \"hybrid\" it must divide context_parallel.size "
                                          f"{size} and lie strictly between 1 and {size} (u = 1 is mode \"ring\", "
                                          f"u = {size} mode \"ulysses\")")
    return ContextParallelConfig(size, mode, u)


def check_context_parallel(cp: ContextParallelConfig, model: Optional[ModelConfig], tp: int,
                           sequence_parallel: bool) -> None:
    """What the reference model's shape must allow at this CP layout (nothing without a model
    section: a user's module is refused at assembly, engine.context_parallel.groups)."""
    c = cp.size
    if c == 1 or model is None:
        return
    s = model.seq_len
    if s % (2 * c):
        raise ConfigError(
            f"model.seq_len = {s} is not divisible by 2 x context_parallel.size = {2 * c}: every mode shards the "
            f"sequence head-tail into {2 * c} equal chunks (rank i holds chunks i and {2 * c - 1}-i, which balances "
            f"the causal work); set seq_len to a multiple of {2 * c} (pad or pack the data to it) or change "
            "context_parallel.size")
    if sequence_parallel and tp > 1 and (s // c) % tp:
        raise ConfigError(
            f"tensor_parallel.sequence_parallel splits each rank's {s // c}-token context-parallel shard "
            f"(model.seq_len {s} / context_parallel.size {c}) over the {tp} TP ranks: make seq_len a multiple "
            f"of {c * tp} (and of {2 * c}), or turn sequence_parallel off")
    u = cp.ulysses_size
    if u == 1:
        return
    heads, kv = model.num_heads // tp, (model.num_kv_heads or model.num_heads) // tp
    if heads % u:
        raise ConfigError(
            f"context_parallel mode \"{cp.mode}\" exchanges whole attention heads over ulysses_size = {u} ranks, but "
            f"each TP rank has {heads} query heads (model.num_heads {model.num_heads} / tensor_parallel.autotp_size "
            f"{tp}), not divisible by {u}: use mode \"ring\" (any head count), or mode \"hybrid\" with a "
            f"ulysses_size that divides {heads}")
    if kv % u and u % kv:
        raise ConfigError(
            f"context_parallel mode \"{cp.mode}\": each TP rank has {kv} KV heads (model.num_kv_heads / "
            f"tensor_parallel.autotp_size), which neither divides nor is divisible by ulysses_size = {u} (KV heads "
            "are split over the Ulysses group, or replicated when fewer): use mode \"ring\", or a ulysses_size "
            f"that divides or is a multiple of {kv}")
