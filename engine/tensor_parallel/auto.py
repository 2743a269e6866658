"""AutoTP: tensor parallelism for models we did not write (Hugging Face decoders).

:func:`autotp` walks a model, and every ``nn.Linear`` or GPT-2 ``Conv1D`` whose weight
name matches a :class:`~engine.tensor_parallel.auto_rules.LayerSpec` is replaced, in
place and under the same name, by an :class:`AutoTPLinear` holding this rank's slice:

- column (q/k/v, gate/up): ``Y_r = X A_r^T + b_r``, ``A = [A_1; ...; A_p]`` split along the
  output features (fused parts split one by one, so rank r holds ``[q_r; k_r; v_r]``);
  input through copy-to-region (backward all-reduces dX);
- row (attention out, MLP down): ``Y = sum_r X_r A_r^T + b``, ``A = [A_1 ... A_p]`` split
  along the input features; partial outputs all-reduced, the (replicated) bias added once.

Weights keep the source layout and parameter names (``nn.Linear``: (out, in); ``Conv1D``:
(in, out), so its column split is along dim 1), which is why a checkpoint of an AutoTP
model has the same names and full shapes as the Hugging Face model, and reshapes between
TP sizes with the engine's checkpoint code (the parameters' :class:`~engine.placement.Placement`).

Grouped-query attention: with ``n_kv % tp == 0`` the k/v projections are split by heads.
With fewer KV heads than TP ranks (``tp % n_kv == 0``) they are *replicated*: every rank
holds the whole k/v weight and computes only the one KV head its query heads use; the
weight's gradient is summed over the TP group (copy-to-region on the weight). Any other
ratio, or a fused qkv weight with ``n_kv < tp``, is refused.

Embeddings, the LM head (a tied one stays tied: neither is touched) and norms stay
replicated; the loss is Hugging Face's own over full logits. Attention modules get their
head-count attributes rewritten to the local counts (``ATTENTION_ATTRS``) and, where a
forward reads counts from ``self.config`` (Phi-3), a config view with the local counts.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.distributed.groups import AxisGroup
from engine.placement import REPLICATED, set_placement, tp_shard
from engine.tensor_parallel.auto_rules import ATTENTION_ATTRS, LayerSpec
from engine.tensor_parallel.layers import shard_tensor
from engine.tensor_parallel.mappings import copy_to_tp_region, reduce_from_tp_region, tp_rank, tp_world_size

__all__ = ["AutoTPLinear", "HeadCounts", "AutoTPResult", "autotp", "head_counts"]

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class HeadCounts:
    """Global attention shape of the model (from its config)."""

    n_heads: int
    n_kv: int
    head_dim: int


def head_counts(config: Any) -> Optional[HeadCounts]:
    """``(n_heads, n_kv, head_dim)`` of a Hugging Face config, or None without attention."""
    nh = getattr(config, "num_attention_heads", None)
    if not isinstance(nh, int):
        return None
    nkv = getattr(config, "num_key_value_heads", None) or nh
    hd = getattr(config, "head_dim", None) or config.hidden_size // nh
    return HeadCounts(int(nh), int(nkv), int(hd))


def _is_conv1d(m: nn.Module) -> bool:
    # transformers.pytorch_utils.Conv1D, by name so that transformers stays optional
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and hasattr(m, "nx")


class AutoTPLinear(nn.Module):
    """A linear layer's TP shard (module docstring). ``mode``: ``column``, ``row`` or
    ``kv_replicated`` (whole weight, rows ``[lo, lo + n)`` of the output used here).
    ``transposed``: the weight is stored (in, out) as GPT-2's ``Conv1D``."""

    def __init__(self, mode: str, weight: torch.Tensor, bias: Optional[torch.Tensor], tp_group: AxisGroup, *,
                 transposed: bool = False, parts: Optional[Sequence[int]] = None,
                 rows: Optional[tuple[int, int]] = None) -> None:
        super().__init__()
        world, rank = tp_world_size(tp_group), tp_rank(tp_group)
        self.mode, self.tp_group, self.transposed = mode, tp_group, transposed
        out_dim, in_dim = (1, 0) if transposed else (0, 1)
        self.out_dim = out_dim
        self.parts = tuple(parts) if parts and len(parts) > 1 else None
        self.rows = rows
        self.in_features, self.out_features = weight.shape[in_dim], weight.shape[out_dim]
        with torch.no_grad():
            if mode == "column":
                w = shard_tensor(weight.detach(), out_dim, rank, world, self.parts)  # (out/tp, in) or (in, out/tp)
                b = None if bias is None else shard_tensor(bias.detach(), 0, rank, world, self.parts)
            elif mode == "row":
                w = shard_tensor(weight.detach(), in_dim, rank, world)               # (out, in/tp) or (in/tp, out)
                b = None if bias is None else bias.detach().clone()
            elif mode == "kv_replicated":
                w, b = weight.detach().clone(), None if bias is None else bias.detach().clone()
            else:
                raise ValueError(f"AutoTPLinear mode {mode!r}: must be column, row or kv_replicated")
        self.weight = nn.Parameter(w, requires_grad=weight.requires_grad)
        self.bias = None if b is None else nn.Parameter(b, requires_grad=bias is not None and bias.requires_grad)
        self._tag()

    def _tag(self) -> None:
        """The placements of the parameters (again after ``to_empty``, which swaps tensors
        and with them their Python attributes)."""
        col = self.mode == "column"
        set_placement(self.weight, REPLICATED if self.mode == "kv_replicated" else
                      tp_shard(self.out_dim, self.parts) if col else tp_shard(1 - self.out_dim))
        if self.bias is not None:
            set_placement(self.bias, tp_shard(0, self.parts) if col else REPLICATED)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._tag()
        return out

    def _gemm(self, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
        if not self.transposed:
            return F.linear(x, w, b)
        y = torch.matmul(x, w)                                    # (..., in) @ (in, out_local)
        return y if b is None else y + b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.tp_group
        if self.mode == "row":
            y = reduce_from_tp_region(self._gemm(x, self.weight, None), g)   # (B, S, out), summed over ranks
            return y if self.bias is None else y + self.bias
        x = copy_to_tp_region(x, g)                               # (B, S, in); backward all-reduces dX
        if self.mode == "column":
            return self._gemm(x, self.weight, self.bias)          # (B, S, out/tp)
        assert self.rows is not None
        lo, n = self.rows  # kv_replicated: partial weight gradients summed over the TP group
        w = copy_to_tp_region(self.weight, g).narrow(self.out_dim, lo, n)
        b = None if self.bias is None else copy_to_tp_region(self.bias, g).narrow(0, lo, n)
        return self._gemm(x, w, b)                                # (B, S, n)

    def extra_repr(self) -> str:
        return (f"{self.mode}, in={self.in_features}, out={self.out_features}, local={tuple(self.weight.shape)}, "
                f"parts={self.parts}, conv1d={self.transposed}" + (f", rows={self.rows}" if self.rows else ""))


class _ConfigView:
    """A model config with some counts replaced by this rank's (for forwards that read
    ``self.config.num_attention_heads``); every other attribute is the shared config's."""

    def __init__(self, base: Any, **local: int) -> None:
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_local", dict(local))

    def __getattr__(self, name: str) -> Any:
        local = object.__getattribute__(self, "_local")
        return local[name] if name in local else getattr(object.__getattribute__(self, "_base"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_base"), name, value)


@dataclass
class AutoTPResult:
    """What :func:`autotp` did: ``replaced`` (module name -> mode), ``param_map`` (id of an
    original parameter -> the parameter replacing it), ``attention`` (modules whose head
    counts were rewritten)."""

    replaced: dict[str, str] = field(default_factory=dict)
    param_map: dict[int, nn.Parameter] = field(default_factory=dict)
    attention: list[str] = field(default_factory=list)


def _find_spec(specs: Sequence[LayerSpec], weight_name: str) -> Optional[LayerSpec]:
    return next((s for s in specs if s.matches(weight_name)), None)


def _local_counts(hc: HeadCounts, tp: int, kv_replicated: bool) -> dict[str, int]:
    q = hc.n_heads // tp
    kv = 1 if kv_replicated else hc.n_kv // tp
    return {"q_heads": q, "kv_heads": kv, "kv_groups": q // kv, "q_width": q * hc.head_dim}


def _check_heads(hc: Optional[HeadCounts], tp: int, specs_used: Sequence[LayerSpec]) -> bool:
    """Validate head divisibility; returns whether KV projections are replicated."""
    if hc is None:
        return False
    if hc.n_heads % tp:
        raise ValueError(f"AutoTP: num_attention_heads = {hc.n_heads} is not divisible by tensor_parallel."
                         f"autotp_size = {tp}: choose a TP size that divides the number of heads")
    if hc.n_kv % tp == 0:
        return False
    if tp % hc.n_kv:
        raise ValueError(f"AutoTP: num_key_value_heads = {hc.n_kv} and autotp_size = {tp}: the KV heads can be "
                         f"neither split (n_kv % tp != 0) nor replicated (tp % n_kv != 0); choose a TP size that "
                         f"divides or is a multiple of {hc.n_kv}")
    if any(s.fused == "qkv" for s in specs_used):
        raise ValueError(f"AutoTP: {hc.n_kv} KV heads < autotp_size = {tp} with a fused qkv projection: replicating "
                         f"part of a fused weight is not supported; use autotp_size <= {hc.n_kv}")
    return True


def _parts(spec: LayerSpec, hc: Optional[HeadCounts], out_features: int, name: str) -> Optional[list[int]]:
    if spec.fused is None:
        return None
    if spec.fused == "qkv":
        if hc is None:
            raise ValueError(f"AutoTP: {name} is a fused qkv projection but the model config has no "
                             f"num_attention_heads")
        parts = [hc.n_heads * hc.head_dim, hc.n_kv * hc.head_dim, hc.n_kv * hc.head_dim]
    elif isinstance(spec.fused, int):
        parts = [out_features // spec.fused] * spec.fused
    elif isinstance(spec.fused, tuple):
        parts = list(spec.fused)
    else:
        raise ValueError(f"AutoTP: {name}: unknown fused layout {spec.fused!r}")
    if sum(parts) != out_features:
        raise ValueError(f"AutoTP: {name} has {out_features} output features but its fused parts {parts} add up "
                         f"to {sum(parts)}: fix the layer spec's shape")
    return parts


def _plan(model: nn.Module, specs: Sequence[LayerSpec]) -> list[tuple[str, nn.Module, LayerSpec]]:
    out = []
    for name, m in model.named_modules():
        if isinstance(m, AutoTPLinear):
            raise ValueError(f"AutoTP: the model is already tensor-parallel ({name} is an AutoTPLinear)")
        if not (isinstance(m, nn.Linear) or _is_conv1d(m)):
            continue
        spec = _find_spec(specs, f"{name}.weight")
        if spec is not None and spec.partition_type != "skip":
            out.append((name, m, spec))
    return out


def autotp(model: nn.Module, tp_group: AxisGroup, specs: Sequence[LayerSpec], *,
           config: Any = None) -> AutoTPResult:
    """Replace ``model``'s projections by their TP shards, in place (see module docstring).

    ``specs``: the layer specs (user specs before the family preset:
    :func:`engine.tensor_parallel.auto_rules.specs_for`). ``config``: the model config
    (default ``model.config``) for the head counts. Purely local: every rank slices the
    weights it was given, so they must be equal on the TP ranks (the engine broadcasts
    them from TP rank 0 first). Works on the meta device (no memory; load weights later).
    """
    tp = tp_world_size(tp_group)
    config = config if config is not None else getattr(model, "config", None)
    hc = head_counts(config) if config is not None else None
    plan = _plan(model, specs)
    if not plan:
        raise ValueError("AutoTP: no linear layer of the model matches the layer specs, so nothing would be split: "
                         "check tensor_parallel.partition_config.layer_specs against model.named_modules()")
    kv_rep = _check_heads(hc, tp, [s for _, _, s in plan])
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise ValueError("AutoTP supports decoder-only models; this one is encoder-decoder")
    result = AutoTPResult()
    parents: dict[str, nn.Module] = {}
    for name, m, spec in plan:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if getattr(parent, "is_cross_attention", False):
            raise ValueError(f"AutoTP: {parent_name} is a cross-attention module, which is not supported")
        conv = _is_conv1d(m)
        weight, bias = m.weight, m.bias
        assert isinstance(weight, torch.Tensor) and (bias is None or isinstance(bias, torch.Tensor))
        out_features = weight.shape[1 if conv else 0]
        mode, rows = ("column" if spec.partition_type == "column" else "row"), None
        if spec.kv and kv_rep and hc is not None:
            per_rank_q = hc.n_heads // tp
            kv_head = (tp_rank(tp_group) * per_rank_q) // (hc.n_heads // hc.n_kv)
            mode, rows = "kv_replicated", (kv_head * hc.head_dim, hc.head_dim)
        try:
            new = AutoTPLinear(mode, weight, bias, tp_group, transposed=conv,
                               parts=_parts(spec, hc, out_features, name), rows=rows)
        except ValueError as exc:
            raise ValueError(f"AutoTP cannot split {name} ({mode}) over {tp} ranks: {exc}") from None
        result.param_map[id(weight)] = new.weight
        if bias is not None and new.bias is not None:
            result.param_map[id(bias)] = new.bias
        setattr(parent, child, new)
        result.replaced[name] = mode
        if spec.partition_type == "column" and (spec.kv or spec.fused == "qkv" or re.search(r"q_proj|query", child)):
            parents[parent_name] = parent
    if hc is not None:
        local = _local_counts(hc, tp, kv_rep)
        for pname, mod in parents.items():
            _rewrite_heads(mod, local)
            result.attention.append(pname)
    logger.info("AutoTP over %d ranks: %d layers split (%s), KV %s", tp, len(result.replaced),
                ", ".join(sorted(set(result.replaced.values()))), "replicated" if kv_rep else "split")
    return result


def _rewrite_heads(mod: nn.Module, local: dict[str, int]) -> None:
    """Set the attention module's head-count attributes (and config view) to local counts."""
    for attr, what in ATTENTION_ATTRS.items():
        if isinstance(getattr(mod, attr, None), int) and not isinstance(getattr(mod, attr), bool):
            setattr(mod, attr, local[what])
    cfg = getattr(mod, "config", None)
    if cfg is not None and isinstance(getattr(cfg, "num_attention_heads", None), int):
        view = _ConfigView(cfg, num_attention_heads=local["q_heads"], num_key_value_heads=local["kv_heads"])
        setattr(mod, "config", view)  # noqa: B010 - a plain attribute of the module, not a submodule
