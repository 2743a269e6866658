"""The planner's predicted activation peak next to the measured one, for a table of small
layouts covering every recompute policy and every pipeline schedule, and context parallelism
(ring and Ulysses at CP 2, with and without recompute, and CP 2 with a 1F1B pipeline).

Each row runs the real engine (``engine.initialize`` + ``train_batch``) on CPU gloo ranks:
one warm-up step (so that lazily made state counts as held before), then one step under the
memory probe of ``memory.json`` (``engine.training.memory_probe``: the exact live-tensor
high-water mark of the step's forward + backward over what was held at its start,
``activation_peak_bytes``). The prediction is
:func:`engine.planner.activations.activation_peak` for the same layout, per pipeline rank:
the saved activations of the micro-batch chunks the schedule's own compute order keeps in
flight on that rank, plus the transient working set of the forward or backward running at
the peak. Rows compare every rank (the worst pipeline rank is what the planner ranks by).
With CP the rows are the same model and micro-batch: each rank holds S/2 tokens of every
sequence (the CP ranks read the same rows), and the prediction is at those tokens plus the
CP attention's own saved tensors (:func:`engine.planner.activations.cp_block_bytes_per_token`).

    python benchmarks/activation_memory_planner.py [--out benchmarks/results/activation_peak_planner.json]
    python benchmarks/activation_memory_planner.py --rows 1f1b-none zb-h1-full   # a subset

Shapes: fp32 (the probe's exact count on CPU), hidden 64, 8 heads, 2 KV heads, 4 layers,
vocabulary 256, sequence 128, micro-batch 2; the activations then dominate the step's
transient bytes as they do on a real model (at hidden 64 the logits are ~6% of a block's
activations at no recompute).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MODEL = {"vocab_size": 256, "hidden_size": 64, "num_layers": 4, "num_heads": 8, "num_kv_heads": 2, "seq_len": 128}
MICRO = 2

POLICIES: dict[str, Optional[dict]] = {
    "none": None,
    "selective": {"granularity": "selective"},
    "full": {"granularity": "full"},
}

# name -> (dp, tp, sp, pp, schedule, virtual stages, micro-batches, policy)
ROWS: dict[str, tuple[int, int, bool, int, str, int, int, str]] = {
    "single-none": (1, 1, False, 1, "none", 1, 2, "none"),
    "single-selective": (1, 1, False, 1, "none", 1, 2, "selective"),
    "single-full": (1, 1, False, 1, "none", 1, 2, "full"),
    "tp2sp-none": (1, 2, True, 1, "none", 1, 2, "none"),
    "tp2sp-selective": (1, 2, True, 1, "none", 1, 2, "selective"),
    "tp2sp-full": (1, 2, True, 1, "none", 1, 2, "full"),
    "gpipe-none": (1, 1, False, 2, "gpipe", 1, 4, "none"),
    "1f1b-none": (1, 1, False, 2, "1f1b", 1, 4, "none"),
    "1f1b-selective": (1, 1, False, 2, "1f1b", 1, 4, "selective"),
    "1f1b-full": (1, 1, False, 2, "1f1b", 1, 4, "full"),
    "interleaved-none": (1, 1, False, 2, "interleaved-1f1b", 2, 4, "none"),
    "interleaved-full": (1, 1, False, 2, "interleaved-1f1b", 2, 4, "full"),
    "zb-h1-none": (1, 1, False, 2, "zb-h1", 1, 4, "none"),
    "zb-h1-selective": (1, 1, False, 2, "zb-h1", 1, 4, "selective"),
    "zb-v-none": (1, 1, False, 2, "zb-v", 2, 4, "none"),
    "zb-v-full": (1, 1, False, 2, "zb-v", 2, 4, "full"),
    "dualpipe-v-none": (1, 1, False, 2, "dualpipe-v", 2, 4, "none"),
    "dualpipe-v-selective": (1, 1, False, 2, "dualpipe-v", 2, 4, "selective"),
    "dualpipe-v-full": (1, 1, False, 2, "dualpipe-v", 2, 4, "full"),
    "cp2-ring-none": (1, 1, False, 1, "none", 1, 2, "none"),
    "cp2-ring-selective": (1, 1, False, 1, "none", 1, 2, "selective"),
    "cp2-ring-full": (1, 1, False, 1, "none", 1, 2, "full"),
    "cp2-ulysses-none": (1, 1, False, 1, "none", 1, 2, "none"),
    "cp2-ulysses-full": (1, 1, False, 1, "none", 1, 2, "full"),
    "cp2-ring-1f1b-none": (1, 1, False, 2, "1f1b", 1, 4, "none"),
}

# name -> (context_parallel.size, mode) of the rows with context parallelism (the others: 1, "ring")
ROW_CP: dict[str, tuple[int, str]] = {
    "cp2-ring-none": (2, "ring"),
    "cp2-ring-selective": (2, "ring"),
    "cp2-ring-full": (2, "ring"),
    "cp2-ulysses-none": (2, "ulysses"),
    "cp2-ulysses-full": (2, "ulysses"),
    "cp2-ring-1f1b-none": (2, "ring"),
}


def row_cp(name: str) -> tuple[int, str]:
    """(context_parallel.size, mode) of row ``name``."""
    return ROW_CP.get(name, (1, "ring"))


# The CP term per block (engine.planner.activations.cp_block_bytes_per_token), measured as the
# slope of the activation peak between 2 and 6 layers at CP 2: name -> (row, model overrides, bf16)
CP_SLOPES: dict[str, tuple[str, dict[str, int], bool]] = {
    "ring-kv2-fp32": ("cp2-ring-none", {}, False),
    "ring-kv4-fp32": ("cp2-ring-none", {"num_kv_heads": 4}, False),
    "ring-kv2-bf16": ("cp2-ring-none", {}, True),
    "ulysses-kv2-fp32": ("cp2-ulysses-none", {}, False),
    "ulysses-kv1-fp32": ("cp2-ulysses-none", {"num_kv_heads": 1}, False),
}
SLOPE_LAYERS = (2, 6)


def row_config(name: str) -> dict[str, Any]:
    dp, tp, sp, pp, sched, v, m, policy = ROWS[name]
    pipeline: dict[str, Any] = {"stages": pp, "partition": "blocks"}  # the pieces the planner models
    if pp > 1:
        pipeline["schedule"] = sched
        if v > 1:
            pipeline["virtual_stages"] = v
    cfg: dict[str, Any] = {
        "train_batch_size": MICRO * m * dp, "train_micro_batch_size_per_gpu": MICRO, "seed": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 0},
        "tensor_parallel": {"autotp_size": tp, "sequence_parallel": sp},
        "pipeline": pipeline,
        "model": dict(MODEL),
    }
    cp, mode = row_cp(name)
    if cp > 1:  # CP ranks read the same rows: train_batch_size counts DP replicas only
        cfg["context_parallel"] = {"size": cp, "mode": mode}
    if POLICIES[policy] is not None:
        cfg["activation_checkpointing"] = dict(POLICIES[policy])  # type: ignore[arg-type]
    return cfg


def _measure_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    import engine
    from engine.config import load_config
    from engine.training.memory_probe import memory_probe

    conf = load_config(cfg, world_size=world)
    eng, *_ = engine.initialize(config=conf)
    s, ga = conf.model.seq_len, conf.gradient_accumulation_steps
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, conf.model.vocab_size, (MICRO, s + 1), generator=gen) for _ in range(ga)]
    batches = [(x[:, :-1], x[:, 1:]) for x in ids]
    eng.train_batch(iter(batches))
    with memory_probe(eng, True):
        eng.train_batch(iter(batches))
    out = {"rank": rank, "activation_peak_bytes": eng.activation_peak_bytes}
    eng.destroy()
    return out


def measure(name: str) -> list[dict[str, Any]]:
    from engine.distributed.spawn import spawn

    dp, tp, sp, pp, *_ = ROWS[name]
    return spawn(_measure_rank, dp * tp * pp * row_cp(name)[0], (row_config(name),), timeout=900)


def predict(name: str) -> list[float]:
    """The planner's activation peak per pipeline rank for row ``name``."""
    from engine.models.config import ModelConfig
    from engine.planner.activations import ActivationShape, cp_block_bytes_per_token, inflight_peaks
    from engine.planner.cost import stage_shapes

    dp, tp, sp, pp, sched, v, m, policy = ROWS[name]
    cp, mode = row_cp(name)
    model = ModelConfig(**MODEL)
    a = ActivationShape(MICRO * model.seq_len // cp, tp, sp, 4, policy,
                        cp_block_bytes_per_token(model, cp, cp if mode == "ulysses" else 1, tp, 4))
    pieces = [(s.blocks, s.has_head) for s in stage_shapes(model, pp, v)]
    return inflight_peaks(model, a, sched, pp, m, v, pieces)


def slope_config(name: str, layers: int) -> dict[str, Any]:
    row, over, bf16 = CP_SLOPES[name]
    cfg = row_config(row)
    cfg["model"].update(over, num_layers=layers)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def measure_slope(name: str) -> float:
    """Measured bytes one block adds per local token: the difference of the activation peak
    between SLOPE_LAYERS layers (the max over the ranks) over the blocks and tokens."""
    from engine.distributed.spawn import spawn

    row = CP_SLOPES[name][0]
    cp = row_cp(row)[0]
    peaks = [max(int(r["activation_peak_bytes"]) for r in spawn(_measure_rank, cp, (slope_config(name, n),),
                                                                  timeout=900)) for n in SLOPE_LAYERS]
    lo, hi = SLOPE_LAYERS
    return (peaks[1] - peaks[0]) / (hi - lo) / (MICRO * MODEL["seq_len"] // cp)


def predict_slope(name: str) -> tuple[float, float]:
    """(formula, CP term) per local token and block: the documented block formula
    (engine.models.activation_memory, its per-block constant over the tokens included) plus
    :func:`engine.planner.activations.cp_block_bytes_per_token`."""
    from engine.models.activation_memory import BlockDims, block_saved_bytes
    from engine.models.config import ModelConfig
    from engine.planner.activations import cp_block_bytes_per_token

    row, over, bf16 = CP_SLOPES[name]
    cp, mode = row_cp(row)
    model = ModelConfig(**dict(MODEL, **over))
    elem, tokens = 2 if bf16 else 4, MICRO * model.seq_len // cp
    extra = cp_block_bytes_per_token(model, cp, cp if mode == "ulysses" else 1, 1, elem)
    return block_saved_bytes(BlockDims.of(model), tokens, elem=elem) / tokens + extra, extra


def row_record(name: str, measured: list[dict[str, Any]]) -> dict[str, Any]:
    """One JSON row: the layout, the measured peak of every pipeline rank (the max over its
    TP/CP/DP ranks), the prediction and their ratio."""
    dp, tp, sp, pp, sched, v, m, policy = ROWS[name]
    cp, mode = row_cp(name)
    by_stage: dict[int, int] = {}
    for r in measured:
        k = r["rank"] // (dp * tp * cp)  # TP innermost, then CP, then DP, then PP (engine.topology)
        by_stage[k] = max(by_stage.get(k, 0), int(r["activation_peak_bytes"]))
    meas = [by_stage[k] for k in range(pp)]
    pred = predict(name)
    return {"name": name, "dp": dp, "tp": tp, "sp": sp, "pp": pp, "cp": cp, "cp_mode": mode,
            "schedule": sched, "virtual_stages": v,
            "num_microbatches": m, "micro_batch": MICRO, "policy": policy, "measured": meas,
            "predicted": [round(x) for x in pred], "ratio": [round(p / q, 4) for p, q in zip(pred, meas)]}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--out", default=None, help="write the rows as JSON")
    ap.add_argument("--slopes", nargs="*", default=list(CP_SLOPES), choices=list(CP_SLOPES),
                    help="the CP per-block slopes to measure (default all; none: --slopes)")
    args = ap.parse_args(argv)
    rows = []
    print("| row | policy | schedule | CP | measured MB per pipeline rank | predicted MB | predicted/measured |")
    print("|---|---|---|---|---|---|---|")
    for name in args.rows:
        r = row_record(name, measure(name))
        rows.append(r)
        cp_col = f"{r['cp']} {r['cp_mode']}" if r["cp"] > 1 else "-"
        print(f"| {name} | {r['policy']} | {r['schedule']} | {cp_col} | {' '.join(f'{x / 2**20:.3f}' for x in r['measured'])} | "
              f"{' '.join(f'{x / 2**20:.3f}' for x in r['predicted'])} | {' '.join(f'{x:.3f}' for x in r['ratio'])} |",
              flush=True)
    slopes = []
    if args.slopes:
        print("\n| CP slope | measured B/token/block | formula + CP term | CP term |\n|---|---|---|---|")
    for name in args.slopes:
        meas = measure_slope(name)
        pred, extra = predict_slope(name)
        slopes.append({"name": name, "measured": meas, "predicted": round(pred, 3), "cp_term": extra})
        print(f"| {name} | {meas:.1f} | {pred:.1f} | {extra:+.0f} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": MODEL, "micro_batch": MICRO, "dtype": "float32", "device": "cpu (gloo ranks)",
                       "rows": rows, "cp_slopes": slopes}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
