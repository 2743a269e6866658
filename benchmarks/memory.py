#!/usr/bin/env python
"""Per-rank memory of ZeRO stages 0-3 at several data-parallel sizes, measured against the
ZeRO paper's formula, as a table, JSON and a PNG bar chart.

    python benchmarks/memory.py --params 20e6 --dp 1 2 4 --json benchmarks/results/memory.json --png memory.png
    python benchmarks/memory.py --params 50e6 --dp 2 --dtype fp32 --stages 3

For each (DP size, stage) it starts ``dp`` fresh ranks on gloo (CPU), builds an MLP of about
``--params`` parameters in the compute dtype, runs ``--steps`` optimizer steps and reports
what each rank holds (``ZeroOptimizer.memory_bytes()``: parameters, gradients, optimizer
state, counted from the optimizer's own tensors) next to the formula
(engine.zero.memory.zero_memory_formula: compute-dtype parameters, fp32 gradients, fp32
master + Adam moments = 12 bytes; our stage 1 also holds a 4 Psi / N_d master-gradient
shard, shown as "+shard"), and the process's peak RSS. Fresh processes per case keep the
peak RSS clean (it is a process-wide high-water mark: interpreter + torch + this case).

The PNG (matplotlib when installed, else a plain raster by engine.pipeline.timeline's PNG
writer: stacked bars without text) shows per case the measured params / grads / optimizer
bars with the formula's total as a marker.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the gloo multi-rank harness

from harness import run_ranks  # noqa: E402

from engine.precision.mixed import PrecisionPolicy  # noqa: E402
from engine.zero import build_zero_optimizer  # noqa: E402
from engine.zero.memory import memory_report, zero_memory_formula  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KINDS = ("params", "grads", "optimizer_state")
MiB = float(2 ** 20)


def _model(num_params: float, dtype: torch.dtype) -> nn.Module:
    """Square Linear layers of width 1024..4096 adding up to about ``num_params``."""
    width = 1024 if num_params < 20e6 else 2048 if num_params < 200e6 else 4096
    layers = max(1, round(num_params / (width * width + width)))
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.data.uniform_(-0.02, 0.02, generator=gen)
    return model.to(dtype)


def _rank(rank: int, world: int, num_params: float, dtype_name: str, stage: int, steps: int) -> dict:
    dtype = DTYPES[dtype_name]
    model = _model(num_params, dtype)
    numel = sum(p.numel() for p in model.parameters())
    opt = build_zero_optimizer(stage, model, lambda g: torch.optim.AdamW(g, lr=1e-4), None,
                               precision=PrecisionPolicy(compute_dtype=dtype, check_nonfinite=False))
    width = model[0].in_features
    t0 = time.perf_counter()
    for _ in range(steps):
        x = torch.randn(4, width).to(dtype)
        opt.backward(model(x).float().pow(2).mean())
        opt.step()
    elapsed = time.perf_counter() - t0
    rep = memory_report(opt, torch.device("cpu"))
    rep.update(numel=numel, step_s=elapsed / steps)
    opt.remove_hooks()
    del model, opt
    gc.collect()
    return rep


def formula(numel: int, stage: int, dp: int, dtype_name: str) -> dict[str, float]:
    """The ZeRO formula with our byte counts, plus our stage 1's master-gradient shard."""
    pb = torch.finfo(DTYPES[dtype_name]).bits // 8
    f = zero_memory_formula(numel, stage, dp, param_bytes=pb, grad_bytes=4, optimizer_bytes=12)
    f["grads_shard"] = 4.0 * numel / dp if stage == 1 else 0.0
    return f


def measure(dps: list[int], stages: list[int], num_params: float, dtype_name: str, steps: int) -> list[dict]:
    """One row per (dp, stage): rank 0's bytes, the spread over ranks, the formula."""
    rows = []
    for dp in dps:
        for stage in stages:
            ranks = run_ranks(_rank, dp, num_params, dtype_name, stage, steps, timeout=1800)
            r = ranks[0]
            f = formula(r["numel"], stage, dp, dtype_name)
            rows.append({
                "dp": dp, "stage": stage, "numel": r["numel"], "dtype": dtype_name,
                "measured": {k: r[k] for k in KINDS}, "formula": {k: f[k] for k in KINDS},
                "formula_grads_shard": f["grads_shard"],
                "peak_rss": [x["peak"] for x in ranks], "step_s": r["step_s"],
                "spread": {k: max(x[k] for x in ranks) - min(x[k] for x in ranks) for k in KINDS},
            })
            print(f"  dp={dp} stage={stage}: {sum(r[k] for k in KINDS) / MiB:.1f} MiB accounted, "
                  f"peak RSS {r['peak'] / MiB:.0f} MiB", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: measured / formula per kind, in MiB."""
    head = ("| DP | stage | params MiB (meas / formula) | grads MiB | optimizer MiB | total MiB | "
            "peak RSS MiB (max rank) | step s |")
    out = [head, "|" + "---|" * 8]
    for r in rows:
        m, f = r["measured"], r["formula"]
        cells = [f"{m[k] / MiB:.1f} / {f[k] / MiB:.1f}" for k in KINDS]
        if r["formula_grads_shard"]:
            cells[1] += f" +shard {r['formula_grads_shard'] / MiB:.1f}"
        tot_m = sum(m.values())
        tot_f = sum(f.values()) + r["formula_grads_shard"]
        out.append(f"| {r['dp']} | {r['stage']} | " + " | ".join(cells)
                   + f" | {tot_m / MiB:.1f} / {tot_f / MiB:.1f} | {max(r['peak_rss']) / MiB:.0f} | {r['step_s']:.2f} |")
    return "\n".join(out)


# ------------------------------------------------------------------ the chart
_COLOURS = {"params": (66, 133, 244), "grads": (52, 168, 83), "optimizer_state": (251, 188, 5)}


def write_chart(rows: list[dict], path: str, title: str) -> str:
    """Stacked bars per (dp, stage); returns "matplotlib" or "raw"."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _raw_chart(rows, path)
        return "raw"
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(rows) + 2), 4.5))
    xs = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for k in KINDS:
        vals = [r["measured"][k] / MiB for r in rows]
        ax.bar(xs, vals, bottom=bottom, color=[tuple(c / 255 for c in _COLOURS[k])], label=f"measured {k}")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ftot = [(sum(r["formula"].values()) + r["formula_grads_shard"]) / MiB for r in rows]
    ax.scatter(xs, ftot, marker="_", s=400, color="black", zorder=3, label="formula total")
    ax.set_xticks(xs, [f"dp{r['dp']}\nZ{r['stage']}" for r in rows])
    ax.set_ylabel("MiB per rank")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return "matplotlib"


def _raw_chart(rows: list[dict], path: str, height: int = 300, bar: int = 30, gap: int = 14) -> None:
    from engine.pipeline.timeline import write_png

    top = max(sum(r["measured"].values()) for r in rows) or 1.0
    width = len(rows) * (bar + gap) + gap
    white = (255, 255, 255)
    pixels = [[white] * width for _ in range(height)]
    for i, r in enumerate(rows):
        x0 = gap + i * (bar + gap)
        y = height
        for k in KINDS:
            h = int(round(r["measured"][k] / top * (height - 10)))
            for row in range(max(y - h, 0), y):
                for x in range(x0, x0 + bar):
                    pixels[row][x] = _COLOURS[k]
            y -= h
        ft = int(round((sum(r["formula"].values()) + r["formula_grads_shard"]) / top * (height - 10)))
        row = min(max(height - ft, 0), height - 1)
        for x in range(x0 - 4, x0 + bar + 4):
            pixels[row][x] = (0, 0, 0)
    write_png(path, pixels)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--params", type=float, default=20e6, help="approximate parameter count")
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4], help="data-parallel sizes (processes)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="compute dtype")
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--json", help="write the rows (bytes) here")
    ap.add_argument("--png", help="write the bar chart here")
    args = ap.parse_args(argv)
    if any(d < 1 for d in args.dp) or any(s not in (0, 1, 2, 3) for s in args.stages) or args.steps < 1:
        ap.error("--dp must be >= 1, --stages among 0-3, --steps >= 1")
    rows = measure(args.dp, args.stages, args.params, args.dtype, args.steps)
    print(f"per-rank memory, {args.dtype} compute, fp32 grads / master / Adam, {rows[0]['numel']:,} parameters "
          "(measured on rank 0 / ZeRO formula)\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=1)
    if args.png:
        how = write_chart(rows, args.png, f"ZeRO memory per rank, {rows[0]['numel'] / 1e6:.0f}M params, {args.dtype}")
        print(f"\nchart: {args.png} ({how})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
