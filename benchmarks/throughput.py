#!/usr/bin/env python
"""Throughput, MFU, time split and peak memory of the engine on one config.

    python benchmarks/throughput.py --config benchmarks/configs/cpu_gpt_dp2.json --steps 20 --nproc 2
    torchrun --nproc_per_node 1 benchmarks/throughput.py --config benchmarks/configs/gpt1b_seq2048_bf16.json

Trains the reference GPT of the config's ``model`` section with the config's layout
(engine.initialize, model=None) on synthetic token ids (uniform over the vocabulary; the
speed does not depend on the values). After ``--warmup`` steps it times ``--steps``
optimizer steps (``engine.train_batch``; on CUDA synchronised) and reports:

- tokens/s of the global batch, step time median and spread (min, max, IQR);
- MFU: model FLOPs per token (engine.models.flops_per_token: 6 N_matmul + 12 L H S) x
  tokens/s over the summed peak of the ranks: the device table (engine.metrics.PEAK_TFLOPS)
  on GPUs, ``--peak-tflops`` if given, on CPU a measured matmul peak (sustained rate of
  1024^3 matmuls in the compute dtype on each rank's threads for 1 s, all ranks at once,
  before and after the run; the higher one);
- the time split of the step, from ``--split-steps`` extra instrumented steps (the timed
  steps carry no instrumentation): forward, backward, optimizer (gradient norm, clipping and
  update), exposed communication (time inside torch.distributed collectives and waits on
  them), and with a pipeline the bubble (stage idle time within the schedule, including
  waits for point-to-point transfers) with the executor's measured bubble fraction;
- peak memory per rank (max allocated on CUDA, max RSS on CPU) and the parameter /
  gradient / optimizer-state bytes the ZeRO optimizer holds.

Prints one markdown row (``--markdown-header`` adds the header) and writes JSON
(``--json PATH``; ``-`` prints it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402
    CommTimer,
    PhaseTimer,
    cpu_matmul_peak,
    launch,
    machine_description,
    markdown_table,
    median,
    spread,
    write_json,
)

COLUMNS = ["config", "layout", "ZeRO", "dtype", "ranks", "device", "tokens/s", "step ms (median)", "step ms IQR",
           "MFU %", "fwd ms", "bwd ms", "optim ms", "comm ms", "bubble ms", "other ms", "peak MiB/rank"]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--config", required=True, help="DeepSpeed-format JSON config (with a model section)")
    ap.add_argument("--steps", type=int, default=10, help="timed optimizer steps (after warm-up)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--split-steps", type=int, default=3, help="instrumented steps for the time split (0: none)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key (dotted path, JSON value), e.g. zero_optimization.stage=2")
    ap.add_argument("--nproc", type=int, default=None,
                    help="ranks to start (default: tp*pp of the config, or every GPU); ignored under torchrun")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per rank (torch.set_num_threads)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="per-device peak TFLOP/s (overrides table/measure)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the result as JSON ('-' = stdout)")
    ap.add_argument("--markdown-header", action="store_true", help="print the table header before the row")
    ap.add_argument("--timeout", type=float, default=1800.0, help="collective timeout and overall limit (s)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.split_steps < 0:
        ap.error("--steps must be >= 1, --warmup and --split-steps >= 0")
    if not os.path.isfile(args.config):
        ap.error(f"--config {args.config!r} is not a file")
    try:
        args.config_dict = apply_overrides(_read_json(args.config), args.set)
    except ValueError as exc:
        ap.error(str(exc))
    return args


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def apply_overrides(cfg: dict, sets: list[str]) -> dict:
    """``["a.b=3", "c=\"x\""]`` -> cfg with cfg["a"]["b"] = 3 and cfg["c"] = "x" (a copy)."""
    import copy

    out = copy.deepcopy(cfg)
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw  # a bare string
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {item!r}: {part} is not a section")
        node[parts[-1]] = value
    return out


def default_nproc(raw: dict) -> int:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    tp = int(raw.get("tensor_parallel", {}).get("autotp_size", 1) or 1)
    pp = int(raw.get("pipeline", {}).get("stages", 1) or 1)
    return tp * pp


# ------------------------------------------------------------------ one rank
def _batches(cfg, step: int, dp_rank: int, device):
    """This rank's micro-batches of step ``step``: (ids, targets), each (micro, seq) int64."""
    import torch

    g = torch.Generator().manual_seed(1_000_003 * step + dp_rank)
    v, s, b = cfg.model.vocab_size, cfg.model.seq_len, cfg.train_micro_batch_size_per_gpu
    out = []
    for _ in range(cfg.gradient_accumulation_steps):
        ids = torch.randint(0, v, (b, s + 1), generator=g)
        out.append((ids[:, :-1].to(device), ids[:, 1:].to(device)))
    return out


def _measured_peak(eng, dtype_name: str, override):
    """Per-device peak FLOP/s and where it came from."""
    import torch
    import torch.distributed as dist

    from engine.metrics import device_peak_flops

    peak = device_peak_flops(eng.device, dtype_name, override)
    if peak is not None:
        return peak, "flag" if override is not None else "table"
    if eng.device.type == "cuda":
        return None, "unknown GPU (give --peak-tflops)"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    dist.barrier()  # every rank measures at the same time: the contention of the real run
    return cpu_matmul_peak(dtype), f"measured {dtype_name} matmul on {torch.get_num_threads()} thread(s)"


def _remeasure_peak(eng, dtype_name: str, peak, source: str):
    """On a shared CPU a second window after the run: the higher of the two is the peak."""
    if not source.startswith("measured"):
        return peak
    again, _ = _measured_peak(eng, dtype_name, None)
    return max(peak, again)


def _probe_comm_and_memory(device) -> dict:
    """Bandwidths the planner is calibrated with: ring all-reduce bus bandwidth of an 8 MiB
    fp32 tensor over the world, small-message latency per ring step, and the copy bandwidth
    of device memory (read + write of 64 MiB). All ranks probe together."""
    import torch
    import torch.distributed as dist

    from benchmarks.common import sync

    n = dist.get_world_size()
    out = {}
    x = torch.ones(64 * 2 ** 20 // 4, device=device)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        y.copy_(x)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    out["memory_bw"] = 2 * x.numel() * 4 / best
    if n > 1:
        big = torch.ones(8 * 2 ** 20 // 4, device=device)
        small = torch.ones(2, device=device)
        for name, t, reps in (("big", big, 5), ("small", small, 20)):
            dist.all_reduce(t)  # warm-up
            dist.barrier()
            times = []
            for _ in range(reps):
                sync(device)
                t0 = time.perf_counter()
                dist.all_reduce(t)
                sync(device)
                times.append(time.perf_counter() - t0)
            times.sort()
            med = times[len(times) // 2]
            if name == "big":
                out["allreduce_busbw"] = 2 * (n - 1) / n * big.numel() * 4 / med
            else:
                out["latency_s"] = med / (2 * (n - 1))
    return out


def _split_step(eng, cfg, step: int, phases: PhaseTimer, comm: CommTimer) -> dict:
    """One instrumented step: seconds per phase on this rank."""
    import torch.distributed as dist

    from engine.pipeline.timeline import COMPUTE_KINDS, measured_bubble

    phases.reset()
    c0 = dict(comm.by_kind)
    data = iter(_batches(cfg, step, eng.groups.dp_rank, eng.device))
    with phases.phase("step"):
        eng.train_batch(data)
    comm_coll = comm.by_kind["collective"] - c0["collective"]
    comm_p2p = comm.by_kind["p2p"] - c0["p2p"]
    out = {"step": phases.seconds["step"], "optimizer": phases.compute("optimizer"),
           "communication": comm_coll, "p2p": comm_p2p}
    if eng.pipeline is None:
        out["forward"] = phases.compute("forward")
        out["backward"] = phases.compute("backward")
        out["bubble"] = 0.0
        out["bubble_fraction"] = 0.0
    else:
        recs = eng.pipeline.executor.records
        out["forward"] = sum(r.end - r.start for r in recs if r.kind == "F")
        out["backward"] = sum(r.end - r.start for r in recs if r.kind in COMPUTE_KINDS and r.kind != "F")
        # idle inside the schedule: waits for activations/gradients (bubble) and transfers
        out["bubble"] = max(phases.compute("pipeline") - out["forward"] - out["backward"], 0.0)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, [dataclasses.asdict(r) for r in recs])
        mine = [everyone[r] for r in eng.groups.pp_ranks]
        out["bubble_fraction"] = measured_bubble(mine)
    out["other"] = out["step"] - sum(out[k] for k in ("forward", "backward", "optimizer", "communication", "bubble"))
    return out


def _rank_main(args_dict: dict) -> dict:
    import torch
    import torch.distributed as dist

    import engine
    from engine.distributed.env import init_distributed, shutdown
    from engine.metrics import StepTimer, peak_memory_bytes
    from engine.models import flops_per_token, param_count

    args = argparse.Namespace(**args_dict)
    comm = CommTimer().install()  # before any library binds torch.distributed functions
    env = init_distributed(timeout_s=args.timeout)
    comm.device = env.device
    eng, *_ = engine.initialize(config=args.config_dict, dist_env=env)
    cfg = eng.config
    if eng.pipeline is not None:
        eng.pipeline.executor.record = True  # action timestamps for the bubble (cheap)
    peak, peak_source = _measured_peak(eng, cfg.precision, args.peak_tflops)
    probes = _probe_comm_and_memory(eng.device)
    timer = StepTimer(eng.device)
    step = 0
    for _ in range(args.warmup):
        eng.train_batch(iter(_batches(cfg, step, eng.groups.dp_rank, eng.device)))
        step += 1
    times, losses = [], []
    for _ in range(args.steps):
        data = iter(_batches(cfg, step, eng.groups.dp_rank, eng.device))
        dist.barrier()  # steps start together: the time is the slowest rank's
        timer.start()
        loss = eng.train_batch(data)
        times.append(timer.stop())
        losses.append(float(loss.item()))
        step += 1
    # the same step time on every rank: the slowest rank's
    t = torch.tensor(times, dtype=torch.float64, device=eng.device)  # NCCL: no CPU tensors
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    times = t.tolist()

    phases = PhaseTimer(comm, eng.device)
    if eng.pipeline is None:
        phases.wrap(eng.module, "forward", "forward")
        phases.wrap(eng.optimizer, "backward", "backward")
    else:
        phases.wrap(eng.pipeline, "train", "pipeline")
    phases.wrap(eng.optimizer, "grad_norm_tensor", "optimizer")
    phases.wrap(eng.optimizer, "step", "optimizer")
    splits = []
    for _ in range(args.split_steps):
        dist.barrier()
        splits.append(_split_step(eng, cfg, step, phases, comm))
        step += 1

    peak = _remeasure_peak(eng, cfg.precision, peak, peak_source)
    mem = eng.memory_breakdown()
    mine = {"rank": dist.get_rank(), "coord": {"dp": eng.groups.dp_rank, "tp": eng.groups.tp_rank,
                                               "pp": eng.groups.pp_rank},
            "peak_bytes": peak_memory_bytes(eng.device), "params_bytes": int(mem["params"]),
            "grads_bytes": int(mem["grads"]), "optimizer_state_bytes": int(mem["optimizer_state"]),
            "peak_flops": peak, "split": splits, "probes": probes}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    result = None
    if dist.get_rank() == 0:
        result = _summary(args, cfg, times, losses, everyone, peak_source, env.device,
                          flops_per_token(cfg.model), param_count(cfg.model))
    phases.unwrap()
    eng.destroy()
    comm.uninstall()
    del eng, phases  # the optimizer holds process groups: none may outlive shutdown()
    shutdown()
    return result


def _summary(args, cfg, times, losses, ranks, peak_source, device, fpt, n_params) -> dict:
    from engine.metrics import mfu

    tokens = cfg.train_batch_size * cfg.model.seq_len
    st = spread(times)
    tps = tokens / st["median"]
    peaks = [r["peak_flops"] for r in ranks]
    peak_total = sum(peaks) if all(p is not None for p in peaks) else None
    split_ms = {}
    for key in ("forward", "backward", "optimizer", "communication", "bubble", "other", "step"):
        vals = [median([s[key] for s in r["split"]]) for r in ranks if r["split"]]
        split_ms[key] = 1e3 * sum(vals) / len(vals) if vals else None
    bubble_fraction = [s["bubble_fraction"] for r in ranks for s in r["split"]]
    u = mfu(fpt, tps, peak_total)
    return {
        "config": os.path.relpath(args.config), "overrides": list(args.set), "model": cfg.model.to_dict(), "params": n_params,
        "flops_per_token": fpt, "layout": {"dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp},
        "zero_stage": cfg.zero.stage, "precision": cfg.precision,
        "schedule": cfg.pipeline.schedule if cfg.pp > 1 else None,
        "micro_batch": cfg.train_micro_batch_size_per_gpu, "grad_accum": cfg.gradient_accumulation_steps,
        "global_batch_tokens": tokens, "ranks": len(ranks), "device": device.type, "threads_per_rank": args.threads,
        "steps": args.steps, "warmup": args.warmup, "tokens_per_s": tps,
        "step_ms": {k: v * 1e3 for k, v in st.items()}, "step_times_ms": [x * 1e3 for x in times],
        "mfu": u, "peak_flops_per_rank": peaks, "peak_source": peak_source,
        "split_ms_mean_over_ranks": split_ms, "split_steps": args.split_steps,
        "measured_bubble_fraction": (sum(bubble_fraction) / len(bubble_fraction)) if bubble_fraction else None,
        "memory_per_rank": [{k: r[k] for k in ("rank", "coord", "peak_bytes", "params_bytes", "grads_bytes",
                                                "optimizer_state_bytes")} for r in ranks],
        "probes": {k: median([r["probes"][k] for r in ranks]) for k in ranks[0]["probes"]},
        "losses": losses, "machine": machine_description(),
    }


def markdown_row(res: dict) -> dict:
    lay = res["layout"]
    s = res["split_ms_mean_over_ranks"]
    return {
        "config": os.path.basename(res["config"]) + "".join(f" {o}" for o in res.get("overrides", [])),
        "layout": f"dp{lay['dp']}·tp{lay['tp']}·pp{lay['pp']}"
        + (f" {res['schedule']}" if res["schedule"] else ""), "ZeRO": res["zero_stage"], "dtype": res["precision"],
        "ranks": res["ranks"], "device": res["device"], "tokens/s": round(res["tokens_per_s"], 1),
        "step ms (median)": round(res["step_ms"]["median"], 1), "step ms IQR": round(res["step_ms"]["iqr"], 1),
        "MFU %": None if res["mfu"] is None else round(100 * res["mfu"], 1),
        "fwd ms": _r(s["forward"]), "bwd ms": _r(s["backward"]), "optim ms": _r(s["optimizer"]),
        "comm ms": _r(s["communication"]), "bubble ms": _r(s["bubble"]), "other ms": _r(s["other"]),
        "peak MiB/rank": round(max(m["peak_bytes"] for m in res["memory_per_rank"]) / 2 ** 20),
    }


def _r(x):
    return None if x is None else round(x, 1)


def main(argv=None) -> int:
    args = parse_args(argv)
    nproc = args.nproc or default_nproc(args.config_dict)
    t0 = time.perf_counter()
    results = launch(_rank_main, nproc, vars(args), threads=args.threads, timeout=args.timeout)
    res = results[0]
    if res is None:  # under an external launcher, ranks other than 0 report nothing
        return 0
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    res["command"] = " ".join([os.path.basename(sys.executable)] + sys.argv)
    row = markdown_row(res)
    table = markdown_table([row], COLUMNS)
    print("\n".join(table.splitlines()[(0 if args.markdown_header else 2):]))
    if args.json == "-":
        print(json.dumps(res, indent=1, default=str))
    elif args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
