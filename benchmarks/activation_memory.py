"""Per-layer activation memory of the reference block under every recompute policy,
measured next to the formula (engine/models/activation_memory.py, docs/activation_memory.md),
with the recompute FLOPs of each policy.

Measured: the unique storages kept for backward by a stack of blocks run as a stage chunk
runs them (engine.pipeline.stages.StageChunk), counted once each by storage: every tensor
autograd saves (``torch.autograd.graph.saved_tensors_hooks``; a recompute unit's inputs are
saved this way too) plus the inputs a graph-keeping norm region holds
(``engine.models.recompute.observe_held``); parameters and the rotary tables excluded.
Divided by the number of blocks. The TorchTitan row applies TorchTitan's operator-level
policy (its ``_save_list``: matmuls except every second one, the attention kernels,
reduce-scatter, max; everything else recomputed) to our block with torch's selective
checkpoint; its saved bytes are the unique storages of the outputs the policy caches in the
forward (torch's selective-checkpoint storage) plus each block's input, which the
checkpoint holds.

Recompute FLOPs: FlopCounterMode over forward + backward, minus the same without
recomputation (GEMMs and attention; elementwise ops count zero).

    python benchmarks/activation_memory.py [--tokens 2x256] [--hidden 256] [--tp 2] [--out benchmarks/results/...]

SP rows run on ``--tp`` gloo ranks (sequence parallelism needs TP > 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from engine.distributed.groups import NO_TP, AxisGroup  # noqa: E402
from engine.models.activation_memory import BlockDims, policy_saved_bytes  # noqa: E402
from engine.models.blocks import Block, RotaryEmbedding  # noqa: E402
from engine.models.config import DEFAULT_SELECTIVE, ModelConfig  # noqa: E402
from engine.models.recompute import RecomputePolicy, apply_selective, observe_held  # noqa: E402
from engine.pipeline.stages import StageChunk  # noqa: E402

POLICIES: dict[str, RecomputePolicy] = {
    "none": RecomputePolicy(),
    "selective (default: norm, mlp_act)": RecomputePolicy("selective", DEFAULT_SELECTIVE),
    "selective norm": RecomputePolicy("selective", ("norm",)),
    "selective mlp_act": RecomputePolicy("selective", ("mlp_act",)),
    "selective core_attn": RecomputePolicy("selective", ("core_attn",)),
    "selective norm, core_attn, mlp_act": RecomputePolicy("selective", ("norm", "core_attn", "mlp_act")),
    "selective attn": RecomputePolicy("selective", ("attn",)),
    "selective mlp": RecomputePolicy("selective", ("mlp",)),
    "full uniform 1": RecomputePolicy("full"),
    "full uniform 2": RecomputePolicy("full", num_layers=2),
    "full block 1": RecomputePolicy("full", method="block", num_layers=1),
}
TORCHTITAN = "torchtitan op-level SAC"


def tiny_model(hidden: int, layers: int, seq: int) -> ModelConfig:
    return ModelConfig(vocab_size=256, hidden_size=hidden, num_layers=layers, num_heads=8, num_kv_heads=2,
                       seq_len=seq)


def build_chunk(cfg: ModelConfig, policy: RecomputePolicy, tp_group: AxisGroup, sp: bool,
                dtype: torch.dtype) -> StageChunk:
    rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.seq_len)
    blocks = [Block(cfg, i, tp_group, sp, 1, rotary, dtype=dtype) for i in range(cfg.num_layers)]
    if policy.granularity == "selective":
        for b in blocks:
            apply_selective(b, policy.modules)
    # start 1 of num_layers + 2: neither the embedding nor the head, every layer a block
    return StageChunk(blocks, 1, cfg.num_layers + 2, recompute=policy, tp_group=tp_group)


def _excluded(chunk: torch.nn.Module) -> set[int]:
    return {t.untyped_storage()._cdata for t in list(chunk.parameters()) + list(chunk.buffers())}


def saved_bytes(chunk: StageChunk, x: torch.Tensor) -> int:
    """Unique storages kept for backward by one forward of ``chunk`` (module docstring)."""
    skip = _excluded(chunk)
    seen: dict[int, int] = {}

    def note(t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st._cdata not in skip:
            seen[st._cdata] = st.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        note(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), observe_held(note):
        chunk(x)
    return sum(seen.values())


def torchtitan_saved_bytes(chunk: StageChunk, x: torch.Tensor) -> tuple[int, int]:
    """What TorchTitan's policy keeps: the outputs of the operators it saves (the same
    decision as :func:`torchtitan_run`, taken by a dispatch mode over a plain forward),
    unique storages, plus each block's input, which its non-reentrant checkpoint holds; and
    the FLOPs it recomputes (2 m k n per matmul it does not save; the other operators it
    recomputes are elementwise, zero FLOPs in FlopCounterMode's count)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    save = _torchtitan_save_list()
    mm = torch.ops.aten.mm.default
    skip = _excluded(chunk)
    seen: dict[int, int] = {}

    class Record(TorchDispatchMode):
        count = 0
        flops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if func == mm:
                Record.count += 1
                if Record.count % 2 == 0:
                    (m, k), n = args[0].shape, args[1].shape[1]
                    Record.flops += 2 * m * k * n
            if func in save and not (func == mm and Record.count % 2 == 0):
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in skip:
                        seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return out

    h = x
    for blk in chunk.layers:
        seen[h.untyped_storage()._cdata] = h.untyped_storage().nbytes()
        Record.count = 0  # TorchTitan counts per checkpointed block
        with Record():
            h = blk(h)
    return sum(seen.values()), Record.flops


def _torchtitan_save_list() -> set:
    """TorchTitan's ``_save_list`` (mm, the SDPA kernels, reduce-scatter, max) plus the CPU
    flash-attention kernel, the same operation on CPU."""
    ops = torch.ops.aten
    return {ops.mm.default, ops._scaled_dot_product_efficient_attention.default,
            ops._scaled_dot_product_flash_attention.default, ops._scaled_dot_product_flash_attention_for_cpu.default,
            ops._scaled_dot_product_cudnn_attention.default, ops.max.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default}


def _cpu_attention_flops() -> dict:
    """FlopCounterMode counts the CUDA attention kernels only; the CPU flash kernel (the same
    maths) gets torch's SDPA formulas (full S x S, causality not discounted, as torch's),
    with K/V at the query's head count (GQA does the same work per query head)."""
    from torch.utils import flop_counter as fcm

    aten = torch.ops.aten

    def heads(q: Any, k: Any) -> tuple:
        return (k[0], q[1], k[2], k[3])

    def forward(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return int(fcm.sdpa_flop_count(q, heads(q, k), heads(q, v)))

    def backward(grad_out: Any, q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return int(fcm.sdpa_backward_flop_count(grad_out, q, heads(q, k), heads(q, v)))

    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}


def recompute_flops(run: Any, base_run: Any, x: torch.Tensor) -> int:
    def count(fn: Any) -> int:
        xx = x.detach().requires_grad_(True)
        with FlopCounterMode(display=False, custom_mapping=_cpu_attention_flops()) as fc:
            fn(xx).sum().backward()
        return int(fc.get_total_flops())
    return count(run) - count(base_run)


def torchtitan_run(chunk: StageChunk) -> Any:
    """TorchTitan's op-level selective policy on every block (:func:`_torchtitan_save_list`;
    every second matmul recomputed; everything else recomputed)."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    ops = torch.ops.aten
    save = _torchtitan_save_list()

    def context() -> Any:
        meta: dict[str, int] = defaultdict(int)

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            key = ("recompute" if ctx.is_recompute else "forward") + "_mm_count"
            if func == ops.mm.default:
                meta[key] += 1
            keep = func in save and not (func == ops.mm.default and meta[key] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        return create_selective_checkpoint_contexts(policy)

    def run(x: torch.Tensor) -> torch.Tensor:
        for blk in chunk.layers:
            x = checkpoint(blk, x, use_reentrant=False, context_fn=context)
        return x
    return run


def measure_rows(cfg: ModelConfig, batch: int, tp_group: AxisGroup, sp: bool, dtype: torch.dtype,
                 policies: Optional[list[str]] = None, torchtitan: bool = True) -> list[dict]:
    """One row per policy: measured and formula bytes per layer, recompute FLOPs."""
    t = tp_group.size
    s_local = cfg.seq_len // t if sp and t > 1 else cfg.seq_len
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, s_local, cfg.hidden_size, generator=gen).to(dtype).requires_grad_(True)
    dims, tokens, elem = BlockDims.of(cfg), batch * cfg.seq_len, torch.finfo(dtype).bits // 8
    base = build_chunk(cfg, POLICIES["none"], tp_group, sp, dtype)
    rows = []
    for name in policies or list(POLICIES):
        p = POLICIES[name]
        chunk = build_chunk(cfg, p, tp_group, sp, dtype)
        measured = saved_bytes(chunk, x) / cfg.num_layers
        formula = policy_saved_bytes(dims, tokens, elem=elem, granularity=p.granularity, modules=p.modules,
                                     method=p.method, num_layers=p.num_layers, layers=cfg.num_layers, tp=t, sp=sp)
        row = {"policy": name, "measured": measured, "formula": formula, "ratio": measured / formula,
               "recompute_flops": recompute_flops(chunk, base, x) / cfg.num_layers}
        rows.append(row)
    if torchtitan:
        tt = build_chunk(cfg, POLICIES["none"], tp_group, sp, dtype)
        kept, flops = torchtitan_saved_bytes(tt, x)
        rows.append({"policy": TORCHTITAN, "measured": kept / cfg.num_layers, "formula": None, "ratio": None,
                     "recompute_flops": flops / cfg.num_layers})
    return rows


def _rank_rows(rank: int, world: int, hidden: int, layers: int, seq: int, batch: int, dtype: str) -> list[dict]:
    import torch.distributed as dist

    from engine.distributed.groups import AxisGroup as G

    group = G.of(dist.group.WORLD, "tp")
    return measure_rows(tiny_model(hidden, layers, seq), batch, group, True, getattr(torch, dtype), torchtitan=False)


def sp_rows(tp: int, hidden: int, layers: int, seq: int, batch: int, dtype: str) -> list[dict]:
    from engine.distributed.spawn import spawn

    return spawn(_rank_rows, tp, (hidden, layers, seq, batch, dtype), timeout=600)[0]


def table(rows: list[dict], title: str) -> str:
    lines = [f"### {title}", "", "| policy | measured bytes/layer | formula | measured/formula | recompute GFLOP/layer |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        f = "—" if r["formula"] is None else f"{r['formula']:,.0f}"
        q = "—" if r["ratio"] is None else f"{r['ratio']:.4f}"
        lines.append(f"| {r['policy']} | {r['measured']:,.0f} | {f} | {q} | {r['recompute_flops'] / 1e9:.4f} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2, help="TP ranks of the sequence-parallel rows (0: skip them)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=None, help="write a markdown table and a JSON next to it")
    args = ap.parse_args(argv)
    cfg = tiny_model(args.hidden, args.layers, args.seq)
    shape = (f"B {args.batch}, S {args.seq}, H {args.hidden}, heads 8, kv heads 2, F {cfg.ffn_size}, "
             f"{args.layers} layers, {args.dtype}")
    res = {"shape": shape, "tp1": measure_rows(cfg, args.batch, NO_TP, False, getattr(torch, args.dtype))}
    text = [table(res["tp1"], f"TP 1, no sequence parallelism ({shape})")]
    if args.tp > 1:
        res[f"tp{args.tp}_sp"] = sp_rows(args.tp, args.hidden, args.layers, args.seq, args.batch, args.dtype)
        text.append(table(res[f"tp{args.tp}_sp"], f"TP {args.tp} with sequence parallelism, per rank ({shape})"))
    out = "\n\n".join(text)
    print(out)
    if args.out:
        with open(args.out, "w") as f:
            f.write(out + "\n")
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
