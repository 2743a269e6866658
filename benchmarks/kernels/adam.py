"""Benchmark: engine FusedAdamW vs torch AdamW (for-loop, foreach, fused=True) and DeepSpeed's CPU Adam.

    python benchmarks/kernels/adam.py                      # CPU, all cores
    python benchmarks/kernels/adam.py --device cuda        # GPU (DeepSpeed CPU Adam skipped)

1. Validates: FusedAdamW against torch.optim.AdamW for 20 steps (rtol/atol 1e-6); exits 1
   if it does not match, before timing anything.
2. Measures this machine's memory bandwidth with a large tensor copy (read + write bytes
   / time).
3. Times one optimizer step of every variant, interleaved round-robin so machine load
   hits all variants alike; reports the median, the speed-up over torch fused=True and the
   effective bandwidth: an AdamW step must move 28 bytes per element (read p, g, m, v;
   write p, m, v; +2 with the bf16 copy), over time, as a % of the copy bandwidth.

Targets (issue 8): on CPU FusedAdamW at least as fast as torch fused=True; on an H200
>= 80% of the copy bandwidth. Only ratios within one run are meaningful.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import bandwidth_table, copy_probe, time_interleaved  # noqa: E402
from engine.ops.adam import fused_adamw_available  # noqa: E402
from engine.optim import FusedAdamW  # noqa: E402

BYTES_PER_ELEMENT = 28  # read p, g, m, v (16) + write p, m, v (12), fp32


def make_params(shapes, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device).requires_grad_() for s in shapes]


def validate(device: torch.device) -> None:
    shapes = [(7,), (33, 65), (1000, 33), (70000,)]
    a, b = make_params(shapes, device), make_params(shapes, device)
    oa, ob = torch.optim.AdamW(a, lr=1e-2, weight_decay=0.1), FusedAdamW(b, lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        for pa, pb in zip(a, b):
            g = torch.randn(pa.shape, generator=gen).to(device)
            pa.grad, pb.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pb, pa, rtol=1e-6, atol=1e-6)


def build_variants(shapes, device, with_deepspeed: bool):
    """name -> (step function, bytes per element it must move)."""
    variants = {}

    def add(name, opt, extra=0):
        params = opt.param_groups[0]["params"]
        for p in params:
            p.grad = torch.randn_like(p)
        variants[name] = (opt.step, BYTES_PER_ELEMENT + extra)

    add("torch for-loop", torch.optim.AdamW(make_params(shapes, device), foreach=False))
    add("torch foreach", torch.optim.AdamW(make_params(shapes, device), foreach=True))
    add("torch fused=True", torch.optim.AdamW(make_params(shapes, device), fused=True))
    add("engine FusedAdamW", FusedAdamW(make_params(shapes, device)))
    copy_opt = FusedAdamW(make_params(shapes, device))
    for p in copy_opt.param_groups[0]["params"]:
        copy_opt.attach_param_copy(p, torch.empty_like(p, dtype=torch.bfloat16))
    add("engine FusedAdamW +bf16 copy", copy_opt, extra=2)
    if with_deepspeed and device.type == "cpu":
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            add("deepspeed DeepSpeedCPUAdam", DeepSpeedCPUAdam(make_params(shapes, device), adamw_mode=True))
        except Exception as exc:  # noqa: BLE001 - not installed or its JIT build failed
            print(f"(deepspeed CPU Adam unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:100]})")
    return variants


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not fused_adamw_available(device):
        print(f"the fused AdamW kernel is not available on {device}; see `python -m engine.ops`")
        return 1
    try:
        validate(device)
    except AssertionError as exc:
        print(f"VALIDATION FAILED: FusedAdamW != torch.optim.AdamW\n{exc}")
        return 1
    print(f"validated: FusedAdamW == torch.optim.AdamW over 20 steps (rtol=atol=1e-6) on {device}")
    print(f"torch threads: {torch.get_num_threads()}, engine cpu kernel: {torch.ops.engine_adam.cpu_isa()}")
    cases = {"1 x 16M": [(1 << 24,)], "64 x 256K": [(1 << 18,)] * 64, "400 x 4K (many small)": [(4096,)] * 400}
    if device.type == "cuda":
        cases = {"1 x 256M": [(1 << 28,)], "64 x 4M": [(1 << 22,)] * 64, "400 x 64K (many small)": [(1 << 16,)] * 400}
    results = {"device": str(device), "threads": torch.get_num_threads(), "cases": {}}
    copy_fn, copy_bytes = copy_probe(device)
    ok = True
    for case, shapes in cases.items():
        numel = sum(s[0] for s in shapes)
        variants = build_variants(shapes, device, not args.no_deepspeed)
        timed = {name: fn for name, (fn, _) in variants.items()}
        timed["memory copy (bandwidth probe)"] = copy_fn
        med = time_interleaved(timed, device, args.reps)
        bw = copy_bytes / med.pop("memory copy (bandwidth probe)")
        print(f"\n{case} ({numel / 1e6:.1f}M elements); copy bandwidth in this run: {bw / 1e9:.1f} GB/s")
        rows = bandwidth_table(med, bw, lambda name, variants=variants, numel=numel: variants[name][1] * numel, lambda name: "torch fused=True",
                               "speedup_vs_torch_fused")
        results["cases"][case] = {"copy_GBps": bw / 1e9, "variants": rows}
        mine = rows["engine FusedAdamW"]
        target = mine["pct_copy_bw"] >= 80 if device.type == "cuda" else mine["speedup_vs_torch_fused"] >= 1.0
        ok &= target
        goal = ">= 80% of copy bandwidth" if device.type == "cuda" else "at least as fast as torch fused=True"
        print(f"  target ({goal}): {'met' if target else 'NOT met'}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
