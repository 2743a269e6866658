#!/usr/bin/env python
"""Muon vs AdamW: optimizer-step time and Newton-Schulz time per rank at DP = 1, 2, 4,
optimizer-state memory per rank, and a short loss-curve comparison on the default model.

    python benchmarks/muon.py --dp 1 2 4 --curve-steps 100 --out benchmarks/results

1. Step time (ZeRO-1, fp32 weights, bf16 Newton-Schulz as torch): the reference GPT of
   ``--hidden`` / ``--layers`` at (dp, 1, 1) on gloo ranks; after a warm-up step, the
   inner optimizer's ``step()`` alone (gradients already reduced; the time of the ZeRO
   reduce and publish is the same for both optimizers) is timed ``--reps`` times, Muon and
   AdamW interleaved in the same processes, medians of the slowest rank. Reported with
   each rank's Newton-Schulz calls, wall and CPU milliseconds per step (the owner split
   should make them fall ~1/DP; with more ranks than cores the wall time of a rank grows
   with the sharing, the CPU time does not) and the elements Muon's gather/scatter sends.
   ``--ns-dtype float32``: Newton-Schulz in fp32 (on CPU much faster than bf16 matmuls).
2. Memory: ``ZeroOptimizer.memory_bytes()["optimizer_state"]`` per rank (fp32 master +
   moments), Muon vs AdamW; expected difference 4 B per Muon-matrix element / DP.
3. Loss curve: the default model (configs/default.json's model section) on the embedded
   corpus at (1,1,1), the same tokens and schedule, AdamW (the config's) vs Muon with
   ``adjust_lr_fn="match_rms_adamw"`` and AdamW's lr and weight decay (Moonlight's recipe:
   no retuning). Written as CSV and a PNG (matplotlib if installed, else a plain raster:
   Muon red, AdamW blue, loss on the vertical axis).

Timings on a shared CPU machine are noisy: compare within one run, as ratios.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the gloo multi-rank harness

from harness import run_ranks  # noqa: E402

MiB = 1 << 20


def _config(opt: str, dp: int, hidden: int, layers: int, vocab: int, seq: int, ns_dtype: str) -> dict:
    optim = ({"type": "Muon", "params": {"lr": 1e-3, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw",
                                         "ns_dtype": ns_dtype}}
             if opt == "Muon" else {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}})
    return {"train_batch_size": 2 * dp, "train_micro_batch_size_per_gpu": 2, "seed": 1,
            "optimizer": optim, "zero_optimization": {"stage": 1},
            "model": {"vocab_size": vocab, "hidden_size": hidden, "num_layers": layers,
                      "num_heads": max(1, hidden // 64), "seq_len": seq}}


def _step_rank(rank: int, world: int, hidden: int, layers: int, vocab: int, seq: int, reps: int,
               ns_dtype: str) -> dict:
    import engine

    engines = {}
    for opt in ("AdamW", "Muon"):
        eng, *_ = engine.initialize(config=_config(opt, world, hidden, layers, vocab, seq, ns_dtype))
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, vocab, (2, seq + 1), generator=g, device="cpu")  # host batch: the engine moves it
        eng.train_batch(iter([(ids[:, :-1], ids[:, 1:])]))  # warm-up, and state allocated
        engines[opt] = eng
    times: dict[str, list[float]] = {"AdamW": [], "Muon": []}
    inner = engines["Muon"].optimizer.optimizer
    ns0, cpu0, calls0, comm0 = inner.ns_seconds, inner.ns_cpu_seconds, inner.ns_calls, inner.comm_elements
    for _ in range(reps):
        for opt, eng in engines.items():
            dist.barrier()
            t0 = time.perf_counter()
            eng.optimizer.optimizer.step()
            dt = torch.tensor([time.perf_counter() - t0], device=eng.device)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's
            times[opt].append(dt.item())
    mem = {opt: eng.optimizer.memory_bytes()["optimizer_state"] for opt, eng in engines.items()}
    muon_numel = sum(m.local_shape[0] * m.local_shape[1] for m in inner.matrices)
    return {"median_s": {k: statistics.median(v) for k, v in times.items()},
            "ns_s_per_step": (inner.ns_seconds - ns0) / reps, "ns_cpu_s_per_step": (inner.ns_cpu_seconds - cpu0) / reps,
            "ns_calls_per_step": (inner.ns_calls - calls0) / reps,
            "comm_elements_per_step": (inner.comm_elements - comm0) / reps, "state_bytes": mem,
            "muon_numel": muon_numel, "matrices": len(inner.matrices)}


def step_table(dps: list[int], args: argparse.Namespace) -> list[dict]:
    rows = []
    for dp in dps:
        ranks = run_ranks(_step_rank, dp, args.hidden, args.layers, args.vocab, args.seq, args.reps, args.ns_dtype,
                          timeout=3600)
        r0 = ranks[0]
        rows.append({"dp": dp, "adamw_step_ms": 1e3 * r0["median_s"]["AdamW"],
                     "muon_step_ms": 1e3 * r0["median_s"]["Muon"],
                     "ns_ms_per_rank": [round(1e3 * r["ns_s_per_step"], 2) for r in ranks],
                     "ns_cpu_ms_per_rank": [round(1e3 * r["ns_cpu_s_per_step"], 2) for r in ranks],
                     "ns_calls_per_rank": [r["ns_calls_per_step"] for r in ranks],
                     "comm_MiB_per_rank": round(r0["comm_elements_per_step"] * 4 / MiB, 2),
                     "adamw_state_MiB": round(r0["state_bytes"]["AdamW"] / MiB, 2),
                     "muon_state_MiB": round(r0["state_bytes"]["Muon"] / MiB, 2),
                     "expected_saving_MiB": round(4 * r0["muon_numel"] / dp / MiB, 2),
                     "matrices": r0["matrices"]})
        print(f"  dp={dp}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def _curve_rank(rank: int, world: int, steps: int, opt: str) -> list[float]:
    import engine
    from engine.config import load_config
    from engine.training.trainer import build_data, train

    with open(os.path.join(ROOT, "configs", "default.json")) as f:
        raw = json.load(f)
    cfg = copy.deepcopy(raw)
    cfg["tensor_parallel"] = {"autotp_size": 1}
    cfg["pipeline"] = {"stages": 1}
    cfg["scheduler"]["params"]["total_num_steps"] = steps
    cfg["scheduler"]["params"]["warmup_num_steps"] = max(1, min(10, steps // 5))
    if opt == "Muon":
        p = cfg["optimizer"]["params"]
        cfg["optimizer"] = {"type": "Muon", "params": {"lr": p["lr"], "weight_decay": p["weight_decay"],
                                                       "betas": p["betas"], "eps": p["eps"],
                                                       "adjust_lr_fn": "match_rms_adamw"}}
    c = load_config(cfg, world_size=world)
    _, sampler = build_data(c)
    eng, *_ = engine.initialize(config=c)
    return [r["loss"] for r in train(eng, sampler, steps, output_dir=None)]


def _png(path: str, curves: dict[str, list[float]]) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, ys in curves.items():
            ax.plot(range(1, len(ys) + 1), ys, label=name)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.legend()
        fig.savefig(path, dpi=120)
        return "matplotlib"
    except ImportError:
        from engine.pipeline.timeline import write_png

        w, h, pad = 800, 400, 20
        px = [[(255, 255, 255)] * w for _ in range(h)]
        lo = min(min(v) for v in curves.values())
        hi = max(max(v) for v in curves.values())
        for x in range(pad, w - pad):
            px[h - pad][x] = px[pad][x] = (0, 0, 0)
        for y in range(pad, h - pad + 1):
            px[y][pad] = px[y][w - pad] = (0, 0, 0)
        colours = {"Muon": (220, 30, 30), "AdamW": (30, 60, 220)}
        for name, ys in curves.items():
            n = len(ys)
            for i in range(n - 1):
                for t in range(21):  # segments drawn as dots
                    f = i + t / 20
                    v = ys[i] + (ys[i + 1] - ys[i]) * t / 20
                    x = pad + int((w - 2 * pad) * f / max(1, n - 1))
                    y = h - pad - int((h - 2 * pad) * (v - lo) / max(1e-9, hi - lo))
                    for dy in (-1, 0, 1):
                        if 0 <= y + dy < h:
                            px[y + dy][x] = colours.get(name, (0, 0, 0))
        write_png(path, px)
        return "plain raster (matplotlib is not installed): Muon red, AdamW blue, loss vs step"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ns-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--curve-steps", type=int, default=100)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--tag", default=time.strftime("%Y-%m-%d"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = step_table(args.dp, args) if args.dp else []
    curves = {}
    if args.curve_steps:
        for opt in ("AdamW", "Muon"):
            curves[opt] = run_ranks(_curve_rank, 1, args.curve_steps, opt, timeout=7200)[0]
            print(f"  {opt}: loss {curves[opt][0]:.3f} -> {curves[opt][-1]:.3f}", file=sys.stderr, flush=True)
    base = os.path.join(args.out, f"muon_{args.tag}")
    with open(base + ".json", "w") as f:
        json.dump({"args": vars(args), "steps": rows, "curves": curves}, f, indent=1)
    plot = None
    if curves:
        with open(base + "_curve.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step"] + list(curves))
            for i in range(args.curve_steps):
                w.writerow([i + 1] + [f"{curves[k][i]:.5f}" for k in curves])
        plot = _png(base + "_curve.png", curves)
    print(json.dumps({"steps": rows, "final_loss": {k: v[-1] for k, v in curves.items()}, "plot": plot}, indent=1))


if __name__ == "__main__":
    main()
