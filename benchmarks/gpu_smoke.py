#!/usr/bin/env python3
"""The driver of the first GPU check (``benchmarks/gpu_check.sh``): one phase per call,
one JSON file per phase.

    python3 benchmarks/gpu_smoke.py versions --out versions.json
    python3 benchmarks/gpu_smoke.py smoke    --out smoke.json   [--device cpu] [--steps 3]
    python3 benchmarks/gpu_smoke.py fused    --out fused.json

``smoke``: the engine in this process (world size 1: every collective is the identity, so
this proves the single-device paths, not NCCL) on a small reference GPT, one case each:
ZeRO 0, 1, 2, 3; tied embeddings; activation checkpointing with document masking; Muon.
Each case trains ``--steps`` steps on synthetic ids; after the first (warm-up) step every
step runs under ``torch.cuda.set_sync_debug_mode("warn")`` and the host syncs inside
``train_batch`` are counted (the warnings CUDA raises; the one ``loss.item()`` after the
step is outside). A case fails when its loss is not finite or it raises. On CPU the sync
count is not measured (``null``): the phase is runnable anywhere so that it cannot rot.

``fused``: the CUDA kernels end to end: the fused AdamW (``optimizer.params.torch_adam``
false) and FP8 (``fp8.enabled``) each train the same model; the phase fails loudly when a
kernel did not build or load (no silent fallback to the reference).

Exit status: 0 when every case passed, 1 otherwise (the JSON says which and why).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
import traceback
import warnings
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = {"vocab_size": 4096, "hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4,
         "seq_len": 256, "tie_embeddings": False}


def base_config(device: str) -> dict:
    """The smoke model: bf16 on CUDA (the production dtype), fp32 on CPU."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "seed": 1,
        "gradient_clipping": 1.0, "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1, "torch_adam": True}},
        "zero_optimization": {"stage": 0},
        "model": dict(MODEL),
    }
    if device == "cuda":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _with(cfg: dict, **sections: Any) -> dict:
    out = json.loads(json.dumps(cfg))
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key].update(value)
        else:
            out[key] = value
    return out


def smoke_cases(device: str) -> dict[str, dict]:
    base = base_config(device)
    cases = {f"zero{s}": _with(base, zero_optimization={"stage": s}) for s in range(4)}
    cases["tied"] = _with(base, model={"tie_embeddings": True})
    cases["ckpt_docmask"] = _with(base, pipeline={"activation_checkpoint_interval": 1},
                                  data={"document_masking": True})
    cases["muon"] = _with(base, optimizer={"type": "Muon", "params": {"lr": 0.02, "adam_lr": 1e-3}},
                          zero_optimization={"stage": 1})
    return cases


def fused_cases(device: str) -> dict[str, dict]:
    base = base_config(device)
    return {"fused_adamw": _with(base, optimizer={"params": {"lr": 1e-3, "torch_adam": False}}),
            "fp8": _with(base, fp8={"enabled": True}, bf16={"enabled": True})}


def _batches(cfg: Any, step: int, device: Any, doc_masking: bool) -> list:
    """Synthetic micro-batches of ``step``: dicts with ``input_ids``/``labels`` (B, S) and,
    with document masking, ``doc_ids`` (B, S) of 4 documents of random lengths per row."""
    import torch

    g = torch.Generator().manual_seed(7919 * step + 1)
    v, s, b = cfg.model.vocab_size, cfg.model.seq_len, cfg.train_micro_batch_size_per_gpu
    out = []
    for _ in range(cfg.gradient_accumulation_steps):
        ids = torch.randint(0, v, (b, s + 1), generator=g)
        mb = {"input_ids": ids[:, :-1].to(device), "labels": ids[:, 1:].to(device)}
        if doc_masking:
            cuts = torch.sort(torch.randint(1, s, (b, 3), generator=g), dim=1).values  # (B, 3)
            mb["doc_ids"] = (torch.arange(s)[None, :, None] >= cuts[:, None, :]).sum(-1).to(device)  # (B, S)
        out.append(mb)
    return out


def _count_syncs(fn: Callable[[], Any], device: Any) -> tuple[Any, Optional[int]]:
    """``fn()`` and the number of synchronising CUDA calls it made (None on CPU)."""
    import torch

    if device.type != "cuda":
        return fn(), None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, sum("synchroniz" in str(w.message) for w in caught)


def run_case(raw: dict, steps: int) -> dict:
    """Train ``steps`` steps of one config in this process; the per-case record."""
    import torch

    import engine
    from engine.config import load_config

    cfg = load_config(raw, world_size=1)
    t0 = time.perf_counter()
    eng, *_ = engine.initialize(config=cfg)
    device = eng.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, syncs = [], []
    doc_masking = bool(raw.get("data", {}).get("document_masking"))
    for step in range(steps):
        data = iter(_batches(cfg, step, device, doc_masking))
        if step == 0:
            loss, n = eng.train_batch(data), None
        else:
            loss, n = _count_syncs(functools.partial(eng.train_batch, data), device)
            syncs.append(n)
        losses.append(float(loss.item()))
    rec: dict[str, Any] = {"losses": losses, "seconds": round(time.perf_counter() - t0, 2),
                           "host_syncs_per_step": syncs if device.type == "cuda" else None}
    if device.type == "cuda":
        rec["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    rec["ok"] = all(math.isfinite(x) for x in losses)
    if not rec["ok"]:
        rec["error"] = "non-finite loss"
    return rec


def run_cases(cases: dict[str, dict], steps: int) -> dict[str, dict]:
    out = {}
    for name, raw in cases.items():
        try:
            out[name] = run_case(raw, steps)
        except Exception as e:  # a failing case is recorded and the phase goes on
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()[-2000:]}
        print(f"{name}: {'ok' if out[name]['ok'] else 'FAILED ' + out[name]['error']}", flush=True)
    return out


def versions() -> dict:
    import torch

    rec: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
                           "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        rec["device"] = torch.cuda.get_device_name(0)
        rec["capability"] = list(torch.cuda.get_device_capability(0))
    rec["ok"] = True
    return rec


def check_kernels(device: str) -> dict:
    """Whether the fused kernels built and loaded on ``device`` (a GPU check fails without)."""
    from engine.ops.adam import fused_adamw_available
    from engine.ops.fp8 import fp8_kernel_available

    rec = {"fused_adamw": fused_adamw_available(device), "fp8_cast": fp8_kernel_available(device)}
    return {**rec, "ok": all(rec.values())}


def _select(cases: dict[str, dict], names: Optional[str]) -> dict[str, dict]:
    if names is None:
        return cases
    wanted = names.split(",")
    unknown = sorted(set(wanted) - set(cases))
    if unknown:
        raise SystemExit(f"gpu_smoke: unknown case(s) {unknown}; the phase has {sorted(cases)}")
    return {n: cases[n] for n in wanted}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("phase", choices=["versions", "smoke", "fused"])
    p.add_argument("--out", required=True, help="the phase's JSON file")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all of the phase)")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.phase == "versions":
        result: dict[str, Any] = versions()
    elif args.phase == "smoke":
        result = {"device": device, "cases": run_cases(_select(smoke_cases(device), args.cases), args.steps)}
    else:
        result = {"device": device, "kernels": check_kernels(device),
                  "cases": run_cases(_select(fused_cases(device), args.cases), args.steps)}
    if "cases" in result:
        result["ok"] = all(c["ok"] for c in result["cases"].values()) and result.get("kernels", {}).get("ok", True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
