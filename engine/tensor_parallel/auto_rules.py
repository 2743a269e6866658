"""AutoTP's rule table: which projection of a Hugging Face decoder is split how.

A :class:`LayerSpec` says, for the linear layers whose *weight name* matches one of its
regexes (``re.match`` on ``"<module path>.weight"``, DeepSpeed's ``partition_config``
convention, e.g. ``r".*\\.o_proj\\.weight$"``), how the layer is split over the TP group:

- ``column``: output features split (Megatron's column-parallel linear: q/k/v, gate/up);
- ``row``: input features split, partial outputs all-reduced (attention out, MLP down);
- ``skip`` (alias ``replicate``): left whole on every rank.

``fused`` describes a weight that packs several matrices along its output dim, each of
which must be split separately so rank r holds ``[part0_r; part1_r; ...]``:
``"qkv"`` (q, k, v of sizes ``n_heads*d, n_kv*d, n_kv*d`` from the model config) or an
int k (k equal parts, e.g. 2 for a packed [gate; up]). GPT-NeoX's ``query_key_value`` is
packed *per head* ([q_h; k_h; v_h] for each head), so a plain contiguous split already
gives every rank whole heads and it needs no ``fused``.

``kv``: the layer produces key/value heads (grouped-query attention policy applies).
Anything no spec matches (embeddings, LM head, norms) stays replicated.

The families (``config.model_type``) and their specs are :data:`PRESETS`; the attention
modules whose head counts are rewritten are found by :data:`ATTENTION_ATTRS`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

__all__ = ["LayerSpec", "PRESETS", "FAMILY_OF", "ATTENTION_ATTRS", "specs_for", "parse_layer_specs"]

PARTITION_TYPES = ("column", "row", "skip")


@dataclass(frozen=True)
class LayerSpec:
    patterns: tuple[str, ...]
    partition_type: str                      # "column" | "row" | "skip"
    fused: Union[None, str, int, tuple[int, ...]] = None  # None | "qkv" | k equal parts | part sizes
    kv: bool = False                         # carries key/value heads (GQA policy)

    def matches(self, weight_name: str) -> bool:
        return any(re.match(p, weight_name) for p in self.patterns)


def _s(pattern: str, kind: str, fused: Union[None, str, int] = None, kv: bool = False) -> LayerSpec:
    return LayerSpec((pattern,), kind, fused, kv)


_LLAMA = (
    _s(r".*\.self_attn\.q_proj\.weight$", "column"),
    _s(r".*\.self_attn\.[kv]_proj\.weight$", "column", kv=True),
    _s(r".*\.self_attn\.o_proj\.weight$", "row"),
    _s(r".*\.mlp\.(gate|up)_proj\.weight$", "column"),
    _s(r".*\.mlp\.down_proj\.weight$", "row"),
)

#: The rule table. GPT-2's projections are ``Conv1D`` (weight stored (in, out)); the layer
#: type, not the spec, decides which weight dim that is.
PRESETS: dict[str, tuple[LayerSpec, ...]] = {
    "llama": _LLAMA,      # also Mistral, Qwen2, Qwen3 (q/k/v biases and q/k norms need nothing more)
    "gpt2": (
        _s(r".*\.attn\.c_attn\.weight$", "column", fused="qkv"),
        _s(r".*\.attn\.c_proj\.weight$", "row"),
        _s(r".*\.mlp\.c_fc\.weight$", "column"),
        _s(r".*\.mlp\.c_proj\.weight$", "row"),
    ),
    "gpt_neox": (
        _s(r".*\.attention\.query_key_value\.weight$", "column"),  # per-head packed: plain split
        _s(r".*\.attention\.dense\.weight$", "row"),
        _s(r".*\.mlp\.dense_h_to_4h\.weight$", "column"),
        _s(r".*\.mlp\.dense_4h_to_h\.weight$", "row"),
    ),
    "phi3": (
        _s(r".*\.self_attn\.qkv_proj\.weight$", "column", fused="qkv"),
        _s(r".*\.self_attn\.o_proj\.weight$", "row"),
        _s(r".*\.mlp\.gate_up_proj\.weight$", "column", fused=2),
        _s(r".*\.mlp\.down_proj\.weight$", "row"),
    ),
}

#: ``config.model_type`` -> preset name.
FAMILY_OF: dict[str, str] = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
                             "gpt2": "gpt2", "gpt_neox": "gpt_neox", "phi3": "phi3"}

#: Head-count attributes rewritten on every module that has them (the attention modules):
#: name -> what it counts. Counts read from ``module.config`` inside a forward (Phi-3 reads
#: ``self.config.num_attention_heads``) are served by a per-module config view.
ATTENTION_ATTRS: dict[str, str] = {
    "num_heads": "q_heads", "num_attention_heads": "q_heads", "n_head": "q_heads",
    "num_key_value_heads": "kv_heads", "num_kv_heads": "kv_heads",
    "num_key_value_groups": "kv_groups",
    "split_size": "q_width", "embed_dim": "q_width",   # GPT-2: c_attn output split into q, k, v
}


def specs_for(model_type: Optional[str], preset: Optional[str], user: Sequence[LayerSpec],
              use_default_specs: bool) -> tuple[LayerSpec, ...]:
    """User specs first (they win), then the family's preset (``preset`` overrides the
    lookup by ``model_type``) unless ``use_default_specs`` is false."""
    out = list(user)
    if use_default_specs:
        name = preset or FAMILY_OF.get(model_type or "")
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"tensor_parallel.preset_model {preset!r} is not one of {sorted(PRESETS)}")
        if name is None:
            if not out:
                raise ValueError(f"AutoTP has no rules for model_type {model_type!r} (supported: "
                                 f"{sorted(FAMILY_OF)}): give tensor_parallel.partition_config.layer_specs "
                                 f"(regex -> column/row/skip), or tensor_parallel.preset_model")
        else:
            out.extend(PRESETS[name])
    if not out:
        raise ValueError("tensor_parallel.partition_config.use_default_specs is false and no layer_specs are "
                         "given: AutoTP would split nothing")
    return tuple(out)


def _fused_of(shape: Any, where: str) -> Union[None, int, tuple[int, ...]]:
    """DeepSpeed's ``shape`` field, the subset that describes fused parts along dim 0:
    ``[k, -1]`` (k equal parts) or ``[[a, b, c], -1]`` (parts of sizes a, b, c)."""
    if shape is None:
        return None
    if (not isinstance(shape, (list, tuple)) or len(shape) != 2 or shape[1] != -1):
        raise ValueError(f"{where}.shape {shape!r}: only [k, -1] (k equal fused parts) and [[a, b, ...], -1] "
                         f"(fused parts of those sizes) along the output dim are supported")
    head = shape[0]
    if isinstance(head, int) and head >= 1:
        return head
    if isinstance(head, (list, tuple)) and head and all(isinstance(x, int) and x > 0 for x in head):
        return tuple(head)
    raise ValueError(f"{where}.shape {shape!r}: the first entry must be a positive int or a list of them")


def parse_layer_specs(raw: Sequence[Mapping[str, Any]]) -> tuple[LayerSpec, ...]:
    """``partition_config.layer_specs`` (DeepSpeed's JSON form) -> specs. ``replicate`` is
    accepted as a synonym of DeepSpeed's ``skip``."""
    out = []
    for i, spec in enumerate(raw):
        where = f"tensor_parallel.partition_config.layer_specs[{i}]"
        if not isinstance(spec, Mapping):
            raise ValueError(f"{where} must be an object with patterns and partition_type")
        unknown = set(spec) - {"patterns", "partition_type", "shape", "partition_dim"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)} (known: patterns, partition_type, shape)")
        pats = spec.get("patterns")
        if isinstance(pats, str):
            pats = [pats]
        if not pats or not all(isinstance(p, str) for p in pats):
            raise ValueError(f"{where}.patterns must be a non-empty list of regexes on weight names")
        for p in pats:
            try:
                re.compile(p)
            except re.error as exc:
                raise ValueError(f"{where}.patterns: {p!r} is not a valid regex ({exc})") from None
        kind = str(spec.get("partition_type", "column")).lower()
        kind = "skip" if kind == "replicate" else kind
        if kind not in PARTITION_TYPES:
            raise ValueError(f"{where}.partition_type {kind!r} must be column, row or skip (replicate)")
        if spec.get("partition_dim") not in (None, 0 if kind == "column" else 1):
            raise ValueError(f"{where}.partition_dim: only the default (0 for column, 1 for row, in nn.Linear "
                             f"layout) is supported")
        fused = _fused_of(spec.get("shape"), where)
        if fused is not None and kind != "column":
            raise ValueError(f"{where}.shape: fused parts are supported for column-parallel layers only")
        out.append(LayerSpec(tuple(pats), kind, fused))
    return tuple(out)
