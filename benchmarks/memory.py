#!/usr/bin/env python
"""Per-rank PEAK memory of ZeRO stages 0-3, ours next to DeepSpeed on the same model and
config, next to the peak formula and the planner's prediction.

    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/memory.py --json benchmarks/results/memory_peak.json
    python benchmarks/memory.py --hidden 256 --layers 2 --vocab 1024 --stages 2 3 --dtypes fp32 --ga 1

The model is the reference GPT (``model`` section: hidden, layers, vocab, seq), DP = ``--dp``
ranks on gloo (CPU), micro-batch ``--micro`` x ``seq`` tokens, ``--steps`` optimizer steps.
Each (system, stage, dtype, GA) runs in fresh processes so that peaks do not mix:

- ours: ``engine.initialize(model=None, config=...)`` (stage 3 builds under
  ``engine.zero.Init``);
- DeepSpeed (``deepspeed.initialize``, same JSON minus the ``model`` section) on the same
  reference model built by ``engine.pipeline.stages.build_reference_chunks`` (stage 3: under
  ``deepspeed.zero.Init``), the same micro-batches, ``torch.optim.AdamW`` on both sides.

Two measurements per rank, both from the rank's own start (after imports and the process
group): ``tensor`` = the exact live-storage high-water mark (engine.zero.peak), and ``rss``
= the resident-set high-water mark (VmHWM, reset after start-up) minus the start-up RSS,
with glibc's mmap threshold fixed by the parent (freed tensors leave the RSS at once). The
tensor peak is what the formula and the planner predict; the RSS peak adds allocator,
communication staging and interpreter growth, and cross-checks it. ``construction`` is the
tensor peak up to the end of ``initialize``; ``step`` the one during training, split into
``fwd_bwd`` (forward and backward of each micro-batch) and ``opt_step`` (``step()``: the
reductions, the update, the publish). The MODEL-STATE peak (what ZeRO shards) is the larger
of ``opt_step`` (no activations alive) and ``fwd_bwd`` minus one micro-batch's saved
activations measured on the dense model; the total tensor peak is reported next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the gloo multi-rank harness

MiB = float(2 ** 20)
MMAP_THRESHOLD = "131072"


def config(args: argparse.Namespace, stage: int, dtype: str, ga: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": ga,
        "train_batch_size": args.micro * ga * args.dp, "steps_per_print": 10 ** 9, "seed": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1, "torch_adam": not args.fused_adam}},
        "bf16": {"enabled": dtype == "bf16"},
        "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": args.bucket, "allgather_bucket_size": args.bucket,
                              "stage3_prefetch_bucket_size": args.bucket,
                              "stage3_param_persistence_threshold": 10_000,
                              "stage3_max_live_parameters": 4 * args.bucket},
        "model": {"vocab_size": args.vocab, "hidden_size": args.hidden, "num_layers": args.layers,
                  "num_heads": args.heads, "seq_len": args.seq},
    }


def _batches(cfg: dict, step: int, rank: int) -> list:
    import torch

    m = cfg["model"]
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for _ in range(cfg["gradient_accumulation_steps"]):
        ids = torch.randint(0, m["vocab_size"], (cfg["train_micro_batch_size_per_gpu"], m["seq_len"] + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def _ds_engine(cfg: dict):
    """DeepSpeed on the same reference model (built under deepspeed.zero.Init at stage 3)."""
    import logging

    import deepspeed
    import torch

    from engine.config import load_config
    from engine.distributed.groups import NO_TP
    from engine.pipeline.stages import ReferenceModel, build_reference_chunks

    deepspeed.utils.logger.setLevel(logging.WARNING)
    ds_cfg = {k: v for k, v in cfg.items() if k not in ("model", "seed")}
    ds_cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1, "torch_adam": True}}
    conf = load_config(cfg, world_size=torch.distributed.get_world_size())
    dtype = torch.bfloat16 if cfg["bf16"]["enabled"] else torch.float32
    stage3 = cfg["zero_optimization"]["stage"] == 3
    import torch._dynamo  # noqa: F401  (imported inside deepspeed.zero.Init, which patches Tensor.__new__, it fails)

    deepspeed.init_distributed(dist_backend="gloo")  # wraps the existing process group
    ctx = deepspeed.zero.Init(config_dict_or_path=ds_cfg) if stage3 else contextlib.nullcontext()
    with ctx:
        chunks = build_reference_chunks(conf, 0, NO_TP, device=torch.device("cpu"), dtype=torch.float32)
        model = ReferenceModel(chunks[0], NO_TP)
    eng, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()], config=ds_cfg,
                                   dist_init_required=False)
    del dtype
    return eng


def _train_step(eng, mbs, tracker) -> float:
    """One optimizer step through the DeepSpeed-style calls both systems share, with the
    forward/backward of each micro-batch and the optimizer step (reduction, update,
    publish: ``step()`` on the boundary) in separate tracker phases."""
    losses = []
    for x, y in mbs:
        with tracker.phase("fwd_bwd"):
            loss = eng(x, y)
            eng.backward(loss)
        with tracker.phase("opt_step"):
            eng.step()
        losses.append(loss.item())
    return sum(losses) / len(losses)


def activation_bytes(cfg: dict) -> int:
    """One micro-batch's saved activations (plus the loss) of the dense reference GPT in
    the config's dtype (engine.zero.peak.saved_activation_bytes)."""
    import torch

    from engine.models import GPT, ModelConfig
    from engine.zero.peak import saved_activation_bytes

    model = GPT(ModelConfig(**cfg["model"]), seed=1)
    if cfg["bf16"]["enabled"]:
        model = model.to(torch.bfloat16)
    x, y = _batches(cfg, 0, 0)[0]
    return saved_activation_bytes(model, lambda: model(x, y))


def _rank(rank: int, world: int, system: str, cfg: dict, steps: int) -> dict:
    import torch

    from engine.metrics import current_memory_bytes, peak_memory_bytes, reset_peak_memory
    from engine.zero.memory import optimizer_peak_inputs
    from engine.zero.peak import LiveMemoryTracker

    cpu = torch.device("cpu")
    if system == "deepspeed":
        # DeepSpeed's sanity check wants its launcher's variables (the group already exists)
        os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
        import deepspeed  # noqa: F401  (imported before the baseline: its import is not the model's memory)
    import engine

    gc.collect()
    base_rss = current_memory_bytes(cpu)
    reset_peak_memory(cpu)
    losses = []
    t0 = time.perf_counter()
    with LiveMemoryTracker() as t:
        with t.phase("construction"):
            if system == "ours":
                eng, *_ = engine.initialize(config=cfg)
            else:
                eng = _ds_engine(cfg)
        with t.phase("step"):
            for s in range(steps):
                losses.append(_train_step(eng, _batches(cfg, s, rank), t))
        inputs = optimizer_peak_inputs(eng.optimizer, eng.module) if system == "ours" else None
    out = {"tensor_peak": t.peak, "construction": t.phases.get("construction", 0), "step": t.phases.get("step", 0),
           "fwd_bwd": t.phases.get("fwd_bwd", 0), "opt_step": t.phases.get("opt_step", 0),
           "rss_peak": peak_memory_bytes(cpu) - base_rss, "losses": losses, "inputs": inputs,
           "seconds": time.perf_counter() - t0}
    del eng
    gc.collect()
    return out


def predict(cfg: dict, inputs: dict, dp: int) -> dict:
    """The planner's peak for the same layout (engine.planner.cost.peak_estimate)."""
    from engine.models.config import ModelConfig
    from engine.planner.cost import Layout, peak_estimate

    zc = cfg["zero_optimization"]
    layout = Layout(dp=dp, tp=1, pp=1, micro_batch=cfg["train_micro_batch_size_per_gpu"],
                    num_microbatches=cfg["gradient_accumulation_steps"], zero_stage=zc["stage"])
    pb = 2 if cfg["bf16"]["enabled"] else 4
    return peak_estimate(ModelConfig(**cfg["model"]), layout, param_bytes=pb, bucket_numel=inputs["bucket_numel"],
                         prefetch_numel=zc["stage3_prefetch_bucket_size"],
                         torch_adam=cfg["optimizer"]["params"]["torch_adam"])


def run(args: argparse.Namespace) -> list[dict]:
    from harness import run_ranks

    rows = []
    act = {dtype: activation_bytes(config(args, 0, dtype, 1)) for dtype in args.dtypes}
    for dtype in args.dtypes:
        for ga in args.ga:
            for stage in args.stages:
                cfg = config(args, stage, dtype, ga)
                row = {"stage": stage, "dtype": dtype, "ga": ga, "dp": args.dp, "activations": act[dtype]}
                for system in args.systems:
                    if system == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
                        row[system] = {"error": "deepspeed not installed, skipping "
                                                "(pip install --no-build-isolation deepspeed)"}
                        print(f"  {dtype} ga{ga} Z{stage} {system}: {row[system]['error']}", file=sys.stderr,
                              flush=True)
                        continue
                    try:
                        ranks = run_ranks(_rank, args.dp, system, cfg, args.steps, timeout=args.timeout)
                        row[system] = {k: [r[k] for r in ranks] for k in
                                       ("tensor_peak", "construction", "step", "fwd_bwd", "opt_step", "rss_peak",
                                        "losses", "seconds")}
                        if system == "ours":
                            row["inputs"] = ranks[0]["inputs"]
                    except Exception as exc:  # noqa: BLE001 - a system's failure is its row's reason
                        row[system] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
                    print(f"  {dtype} ga{ga} Z{stage} {system}: " + (
                        f"tensor {max(row[system]['tensor_peak']) / MiB:.0f} MiB, rss {max(row[system]['rss_peak']) / MiB:.0f} MiB"
                        if "error" not in row[system] else row[system]["error"]), file=sys.stderr, flush=True)
                if "inputs" in row:
                    row["predicted"] = predict(cfg, row["inputs"], args.dp)
                    from engine.zero.memory import zero_peak_formula

                    row["formula"] = zero_peak_formula(param_bytes=2 if dtype == "bf16" else 4, stage=stage, dp=args.dp,
                                                       **row["inputs"], accumulating=ga > 1,
                                                       torch_adam=cfg["optimizer"]["params"]["torch_adam"],
                                                       activation_bytes=row["predicted"]["activations"])
                rows.append(row)
                if args.json:  # after every row: a long run interrupted keeps what it measured
                    with open(args.json, "w") as fh:
                        json.dump({"args": vars(args), "rows": rows}, fh, indent=1)
    return rows


def model_state_peak(r: dict, system: str) -> float:
    """Worst rank's MODEL-STATE peak: the optimizer-step phase's peak (no activations are
    alive then: parameters, gradients, optimizer state, buckets and the step's temporaries),
    or the forward/backward phase's peak minus one micro-batch's saved activations
    (``r["activations"]``, measured on the dense model), whichever is larger."""
    d = r[system]
    return max(max(st, fb - r["activations"]) for st, fb in zip(d["opt_step"], d["fwd_bwd"]))


def table(rows: list[dict]) -> str:
    head = ("| dtype | GA | stage | ours tensor peak MiB (max rank) | ours model-state peak | ours RSS peak "
            "| DeepSpeed tensor peak | DeepSpeed model-state peak | DeepSpeed RSS peak | ours / DS (tensor) "
            "| formula peak | planner | states (paper) |")
    out = [head, "|" + "---|" * 13]
    for r in rows:
        def cell(sys_: str, k: str, r: dict = r) -> str:
            d = r.get(sys_, {})
            if k == "model_state":
                return "n/a" if "opt_step" not in d else f"{model_state_peak(r, sys_) / MiB:.0f}"
            return "n/a" if k not in d else f"{max(d[k]) / MiB:.0f}"

        ratio = "n/a"
        if "tensor_peak" in r.get("ours", {}) and "tensor_peak" in r.get("deepspeed", {}):
            ratio = f"{max(r['ours']['tensor_peak']) / max(r['deepspeed']['tensor_peak']):.2f}"
        f = r.get("formula", {})
        pred = r.get("predicted", {})
        out.append(f"| {r['dtype']} | {r['ga']} | {r['stage']} | {cell('ours', 'tensor_peak')} "
                   f"| {cell('ours', 'model_state')} | {cell('ours', 'rss_peak')} "
                   f"| {cell('deepspeed', 'tensor_peak')} | {cell('deepspeed', 'model_state')} "
                   f"| {cell('deepspeed', 'rss_peak')} | {ratio} "
                   f"| {f.get('peak', 0) / MiB:.0f} | {pred.get('peak', 0) / MiB:.0f} | {f.get('states', 0) / MiB:.0f} |")
    return "\n".join(out)


def savings(rows: list[dict]) -> str:
    """ZeRO-3's saving over ZeRO-0 per (dtype, GA) and system, of the model-state peak and
    of the total tensor peak (the issue's target: >= 70% of the model-state peak; the ideal
    at DP = 4 is 75%)."""
    out = []
    by = {(r["dtype"], r["ga"], r["stage"]): r for r in rows}
    for (dtype, ga, stage), r3 in by.items():
        r0 = by.get((dtype, ga, 0))
        if stage != 3 or r0 is None:
            continue
        for system in ("ours", "deepspeed"):
            if "opt_step" not in r3.get(system, {}) or "opt_step" not in r0.get(system, {}):
                continue
            ms = 1 - model_state_peak(r3, system) / model_state_peak(r0, system)
            tot = 1 - max(r3[system]["tensor_peak"]) / max(r0[system]["tensor_peak"])
            out.append(f"{dtype} GA {ga} {system}: ZeRO-3 saves {100 * ms:.1f}% of ZeRO-0's model-state peak "
                       f"({100 * tot:.1f}% of its total tensor peak)")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--bucket", type=int, default=5_000_000, help="reduce_bucket_size (elements)")
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    ap.add_argument("--ga", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--systems", nargs="+", choices=["ours", "deepspeed"], default=["ours", "deepspeed"])
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--fused-adam", action="store_true",
                    help="ours steps its FusedAdamW (in place, no temporaries) instead of torch.optim.AdamW; "
                         "DeepSpeed keeps torch.optim.AdamW")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", help="write the rows (bytes) here")
    args = ap.parse_args(argv)
    if any(s not in (0, 1, 2, 3) for s in args.stages) or args.dp < 1 or args.steps < 1:
        ap.error("--stages among 0-3, --dp >= 1, --steps >= 1")
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD  # inherited by the spawned ranks
    rows = run(args)
    print(f"per-rank peak memory, reference GPT h{args.hidden} L{args.layers} V{args.vocab}, DP={args.dp}, "
          f"micro-batch {args.micro}x{args.seq}, reduce_bucket_size {args.bucket:,}\n")
    print(table(rows))
    print("\n" + savings(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
