"""Benchmark: the CPU Adam that ZeRO-Offload steps with (engine FusedAdamW = DeepSpeedCPUAdam's
name in engine.compat.deepspeed.ops.adam, csrc/adam) vs DeepSpeed's DeepSpeedCPUAdam vs
torch's CPU AdamW, on the same buffers (10M-100M fp32 elements), all cores.

    python benchmarks/kernels/cpu_adam.py                         # 10M, 30M, 100M; 7 reps
    python benchmarks/kernels/cpu_adam.py --sizes 10 --reps 5     # millions of elements
    python benchmarks/kernels/cpu_adam.py --out benchmarks/results/cpu_adam_<machine>_<date>.md

1. Validates first (exits 1 on a mismatch, before timing): 10 AdamW steps of ours against
   torch.optim.AdamW (rtol/atol 1e-6) and against DeepSpeedCPUAdam (rtol/atol 1e-5: its
   AVX kernel orders the bias correction differently) on 100k elements.
2. Each size: one flat fp32 parameter of N elements with its gradient; every optimizer
   starts from the same values (its own copies: each updates its buffers in place) and
   steps them; the steps are timed round-robin (machine load hits all alike) after two
   warm-up steps, and the median of ``--reps`` is reported with the bandwidth an AdamW step
   must move (28 bytes per element: read p, g, m, v; write p, m, v).
3. Ends with ``ours / DeepSpeedCPUAdam: R×`` (the smallest speed-up over the sizes: the
   issue's bar is >= 1.0 at every size). If DeepSpeed's cpu_adam op cannot be built or
   loaded here, prints exactly why and ``ours / DeepSpeedCPUAdam: unavailable``.

Only ratios within one run mean anything: the machine may be shared (note it with the results).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import time_interleaved  # noqa: E402
from engine.ops.adam import fused_adamw_available  # noqa: E402
from engine.optim import FusedAdamW  # noqa: E402

BYTES_PER_ELEMENT = 28
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def deepspeed_cpu_adam() -> tuple[Optional[type], str]:
    """(DeepSpeedCPUAdam, "") or (None, why it cannot run here)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load()  # JIT-builds once into ~/.cache/torch_extensions (minutes)
        return DeepSpeedCPUAdam, ""
    except Exception as exc:  # noqa: BLE001 - not installed, no compiler, or its build failed
        return None, f"{type(exc).__name__}: {exc}"


def _param(values: torch.Tensor, grad: torch.Tensor) -> torch.nn.Parameter:
    p = torch.nn.Parameter(values.clone())
    p.grad = grad.clone()
    return p


def make_optimizers(values: torch.Tensor, grad: torch.Tensor, ds: Optional[type]) -> dict[str, torch.optim.Optimizer]:
    opts: dict[str, torch.optim.Optimizer] = {
        "ours (engine FusedAdamW)": FusedAdamW([_param(values, grad)], **HP),
        "torch AdamW (foreach)": torch.optim.AdamW([_param(values, grad)], foreach=True, **HP),
        "torch AdamW (fused=True)": torch.optim.AdamW([_param(values, grad)], fused=True, **HP),
    }
    if ds is not None:
        opts["DeepSpeedCPUAdam"] = ds([_param(values, grad)], adamw_mode=True, **HP)
    return opts


def validate(ds: Optional[type]) -> str:
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(100_000, generator=gen)
    opts = make_optimizers(values, torch.zeros_like(values), ds)
    for _ in range(10):
        g = torch.randn(values.shape, generator=gen)
        for o in opts.values():
            o.param_groups[0]["params"][0].grad.copy_(g)
            o.step()
    ours = opts["ours (engine FusedAdamW)"].param_groups[0]["params"][0].detach()
    ref = opts["torch AdamW (foreach)"].param_groups[0]["params"][0].detach()
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    msg = "validated: ours == torch.optim.AdamW over 10 steps (rtol=atol=1e-6)"
    if ds is not None:
        theirs = opts["DeepSpeedCPUAdam"].param_groups[0]["params"][0].detach()
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        msg += f"; == DeepSpeedCPUAdam (rtol=atol=1e-5, max |diff| {float((ours - theirs).abs().max()):.2e})"
    return msg


def time_size(n: int, ds: Optional[type], reps: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(n)
    values = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen) * 1e-2
    opts = make_optimizers(values, grad, ds)
    del values, grad
    steps: dict[str, Callable[[], object]] = {name: o.step for name, o in opts.items()}
    return time_interleaved(steps, torch.device("cpu"), reps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[10, 30, 100], help="millions of elements")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None, help="also write the printed report here (markdown)")
    args = ap.parse_args()
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    if not fused_adamw_available("cpu"):
        say("the engine's fused AdamW kernel is not available here; see `python -m engine.ops`")
        return 1
    ds, why = deepspeed_cpu_adam()
    if ds is None:
        say(f"DeepSpeedCPUAdam cannot run here: {why}")
    try:
        say(validate(ds))
    except AssertionError as exc:
        say(f"VALIDATION FAILED\n{exc}")
        return 1
    say(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads "
        f"{torch.get_num_threads()}, engine kernel ISA {torch.ops.engine_adam.cpu_isa()}, torch {torch.__version__}")
    say(f"median of {args.reps} steps each, interleaved round-robin after 2 warm-up steps; ms per step "
        f"(effective GB/s at {BYTES_PER_ELEMENT} bytes/element)")
    ratios = []
    for m in args.sizes:
        n = int(m * 1e6)
        med = time_size(n, ds, args.reps)
        say(f"\n{m:g}M elements")
        for name, t in med.items():
            say(f"  {name:<28} {t * 1e3:9.1f} ms  {BYTES_PER_ELEMENT * n / t / 1e9:6.1f} GB/s")
        if ds is not None:
            r = med["DeepSpeedCPUAdam"] / med["ours (engine FusedAdamW)"]
            ratios.append(r)
            say(f"  ours / DeepSpeedCPUAdam speed-up at {m:g}M: {r:.2f}x")
    say()
    say(f"ours / DeepSpeedCPUAdam: {min(ratios):.2f}×" if ratios else "ours / DeepSpeedCPUAdam: unavailable")
    if args.out:
        args.out.write_text("```\n" + "\n".join(lines) + "\n```\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
