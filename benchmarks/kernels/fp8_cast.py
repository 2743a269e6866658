"""Benchmark: the fused FP8 cast (one pass: amax + scale + saturate + round [+ transpose])
against torch's unfused sequence.

    python benchmarks/kernels/fp8_cast.py                  # CPU, all cores
    python benchmarks/kernels/fp8_cast.py --device cuda

1. Validates: the kernel's bytes and amax equal the reference (engine/ops/fp8.py) on the
   benchmark inputs with NaN/inf/subnormals planted; exits 1 otherwise, before timing.
2. Measures memory bandwidth with a large tensor copy (read + write bytes / time).
3. Times, interleaved round-robin (machine load hits all variants alike), the median of:
   torch unfused  amax = x.abs().max(); out = (x * scale).clamp(-MAX, MAX).to(fp8)
   torch unfused + transpose (.t().contiguous() of the FP8 result)
   engine fused, and engine fused with the transposed output.
   Effective bandwidth = minimal bytes (read x once, write out [and out_t]) / time.

Targets (issue 8): on CPU the fused cast >= 4x faster than the unfused torch sequence; on
an H200 >= 80% of the copy bandwidth. Only ratios within one run are meaningful.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import bandwidth_table, copy_probe, time_interleaved  # noqa: E402
from engine.ops.fp8 import fp8_cast_kernel, fp8_cast_reference, fp8_kernel_available, fp8_max  # noqa: E402

FP8 = torch.float8_e4m3fn


def torch_unfused(x: torch.Tensor, scale: torch.Tensor, transpose: bool):
    m = fp8_max(FP8)
    amax = x.abs().max()
    out = (x.float() * scale).clamp(-m, m).to(FP8)
    if transpose:
        return out, amax, out.t().contiguous()
    return out, amax


def validate(x: torch.Tensor, scale: torch.Tensor) -> None:
    y = x.clone()
    y.view(-1)[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, 1e6, -0.0], dtype=x.dtype)
    for inp in (x, y):
        got = fp8_cast_kernel(inp, scale, FP8, transpose=True)
        ref = fp8_cast_reference(inp, scale, FP8, transpose=True)
        for a, b in ((got[0], ref[0]), (got[2], ref[2])):
            if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                raise AssertionError("fused FP8 bytes differ from the reference")
        if not (torch.equal(got[1], ref[1].float()) or (got[1].isnan() and ref[1].isnan())):
            raise AssertionError(f"amax {got[1].item()} != reference {ref[1].item()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not fp8_kernel_available(device):
        print(f"the fused FP8 cast is not available on {device}; see `python -m engine.ops`")
        return 1
    shapes = [(4096, 4096), (8192, 2048)] if device.type == "cpu" else [(16384, 16384), (8192, 28672)]
    gen = torch.Generator().manual_seed(0)
    print(f"torch threads: {torch.get_num_threads()}, engine cpu kernel: {torch.ops.engine_fp8.cpu_isa()}")
    copy_fn, copy_bytes = copy_probe(device)
    results = {"device": str(device), "threads": torch.get_num_threads(), "cases": {}}
    ok = True
    for shape in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(shape, generator=gen) * 3).to(dtype).to(device)
            scale = torch.tensor(20.0, device=device)
            try:
                validate(x, scale)
            except AssertionError as exc:
                print(f"VALIDATION FAILED for {shape} {dtype}: {exc}")
                return 1
            variants = {
                "torch unfused": lambda x=x, scale=scale: torch_unfused(x, scale, False),
                "engine fused": lambda x=x, scale=scale: fp8_cast_kernel(x, scale, FP8),
                "torch unfused + transpose": lambda x=x, scale=scale: torch_unfused(x, scale, True),
                "engine fused + transpose": lambda x=x, scale=scale: fp8_cast_kernel(x, scale, FP8, transpose=True),
                "memory copy (bandwidth probe)": copy_fn,
            }
            med = time_interleaved(variants, device, args.reps, warmup=1)
            bw = copy_bytes / med.pop("memory copy (bandwidth probe)")
            n = x.numel()
            case = f"{shape[0]}x{shape[1]} {str(dtype).replace('torch.', '')}"
            print(f"\n{case} -> e4m3 (validated bit-identical to the reference); "
                  f"copy bandwidth in this run: {bw / 1e9:.1f} GB/s")
            # read x, write the e4m3 output (+ its transpose)
            rows = bandwidth_table(
                med, bw, lambda name, n=n, x=x: n * (x.element_size() + (2 if "transpose" in name else 1)),
                lambda name: "torch unfused + transpose" if "transpose" in name else "torch unfused",
                "speedup_vs_torch", width=28)
            results["cases"][case] = {"copy_GBps": bw / 1e9, "variants": rows}
            fused = rows["engine fused"]
            target = fused["pct_copy_bw"] >= 80 if device.type == "cuda" else fused["speedup_vs_torch"] >= 4.0
            ok &= target
            goal = ">= 80% of copy bandwidth" if device.type == "cuda" else ">= 4x faster than torch unfused"
            print(f"  target ({goal}): {'met' if target else 'NOT met'}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
