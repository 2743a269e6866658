"""Per-rank memory of ZeRO stages 0-3, measured against the ZeRO paper's formula.

Spawns ``--dp`` ranks on gloo (CPU) and, for each stage, builds an MLP of about
``--params`` parameters in the compute dtype, runs ``--steps`` optimizer steps and reports
what each rank holds afterwards (``ZeroOptimizer.memory_bytes()``: parameters, gradients,
optimizer state, counted from the optimizer's own tensors) next to the formula
(engine.zero.memory.zero_memory_formula), plus the peak RSS of the process.

    python benchmarks/memory.py --params 20e6 --dp 4
    python benchmarks/memory.py --params 50e6 --dp 2 --dtype fp32 --json benchmarks/results/memory.json

Peak RSS is a process-wide high-water mark (it includes the interpreter, torch and every
earlier stage of the same run), so compare stages by their accounted bytes; run one stage
per invocation (``--stages 3``) for a clean peak.
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


def _rank(rank: int, world: int, num_params: float, dtype_name: str, stages: list[int], steps: int) -> dict:
    dtype = DTYPES[dtype_name]
    out = {}
    for stage in stages:
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
        out[stage] = rep
        opt.remove_hooks()
        del model, opt
        gc.collect()
    return out


def _table(results: list[dict], dp: int, dtype_name: str) -> str:
    mib = 1 / 2 ** 20
    pb = torch.finfo(DTYPES[dtype_name]).bits // 8
    head = (f"{'stage':>5} | {'params MiB':>21} | {'grads MiB':>21} | {'optim MiB':>21} | "
            f"{'total MiB':>21} | {'peak RSS MiB':>12} | {'step s':>6}")
    lines = [f"per-rank memory at DP={dp}, {dtype_name} compute, fp32 grads/master/Adam "
             f"(measured / ZeRO formula, rank 0; ranks max-min spread shown if any)", head, "-" * len(head)]
    for stage in sorted(results[0]):
        r = results[0][stage]
        f = zero_memory_formula(r["numel"], stage, dp, param_bytes=pb, grad_bytes=4, optimizer_bytes=12)
        cells = []
        for k in ("params", "grads", "optimizer_state"):
            cells.append(f"{r[k] * mib:9.1f} / {f[k] * mib:9.1f}")
        tot = sum(r[k] for k in ("params", "grads", "optimizer_state"))
        ftot = sum(f.values())
        cells.append(f"{tot * mib:9.1f} / {ftot * mib:9.1f}")
        spread = max(x[stage]["optimizer_state"] for x in results) - min(x[stage]["optimizer_state"] for x in results)
        note = f"  (optim spread {spread * mib:.2f} MiB)" if spread else ""
        lines.append(f"{stage:>5} | " + " | ".join(cells) + f" | {r['peak'] * mib:12.0f} | {r['step_s']:6.2f}{note}")
    lines.append(f"parameters: {results[0][min(results[0])]['numel']:,}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=20e6, help="approximate parameter count")
    ap.add_argument("--dp", type=int, default=4, help="data-parallel ranks (processes)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="compute dtype")
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--json", help="also write the raw per-rank numbers here")
    args = ap.parse_args()
    results = run_ranks(_rank, args.dp, args.params, args.dtype, args.stages, args.steps, timeout=1800)
    print(_table(results, args.dp, args.dtype))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "ranks": results}, fh, indent=1)


if __name__ == "__main__":
    main()
