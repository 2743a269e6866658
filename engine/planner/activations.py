"""The planner's activation term: bytes one pipeline rank holds at its activation peak
during a step's forward + backward, by recompute policy, TP/SP, CP and the micro-batch
chunks the schedule keeps in flight (what ``memory.json``'s ``activation_peak_bytes``
measures; checked against it by benchmarks/activation_memory_planner.py).

Saved bytes per block come from the one formula, :mod:`engine.models.activation_memory`
(docs/activation_memory.md, measured exact per layer). On top of the blocks:

- the LM head's piece keeps what the final norm and the head linear keep (the same terms as
  one norm + linear of a block) and the logits, compute dtype, T·V/t; its loss adds an fp32
  temporary of the logits (logits − max), and an fp32 copy of them below fp32, at the end of
  the forward; all of it is released by the head's backward, before the blocks' backward;
- under context parallelism (C ranks, T = B·S/C tokens per rank) each block's bytes are the
  formula's at T tokens plus :func:`cp_block_bytes_per_token` (the CP attention's saved
  tensors against SDPA's: positions, rotary tables at the shard's positions, its own v, its
  fp32 output; measured);
- a backward's working set, on top of what is held: the gradients inside the MLP it starts
  with (gate, up and product gradients, 3·F·e/t per token) and two residual-stream
  gradients (2·H·e/s); under ``full`` recomputation also one block's recomputed activations
  (its no-recompute bytes), under ``selective`` the recomputed parts of one block;
- a zero-bubble input-gradient pass (``I``) keeps the graph until its weight pass (``W``),
  but the executor's SavedStore (engine.pipeline.split_backward) drops every saved tensor the
  weight pass does not read, so from ``I`` to ``W`` a piece holds :func:`weight_pass_bytes`
  (its linears' inputs and its norms' weight-gradient inputs), plus the output gradients
  captured at each junction (every linear's and norm's output, the logits); under ``full``
  recomputation (no SavedStore) a recomputed block is one autograd function, whose whole
  backward the input pass runs (nothing of it kept until ``W``), and the loss releases its
  saved logits in the input pass.

Micro-batches in flight come from the schedule itself: each rank's compute order
(:func:`engine.pipeline.schedule.compute_order`) is walked, a forward adding its piece's
bytes and a backward (or weight pass) releasing them, so a schedule added to the engine is
covered as soon as it has a compute order.

Policies searched by the planner (:data:`RECOMPUTE_POLICIES`): ``none``, ``selective`` (the
default modules, :data:`engine.models.config.DEFAULT_SELECTIVE`) and ``full`` (uniform, one
block per unit) — the ``activation_checkpointing`` configs :func:`policy_config` writes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from engine.models.activation_memory import BlockDims, block_saved_bytes, policy_saved_bytes
from engine.models.config import DEFAULT_SELECTIVE, ModelConfig
from engine.pipeline.actions import ActionKind, virtual_stage
from engine.pipeline.schedule import compute_order, placement_of

__all__ = ["RECOMPUTE_POLICIES", "CP_META_BYTES", "cp_block_bytes_per_token", "ActivationShape", "policy_config", "piece_saved_bytes", "inflight_peaks",
           "recompute_forward_fraction", "policy_modules"]

RECOMPUTE_POLICIES = ("none", "selective", "full")
K = ActionKind


def policy_config(policy: str) -> Optional[dict[str, Any]]:
    """The ``activation_checkpointing`` section of a searched policy (None: no section)."""
    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(f"unknown recompute policy {policy!r}; use one of {RECOMPUTE_POLICIES}")
    return None if policy == "none" else {"granularity": policy}


def recompute_forward_fraction(policy: str) -> float:
    """The share of a block's forward GEMM/attention FLOPs its backward reruns: ``full`` all of
    it; the default ``selective`` parts (norms, silu(gate)) none (elementwise only: zero
    FLOPs counted by FlopCounterMode, docs/activation_memory.md)."""
    return 1.0 if policy == "full" else 0.0


CP_META_BYTES = 16  # int64 global position + document id per token (engine.context_parallel.attention)


def cp_block_bytes_per_token(model: ModelConfig, cp: int, ulysses_size: int, tp: int, elem: int) -> float:
    """What one block keeps for backward per local token under context parallelism beyond
    the formula's (docs/activation_memory.md, "Context parallelism"; may be negative; 0
    without CP). The CP attention (engine.context_parallel.ring, one autograd function)
    replaces SDPA's saved tensors:

    - it saves its own v (a copy: the model's v is a view of the fused q/k/v output), so the
      fused output e(a + 2g)/t is no longer pinned, and nothing keeps a second rotated k:
      −g·e/t net of q, k, v;
    - its output in the compute dtype of the merge (fp32, fp64 for fp64), (4 − e)·a/t more
      than SDPA's below fp32, and the output projection's input is a copy (the transpose of
      its (B, heads, S/C, d) output is not a view of the projection's layout): that copy takes
      the place of the fused q/k/v output's a·e/t;
    - the int64 positions and document ids of the tokens it attends over, (B, 2, U·S/C):
      16·U (U = C under Ulysses, 1 for the ring; not split by TP);
    - the rotary cos/sin gathered at the shard's global positions, (B, S/C, d) fp32 each,
      saved by the rotation's products: 8·d (not split by TP);
    - under Ulysses with KV heads per TP rank not divisible by U, k and v repeated to
      lcm(kv, U) heads before the all-to-all: 2·(g' − g)·e/t.

    Measured per block (slope over 2 and 6 layers, CP 2, hidden 64, 8 heads, d 8): ring kv 2
    fp32 +16 B/token, kv 4 −48, bf16 +178 (formula 176: the fp32 norm-weight constant over
    the token counts), Ulysses kv 2 +32, kv 1 +128 (lcm repetition) - each the derivation's."""
    if cp == 1:
        return 0.0
    d, u = model.head_dim, ulysses_size
    kv_t = max(1, model.kv_heads // tp)
    g, a = kv_t * d, model.num_heads // tp * d
    cd = 8 if elem == 8 else 4
    kv_rep = (math.lcm(kv_t, u) - kv_t) * d if u > 1 and kv_t % u else 0
    return CP_META_BYTES * u + 8 * d - g * elem + a * (cd - elem) + 2 * kv_rep * elem


@dataclass(frozen=True)
class ActivationShape:
    """What the bytes depend on: tokens of one micro-batch on this rank (B·S/cp), TP degree,
    sequence parallelism, compute-dtype bytes and the policy; ``cp_extra``: what a block
    keeps per token under context parallelism beyond the formula
    (:func:`cp_block_bytes_per_token`, 0 without CP)."""

    tokens: int
    tp: int
    sp: bool
    elem: int
    policy: str
    cp_extra: float = 0.0

    @property
    def s(self) -> int:
        return self.tp if self.sp and self.tp > 1 else 1


def policy_modules(policy: str) -> tuple[str, ...]:
    """The block parts a searched policy recomputes (selective: the default modules)."""
    return DEFAULT_SELECTIVE if policy == "selective" else ()


def block_bytes(model: ModelConfig, a: ActivationShape, blocks: int) -> float:
    """Saved bytes of ``blocks`` blocks of one micro-batch (one stage piece) under the policy."""
    if blocks == 0:
        return 0.0
    per = policy_saved_bytes(BlockDims.of(model), a.tokens, elem=a.elem, granularity=a.policy,
                             modules=policy_modules(a.policy), layers=blocks, tp=a.tp, sp=a.sp)
    meta = 0 if a.policy == "full" else a.tokens * a.cp_extra  # a checkpointed block reruns its attention
    return (per + meta) * blocks


def head_saved_bytes(model: ModelConfig, a: ActivationShape) -> float:
    """Final norm + head input (one norm + linear term of the formula) and the logits."""
    h, t = model.hidden_size, a.tokens
    norm = t * ((4 * h + 4 + 4 * h) / a.s + a.elem * h) + (0 if a.elem == 4 else 4 * h)
    return norm + t * model.vocab_size / a.tp * a.elem


def loss_temporary_bytes(model: ModelConfig, a: ActivationShape) -> float:
    """The cross-entropy's fp32 logits − max (and an fp32 copy of the logits below fp32)."""
    return a.tokens * model.vocab_size / a.tp * (4 + (4 if a.elem < 4 else 0))


def backward_working_bytes(model: ModelConfig, a: ActivationShape, blocks: int) -> float:
    """On top of what is held while a piece's backward runs (module docstring)."""
    if blocks == 0:
        return 0.0
    h, f, t = model.hidden_size, model.ffn_size, a.tokens
    grads = t * a.elem * (2 * f / a.tp + 2 * h / a.s)
    dims = BlockDims.of(model)
    none = block_saved_bytes(dims, t, elem=a.elem, tp=a.tp, sp=a.sp) + t * a.cp_extra
    if a.policy == "full":
        return grads + none
    if a.policy == "selective":
        return grads + none - t * a.cp_extra - block_saved_bytes(dims, t, elem=a.elem, tp=a.tp, sp=a.sp,
                                                                  modules=DEFAULT_SELECTIVE)
    return grads


def captured_grad_bytes(model: ModelConfig, a: ActivationShape, blocks: int, has_head: bool) -> float:
    """Output gradients a zero-bubble input pass captures for the weight pass, per block:
    q/k/v (a + 2g) and gate/up (2F) /t, the output and down projections' (H, whole sequence
    before the reduce-scatter under SP) and the two norms' (H/s); the head's logits (V/t)
    and the final norm's (H/s)."""
    qkv = (model.num_heads + 2 * model.kv_heads) * model.head_dim
    h = model.hidden_size
    # a fully recomputed block is one autograd function: the input pass runs its whole backward
    per_block = 0.0 if a.policy == "full" else (qkv + 2 * model.ffn_size) / a.tp + 2 * h + 2 * h / a.s
    head = model.vocab_size / a.tp + h / a.s if has_head else 0.0
    return a.tokens * a.elem * (blocks * per_block + head)


def weight_pass_bytes(model: ModelConfig, a: ActivationShape, blocks: int, has_head: bool) -> float:
    """What a deferred weight pass reads, all a split chunk keeps of its forward from its ``I``
    to its ``W`` (the executor's SavedStore drops the rest after ``I``), per block: each norm's
    weight-gradient input (its normalised fp32 tensor, 4H/s; under ``norm`` recomputation the
    recompute's input, e H/s), the q/k/v and gate/up linears' input (e H, gathered under SP),
    the output projection's (e a/t) and the down projection's (e F/t); the head: the final
    norm's and the head linear's input."""
    h, t = model.hidden_size, a.tokens
    norm = a.elem * h / a.s if "norm" in policy_modules(a.policy) else 4 * h / a.s
    attn = model.num_heads * model.head_dim
    per_block = 2 * norm + 2 * a.elem * h + a.elem * (attn + model.ffn_size) / a.tp
    head = norm + a.elem * h if has_head else 0.0
    return t * (blocks * per_block + head)


def piece_saved_bytes(model: ModelConfig, a: ActivationShape, blocks: int, has_head: bool) -> float:
    """Bytes one micro-batch keeps on a stage piece from its forward to its backward."""
    return block_bytes(model, a, blocks) + (head_saved_bytes(model, a) if has_head else 0.0)


def inflight_peaks(model: ModelConfig, a: ActivationShape, schedule: str, pp: int, num_microbatches: int,
                   virtual_stages: int, pieces: Sequence[tuple[int, bool]]) -> list[float]:
    """Peak activation bytes of each pipeline rank: ``pieces[k]`` = (blocks, has_head) of model
    piece ``k`` (``pp * virtual_stages`` of them; without a pipeline, one). Walks each rank's
    compute order (module docstring)."""
    saved = tuple(piece_saved_bytes(model, a, b, h) for b, h in pieces)
    # what an input pass frees at once: fully recomputed blocks (their backward is whole) and the
    # loss's saved logits (its gradient, captured, takes their place)
    logits = a.tokens * model.vocab_size / a.tp * a.elem
    if a.policy == "full":  # no SavedStore under a checkpoint: what the input pass frees at once
        kept = tuple(s_ - block_bytes(model, a, b) - (logits if h else 0.0) for s_, (b, h) in zip(saved, pieces))
    else:  # the SavedStore keeps only what the weight pass reads
        kept = tuple(weight_pass_bytes(model, a, b, h) for b, h in pieces)
    fwd_tmp = tuple(loss_temporary_bytes(model, a) if h else 0.0 for _, h in pieces)
    bwd_tmp = tuple(backward_working_bytes(model, a, b) for b, _ in pieces)
    caught = tuple(captured_grad_bytes(model, a, b, h) for b, h in pieces)
    # what the head keeps goes with its backward, before the blocks' backward starts
    head_release = tuple(head_saved_bytes(model, a) if h else 0.0 for _, h in pieces)
    if pp == 1:
        return [max(saved[0] + fwd_tmp[0], saved[0] - head_release[0] + bwd_tmp[0])]
    return list(_walk(schedule, pp, num_microbatches, virtual_stages, saved, fwd_tmp, bwd_tmp, caught, head_release,
                      kept))


@functools.lru_cache(maxsize=1024)
def _walk(schedule: str, p: int, m: int, v: int, saved: tuple, fwd_tmp: tuple, bwd_tmp: tuple, caught: tuple,
          head_release: tuple, kept: tuple) -> tuple[float, ...]:
    placement = placement_of(schedule)
    out = []
    for rank in range(p):
        held = peak = 0.0
        for act in compute_order(schedule, rank, p, m, v):
            k = virtual_stage(rank, act.chunk, p, placement)
            if act.kind is K.FORWARD:
                peak = max(peak, held + saved[k] + fwd_tmp[k])
                held += saved[k]
            elif act.kind is K.BACKWARD:
                peak = max(peak, held - head_release[k] + bwd_tmp[k])
                held -= saved[k]
            elif act.kind is K.BACKWARD_INPUT:
                if k == 0:  # no input gradient on the first piece: the weight pass is the backward
                    continue
                peak = max(peak, held + caught[k] + bwd_tmp[k])
                held += caught[k] - (saved[k] - kept[k])
            elif k == 0:
                peak = max(peak, held - head_release[k] + bwd_tmp[k])
                held -= saved[k]
            else:  # the weight pass: the graph and the captured gradients go (its working set is smaller)
                held -= kept[k] + caught[k]
        out.append(peak)
    return tuple(out)
