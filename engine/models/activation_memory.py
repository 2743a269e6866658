"""Bytes one reference block keeps for backward, per recompute policy: the formula of
docs/activation_memory.md (Korthikanti et al. 2022, Table 2, adapted to RMSNorm, SwiGLU,
GQA and SDPA; no dropout), checked against a measurement by benchmarks/activation_memory.py.

Per token of this rank (T = B * S / cp tokens; TP degree t; s = t under sequence
parallelism, else 1; e bytes per element of the compute dtype; a = heads * d, g = kv_heads * d,
F = ffn_size, nh = heads; norms compute in fp32, 4 bytes):

- each RMSNorm keeps its fp32 input (4H, the input itself in fp32, a copy otherwise), the
  reciprocal RMS (4) and the normalised fp32 tensor (4H), all on the residual stream (/s);
  the linear after it keeps its input: e H, whole sequence (gathered) under SP;
  (+ a constant 4H bytes per norm for the fp32 copy of the weight when e != 4);
- attention: the fused q/k/v output e (a + 2g) (v is a view of it), rotated q and k
  e (a + g), the kernel's output e a (the output projection's input is a view of it) and
  its fp32 log-sum-exp 4 nh, all /t;
- SwiGLU: the gate/up output 2F e, silu(gate) F e and the product F e (the down
  projection's input), all /t.

Policies: ``norm`` recomputed keeps only its input (e H / s) and the linear's input;
``mlp_act`` drops silu(gate), F e / t (gate/up stay as the recompute's input, the product
as the down projection's input); ``core_attn`` drops the rotated q, k and the log-sum-exp; ``attn`` / ``mlp`` keep only their (local) input e H / s; ``full`` keeps the
unit's input e H / s per ``num_layers`` blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["BlockDims", "block_saved_bytes", "block_bytes_per_token", "policy_saved_bytes"]


@dataclass(frozen=True)
class BlockDims:
    """The shapes the formula needs (from a ModelConfig: hidden, heads, kv heads, head dim, ffn)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int

    @classmethod
    def of(cls, model: object) -> "BlockDims":
        m = model
        return cls(m.hidden_size, m.num_heads, m.kv_heads, m.head_dim, m.ffn_size)  # type: ignore[attr-defined]


def block_saved_bytes(dims: BlockDims, tokens: int, *, elem: int, tp: int = 1, sp: bool = False,
                      modules: Sequence[str] = ()) -> int:
    """Bytes one block keeps for backward with the selective parts ``modules`` recomputed
    (none: ``()``). ``tokens``: B * S (/ cp) of this rank, before any TP split."""
    per_tok, const = block_bytes_per_token(dims, elem=elem, tp=tp, sp=sp, modules=modules)
    return int(round(tokens * per_tok)) + const


def block_bytes_per_token(dims: BlockDims, *, elem: float, tp: int = 1, sp: bool = False,
                          modules: Sequence[str] = ()) -> tuple[float, int]:
    """``(bytes per token, constant bytes per block)`` of :func:`block_saved_bytes`."""
    h, t = dims.hidden, tp
    s = t if sp and t > 1 else 1
    a, g, f, nh = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim, dims.ffn, dims.heads
    parts = set(modules)
    per_tok = 0.0
    const = 0
    for sub in ("attn", "mlp"):
        if sub in parts:
            per_tok += elem * h / s  # the sublayer's normalised (local) input, kept by the recompute
        else:
            per_tok += elem * h  # the first linear's input (gathered under SP)
        if "norm" in parts:
            per_tok += elem * h / s  # the norm's input, kept by the recompute
        else:
            per_tok += (4 * h + 4 + 4 * h) / s
            const += 0 if elem == 4 else int(4 * h)
    if "attn" not in parts:
        per_tok += elem * (a + 2 * g) / t + elem * a / t  # q/k/v output; kernel output
        if "core_attn" not in parts:
            per_tok += elem * (a + g) / t + 4 * nh / t  # rotated q, k; log-sum-exp
    if "mlp" not in parts:
        per_tok += elem * (2 * f + f) / t  # gate/up output; the product (down's input)
        if "mlp_act" not in parts:
            per_tok += elem * f / t  # silu(gate)
    return per_tok, const


def policy_saved_bytes(dims: BlockDims, tokens: int, *, elem: int, granularity: str, modules: Sequence[str] = (),
                       method: str = "uniform", num_layers: int = 1, layers: int = 1, tp: int = 1,
                       sp: bool = False) -> float:
    """Mean bytes per block kept for backward over a chunk of ``layers`` blocks under a policy
    (``granularity`` "none" | "selective" | "full", as in the config)."""
    none = block_saved_bytes(dims, tokens, elem=elem, tp=tp, sp=sp)
    if granularity == "none":
        return float(none)
    if granularity == "selective":
        return float(block_saved_bytes(dims, tokens, elem=elem, tp=tp, sp=sp, modules=modules))
    s = tp if sp and tp > 1 else 1
    unit_input = tokens * elem * dims.hidden / s
    if method == "uniform":
        units = -(-layers // num_layers)
        return units * unit_input / layers
    kept = min(num_layers, layers)
    return (kept * unit_input + (layers - kept) * none) / layers
