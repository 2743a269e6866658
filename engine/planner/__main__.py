"""The planner's command line (this module prints; the library does not).

    python -m engine.planner plan --model llama3-70b --cluster h100 --nodes 8 --global-batch-tokens 4M
    python -m engine.planner plan --layers 32 --hidden 4096 --heads 32 --vocab 32000 --seq 4096 \\
        --gpus-per-node 8 --nodes 2 --gpu-memory-gib 80 --peak-tflops 989 --intra-bw-gbs 400 \\
        --inter-bw-gbs 45 --global-batch 1024
    python -m engine.planner plan --model llama3-8b --cluster h100 --nodes 1 --global-batch 64 \\
        --write-config my-8b.json
    python -m engine.planner plan --model llama3-8b --seq 65536 --cluster h100 --nodes 2 --global-batch 32 \\
        --cp 1 2 4 8 --cp-modes ring ulysses
    python -m engine.planner calibrate benchmarks/results/data/2026-11-21_cpu-2core/throughput_*.json

``plan`` prints the ranked table (best first) and the first rejected layouts with their
reasons; with ``--write-config OUT.json`` it also writes the best layout (or the
``--pick``-th) as a DeepSpeed-format config that ``launch/train.py`` runs
(engine/planner/write.py); ``calibrate`` fits the compute efficiency on measured throughput records and
prints predicted vs measured step time for each.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Optional

from engine.errors import ConfigError
from engine.models.config import ModelConfig
from engine.pipeline.stages import reference_layer_params
from engine.planner.activations import RECOMPUTE_POLICIES
from engine.planner.calibrate import check_runs, fit_efficiency, measured_cluster, median_runs
from engine.planner.cluster import CLUSTERS, MODELS, Cluster, GiB, cluster_preset, model_preset
from engine.planner.cost import CP_MODES
from engine.planner.search import DEFAULT_SCHEDULES, format_plans, plan
from engine.planner.write import config_text, layout_config


def _tokens(text: str) -> int:
    """"4M" -> 4194304 (binary prefixes, as batch sizes are usually powers of two), "512k", "1e6"."""
    t = text.strip().lower()
    mult = {"k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 4M, 512k, 1048576)") from None


def _model(args: argparse.Namespace) -> ModelConfig:
    base = model_preset(args.model).to_dict() if args.model else {}
    for key, flag in (("num_layers", "layers"), ("hidden_size", "hidden"), ("num_heads", "heads"),
                      ("num_kv_heads", "kv_heads"), ("ffn_hidden_size", "ffn"), ("vocab_size", "vocab"),
                      ("seq_len", "seq")):
        v = getattr(args, flag)
        if v is not None:
            base[key] = v
    missing = [k for k in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_len") if k not in base]
    if missing:
        raise ConfigError(f"the model needs {', '.join(missing)}: give --model PRESET or the flags "
                          "--layers --hidden --heads --vocab --seq")
    base.setdefault("tie_embeddings", False)
    return ModelConfig.from_dict(base)


def _cluster(args: argparse.Namespace) -> Cluster:
    if args.cluster:
        c = cluster_preset(args.cluster)
    else:
        need = {"--gpu-memory-gib": args.gpu_memory_gib, "--peak-tflops": args.peak_tflops,
                "--intra-bw-gbs": args.intra_bw_gbs, "--inter-bw-gbs": args.inter_bw_gbs}
        missing = [k for k, v in need.items() if v is None]
        if missing:
            raise ConfigError(f"the cluster needs {', '.join(missing)} (or --cluster PRESET)")
        c = Cluster("custom", gpus_per_node=args.gpus_per_node or 8, nodes=args.nodes or 1,
                    memory_bytes=args.gpu_memory_gib * GiB, peak_flops=args.peak_tflops * 1e12,
                    intra_node_bw=args.intra_bw_gbs * 1e9, inter_node_bw=args.inter_bw_gbs * 1e9,
                    hbm_bw=(args.hbm_tbs or 3.0) * 1e12)
    changes = {}
    for field, value in (("nodes", args.nodes), ("gpus_per_node", args.gpus_per_node),
                         ("memory_bytes", args.gpu_memory_gib and args.gpu_memory_gib * GiB),
                         ("peak_flops", args.peak_tflops and args.peak_tflops * 1e12),
                         ("intra_node_bw", args.intra_bw_gbs and args.intra_bw_gbs * 1e9),
                         ("inter_node_bw", args.inter_bw_gbs and args.inter_bw_gbs * 1e9),
                         ("hbm_bw", args.hbm_tbs and args.hbm_tbs * 1e12),
                         ("compute_efficiency", args.efficiency)):
        if value is not None:
            changes[field] = value
    return replace(c, **changes) if changes else c


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument("--model", choices=sorted(MODELS), help="a preset (flags below override its fields)")
    for flag in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab", "seq"):
        m.add_argument(f"--{flag}", type=int)
    c = p.add_argument_group("cluster")
    c.add_argument("--cluster", choices=sorted(CLUSTERS), help="a preset (flags below override it)")
    c.add_argument("--nodes", type=int)
    c.add_argument("--gpus-per-node", type=int)
    c.add_argument("--gpu-memory-gib", type=float)
    c.add_argument("--peak-tflops", type=float, help="per device, in the compute dtype")
    c.add_argument("--intra-bw-gbs", type=float, help="per device, per direction, GB/s (NVLink)")
    c.add_argument("--inter-bw-gbs", type=float, help="per device between nodes, GB/s (NIC)")
    c.add_argument("--hbm-tbs", type=float, help="device memory bandwidth, TB/s")
    c.add_argument("--efficiency", type=float, help="achieved fraction of peak in the layers (default 0.6)")
    b = p.add_argument_group("batch and search")
    g = b.add_mutually_exclusive_group(required=True)
    g.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    g.add_argument("--global-batch-tokens", type=_tokens, help="tokens per step (4M = 4*2^20)")
    b.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    b.add_argument("--zero", type=int, nargs="+", default=[0, 1, 2, 3])
    b.add_argument("--schedules", nargs="+", default=list(DEFAULT_SCHEDULES))
    b.add_argument("--recompute", nargs="+", default=list(RECOMPUTE_POLICIES), choices=list(RECOMPUTE_POLICIES),
                   help="activation recompute policies to search (activation_checkpointing granularity)")
    b.add_argument("--no-recompute", action="store_true", help="only --recompute none")
    b.add_argument("--cp", type=int, nargs="+", default=[1], metavar="C",
                   help="context-parallel degrees to search (context_parallel.size; default 1: none)")
    b.add_argument("--cp-modes", nargs="+", default=["ring"], choices=list(CP_MODES),
                   help="context_parallel modes to search with --cp > 1 (default ring)")
    b.add_argument("--unbalanced", action="store_true", help="also pipeline degrees that do not divide the layers")
    b.add_argument("--bytes", type=float, default=2.0, help="compute-dtype bytes (2 = bf16)")
    b.add_argument("--top", type=int, default=15)
    b.add_argument("--rejected", type=int, default=10)
    o = p.add_argument_group("output")
    o.add_argument("--write-config", metavar="OUT.json",
                   help="write the best layout (or the --pick-th) as a DeepSpeed-format config for launch/train.py")
    o.add_argument("--pick", type=int, default=1, metavar="N", help="with --write-config: the N-th ranked layout")
    o.add_argument("--steps", type=int, default=10000, metavar="N",
                   help="with --write-config: the LR schedule's length in optimizer steps (default 10000)")


def cmd_plan(args: argparse.Namespace) -> int:
    model, cluster = _model(args), _cluster(args)
    if args.global_batch is not None:
        batch = args.global_batch
    else:
        if args.global_batch_tokens % model.seq_len:
            raise ConfigError(f"--global-batch-tokens {args.global_batch_tokens} is not a multiple of the "
                              f"sequence length {model.seq_len}")
        batch = args.global_batch_tokens // model.seq_len
    plans = plan(model, cluster, batch, param_bytes=args.bytes, micro_batches=args.micro_batches,
                 zero_stages=args.zero, schedules=args.schedules,
                 recompute=("none",) if args.no_recompute else tuple(args.recompute), balanced_stages=not args.unbalanced,
                 cp_sizes=tuple(args.cp), cp_modes=tuple(args.cp_modes))
    n_params = sum(reference_layer_params(model)) - (model.vocab_size * model.hidden_size if model.tie_embeddings else 0)
    print(f"model: {n_params / 1e9:.1f}B parameters, {model.num_layers} layers, hidden {model.hidden_size}, "
          f"{model.num_heads} heads ({model.num_kv_heads} kv), ffn {model.ffn_hidden_size}, vocab "
          f"{model.vocab_size}, seq {model.seq_len}")
    print(f"cluster: {cluster.nodes} x {cluster.gpus_per_node} {cluster.name}; {cluster.memory_bytes / GiB:.0f} GiB, "
          f"{cluster.peak_flops / 1e12:.0f} TFLOP/s peak at {cluster.compute_efficiency:.0%} achieved, "
          f"{cluster.intra_node_bw / 1e9:.0f} / {cluster.inter_node_bw / 1e9:.0f} GB/s intra / inter node")
    print(f"global batch: {batch} sequences = {batch * model.seq_len:,} tokens\n")
    print(format_plans(plans, top=args.top, rejected=args.rejected))
    if not any(p.feasible for p in plans):
        print("\nno layout fits: more devices, recomputation, a smaller micro-batch or sequence")
        return 1
    if args.write_config:
        _write_config(args, model, cluster, [p for p in plans if p.feasible])
    return 0


def _write_config(args: argparse.Namespace, model: ModelConfig, cluster: Cluster, feasible: list) -> None:
    if not 1 <= args.pick <= len(feasible):
        raise ConfigError(f"--pick {args.pick}: there are {len(feasible)} feasible layouts (1..{len(feasible)})")
    chosen = feasible[args.pick - 1].layout
    cfg = layout_config(model, chosen, param_bytes=args.bytes, total_steps=args.steps)
    with open(args.write_config, "w", encoding="utf-8") as f:
        f.write(config_text(cfg))
    print(f"\nwrote {args.write_config}: #{args.pick} {chosen.describe()} for {cluster.world_size} devices "
          f"({cluster.nodes} x {cluster.gpus_per_node}); check it with: python -m engine.config "
          f"{args.write_config} --world-size {cluster.world_size}")


def cmd_calibrate(args: argparse.Namespace) -> int:
    runs = []
    for path in args.files:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)
        if "tokens_per_s" not in rec:
            continue  # not a throughput record (memory, compare)
        runs.append(rec)
    if not runs:
        raise ConfigError("none of the files is a benchmarks/throughput.py record")
    n = len(runs)
    runs = median_runs(runs)
    print(f"{n} records, {len(runs)} configurations (the median-step-time record of each)")
    eff = fit_efficiency(runs) if args.efficiency is None else args.efficiency
    cluster = measured_cluster(runs, eff)
    print(f"measured machine: peak {cluster.peak_flops / 1e9:.1f} GFLOP/s per rank (matmul), all-reduce bus "
          f"bandwidth {cluster.intra_node_bw / 1e9:.2f} GB/s, latency {cluster.latency_s * 1e6:.0f} us per ring "
          f"step, memory {cluster.hbm_bw / 1e9:.1f} GB/s; fitted compute efficiency {eff:.3f}\n")
    rows = check_runs(runs, cluster)
    print("| run | layout | measured ms | predicted ms | predicted/measured | predicted compute / TP / bubble "
          "/ DP / optimizer ms |\n|---|---|---|---|---|---|")
    for r in rows:
        parts = " / ".join(f"{v:.0f}" for v in r["predicted_parts_ms"].values())
        name = (r["config"] or "?").split("/")[-1] + "".join(f" {o}" for o in r["overrides"])
        print(f"| {name} | {r['layout']} | {r['measured_ms']:.0f} | {r['predicted_ms']:.0f} | "
              f"{r['ratio']:.2f} | {parts} |")
    ratios = sorted(r["ratio"] for r in rows)
    print(f"\npredicted/measured: median {ratios[len(ratios) // 2]:.2f}, range {ratios[0]:.2f} - {ratios[-1]:.2f} "
          f"over {len(rows)} runs")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.planner", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="rank the layouts of a model on a cluster")
    _add_plan_args(p)
    c = sub.add_parser("calibrate", help="predicted vs measured step time of benchmarks/throughput.py records")
    c.add_argument("files", nargs="+", help="throughput JSON records")
    c.add_argument("--efficiency", type=float, help="use this compute efficiency instead of fitting it")
    args = ap.parse_args(argv)
    try:
        return cmd_plan(args) if args.cmd == "plan" else cmd_calibrate(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
