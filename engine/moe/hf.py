"""Hugging Face Mixtral and Qwen2-MoE under expert parallelism (docs/moe.md, "Hugging Face
MoE models").

``engine.initialize(model=hf_model, config={..., "expert_parallel": {"size": EP}})`` with a
``MixtralForCausalLM`` or ``Qwen2MoeForCausalLM`` (any model of those two model types) calls
:func:`prepare_hf_moe_model`, which replaces the ``experts`` module of each sparse MoE block
(``MixtralExperts`` / ``Qwen2MoeExperts``: ``gate_up_proj`` (E, 2F, H), ``down_proj`` (E, H, F))
with :class:`ExpertParallelExperts`, holding only this EP rank's ``E/EP`` experts
``[r * E/EP, (r+1) * E/EP)`` copied from the HF module (the full tensors are released with it).

Only the experts change. The block's router (``gate``: HF's softmax then top-k, renormalised
always for Mixtral and per ``norm_topk_prob`` for Qwen2-MoE), Mixtral's router jitter,
Qwen2-MoE's shared expert with its sigmoid gate, and HF's load-balancing loss
(``output_router_logits``, ``router_aux_loss_coef``: computed from the router logits the
model records on this rank's tokens) are HF's own code, untouched: the routing is replicated
(every rank routes its own tokens with the same router weight), so the logits and the aux loss
equal the unsharded HF model's on the same batch. The new module keeps HF's call
``experts(hidden (T, H), top_k_index (T, K), top_k_weights (T, K)) -> (T, H)`` and parameter
names (a state dict key is HF's, each tensor holding this rank's experts along dim 0); it
dispatches each (token, expert) row to the EP rank holding the expert with the engine's
all-to-all of uneven splits (:func:`engine.moe.dispatch.dispatch_compute_combine`), runs the
local experts as a grouped GEMM with the model's activation, and adds each row's output
times its routing weight into the token, in HF's order (ascending expert) and dtype.

The expert parameters carry ``Placement.expert`` (:func:`engine.placement.set_expert_placement`):
ZeRO reduces and partitions them over the expert-gradient role, the global norm counts each
once, and checkpoints store them by global expert index (docs/expert_parallel.md).

Refused (a :class:`ConfigError` on every rank, before any collective; :func:`hf_moe_problem`):
a model type other than the two, an experts module of another class or layout, a number of
experts not divisible by EP, and tensor or pipeline parallelism with EP > 1.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from engine.distributed.groups import AxisGroup
from engine.moe.dispatch import dispatch_compute_combine
from engine.moe.experts import grouped_mm
from engine.placement import ExpertShard, set_expert_placement
from engine.validate import as_int

__all__ = ["SUPPORTED_MOE_MODEL_TYPES", "ExpertParallelExperts", "hf_moe_problem", "prepare_hf_moe_model",
           "hf_experts_modules"]

# model_type -> (the transformers module, its experts class, the config key of the number of experts)
_FAMILIES: dict[str, tuple[str, str, str]] = {
    "mixtral": ("transformers.models.mixtral.modeling_mixtral", "MixtralExperts", "num_local_experts"),
    "qwen2_moe": ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeExperts", "num_experts"),
}
SUPPORTED_MOE_MODEL_TYPES = tuple(_FAMILIES)
KEY = "expert_parallel.size"


def _experts_class(model_type: str) -> type:
    import importlib

    module, name, _ = _FAMILIES[model_type]
    return getattr(importlib.import_module(module), name)


def hf_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of each sparse MoE block's ``experts`` in ``model``: the
    modules whose class name ends in ``Experts`` (transformers' naming), or already replaced."""
    return [(n, m) for n, m in model.named_modules()
            if type(m).__name__.endswith("Experts") or isinstance(m, ExpertParallelExperts)]


def hf_moe_problem(model: nn.Module, ep: int, tp: int = 1, pp: int = 1) -> Optional[str]:
    """What stops ``model`` (a transformers model) from running at ``expert_parallel.size`` ``ep``
    (None: nothing). Reads only the model's config and module classes, the same on every rank."""
    cfg: Any = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in _FAMILIES:
        return (f"{KEY} = {ep} with a Hugging Face model of type {kind!r} ({type(model).__name__}): the expert-parallel "
                f"adapter supports {', '.join(SUPPORTED_MOE_MODEL_TYPES)} only; set {KEY} to 1 (the model then "
                "trains data-parallel with ZeRO 0-3, every expert on every rank)")
    if tp > 1 or pp > 1:
        return (f"{KEY} = {ep} with a Hugging Face {kind} model runs the DeepSpeed loop with data (and expert) "
                f"parallelism only: set tensor_parallel.autotp_size ({tp}) and pipeline.stages ({pp}) to 1")
    e = getattr(cfg, _FAMILIES[kind][2], None)
    n = as_int(e)
    if n is None or n < 1 or n % ep:
        return (f"{KEY} = {ep} does not divide the {kind} model's number of experts ({_FAMILIES[kind][2]} = {e}): "
                f"every expert-parallel rank holds num_experts / size experts; choose a size that divides {e}")
    want = _experts_class(kind)
    found = hf_experts_modules(model)
    if not found:
        return f"{KEY} = {ep}: the {kind} model has no sparse MoE block (no experts module): set {KEY} to 1"
    for name, m in found:
        if isinstance(m, ExpertParallelExperts):
            return f"{KEY} = {ep}: {name} is already expert-parallel (a model is prepared once): pass a fresh model"
        if type(m) is not want:
            return (f"{KEY} = {ep}: {name} is a {type(m).__name__}, not transformers' {want.__name__}: the adapter "
                    f"replaces only the HF experts module it knows (an unsupported MoE class); set {KEY} to 1")
        layout = (getattr(m, "is_transposed", False), getattr(m, "is_concatenated", True),
                  getattr(m, "has_bias", False), getattr(m, "has_gate", True))
        if layout != (False, True, False, True) or getattr(m, "num_experts", None) != e:
            return (f"{KEY} = {ep}: {name} has a layout the adapter does not know (transposed, interleaved, biased or "
                    f"gateless experts, or num_experts {getattr(m, 'num_experts', None)} != {e}); set {KEY} to 1")
    return None


class ExpertParallelExperts(nn.Module):
    """This EP rank's experts of one HF sparse MoE block (module docstring).

    ``gate_up_proj`` (E_local, 2F, H): rows ``[:F]`` the gate, ``[F:]`` the up projection;
    ``down_proj`` (E_local, H, F); local expert j is global expert ``first_expert + j``."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor],
                 num_experts: int, ep_group: AxisGroup) -> None:
        super().__init__()
        count = gate_up_proj.shape[0]
        if count * ep_group.size != num_experts or down_proj.shape[0] != count:
            raise ValueError(f"ExpertParallelExperts: {count} local experts x EP {ep_group.size} != {num_experts}")
        self.num_experts, self.ep_group, self.act_fn = num_experts, ep_group, act_fn
        self.first_expert = ep_group.rank * count
        self.gate_up_proj = nn.Parameter(gate_up_proj)
        self.down_proj = nn.Parameter(down_proj)
        shard = ExpertShard(self.first_expert, count, num_experts)
        for p in (self.gate_up_proj, self.down_proj):
            set_expert_placement(p, shard, ep_group.size)

    @classmethod
    def from_hf(cls, hf: nn.Module, ep_group: AxisGroup) -> "ExpertParallelExperts":
        """This rank's slice of ``hf`` (a ``MixtralExperts`` / ``Qwen2MoeExperts``), copied so that
        the full tensors go with ``hf``."""
        src: Any = hf   # transformers' experts module (checked by hf_moe_problem)
        e = int(src.num_experts)
        count = e // ep_group.size
        lo = ep_group.rank * count
        gate_up: torch.Tensor = src.gate_up_proj
        down: torch.Tensor = src.down_proj
        with torch.no_grad():
            mine = (gate_up.detach()[lo:lo + count].clone(), down.detach()[lo:lo + count].clone())
        out = cls(mine[0], mine[1], src.act_fn, e, ep_group)
        out.gate_up_proj.requires_grad_(gate_up.requires_grad)
        out.down_proj.requires_grad_(down.requires_grad)
        return out

    def _local(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` (N, H) sorted by local expert, ``counts`` (E_local,) -> (N, H): HF's
        ``down(act(x W_g^T) * x W_u^T)`` per expert (``F.linear`` = ``x @ W^T``)."""
        h = grouped_mm(x, self.gate_up_proj.transpose(1, 2), counts)        # (N, 2F)
        g, u = h.chunk(2, dim=-1)
        return grouped_mm(self.act_fn(g) * u, self.down_proj.transpose(1, 2), counts)   # (N, H)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """``hidden_states`` (T, H), ``top_k_index`` (T, K) global experts, ``top_k_weights``
        (T, K) -> (T, H) in ``hidden_states``' dtype, as HF's experts module."""
        k = top_k_index.shape[1]
        flat_e = top_k_index.reshape(-1)                                    # (T*K,)
        order = torch.argsort(flat_e, stable=True)                          # by expert, token order within
        src = order // k                                                    # (A,) the token of each sorted slot
        counts = torch.bincount(flat_e, minlength=self.num_experts)         # (E,)
        out = dispatch_compute_combine(hidden_states[src], counts, self.ep_group, self._local)  # (A, H)
        w = top_k_weights.reshape(-1)[order].unsqueeze(1)                   # (A, 1)
        contrib = (out * w).to(hidden_states.dtype)                         # HF: times the weight, then its dtype
        return torch.zeros_like(hidden_states).index_add(0, src, contrib)

    def extra_repr(self) -> str:
        return (f"experts [{self.first_expert}, {self.first_expert + self.gate_up_proj.shape[0]}) of "
                f"{self.num_experts}, ep {self.ep_group.size}")


def prepare_hf_moe_model(model: nn.Module, ep_group: AxisGroup) -> int:
    """Replace, in place, every sparse MoE block's ``experts`` of ``model`` (checked with
    :func:`hf_moe_problem` first) with this rank's :class:`ExpertParallelExperts`; returns how
    many were replaced."""
    replaced = 0
    for name, hf in hf_experts_modules(model):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, ExpertParallelExperts.from_hf(hf, ep_group))
        replaced += 1
    return replaced
