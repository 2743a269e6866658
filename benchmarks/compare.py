#!/usr/bin/env python
"""Side by side with DeepSpeed and PyTorch-native parallelism, in the same run.

    python benchmarks/compare.py --steps 12 --repeats 3 --json benchmarks/results/compare.json
    python benchmarks/compare.py --suite ds --stages 3 --steps 4        # one quick case

Suites (``--suite``, default all):

- ``ds``: one plain GPT-style ``nn.Module`` (benchmarks/_compare_model.py), one dataset and
  ONE DeepSpeed JSON config, trained through ``deepspeed.initialize`` and through
  ``engine.initialize`` in the same processes, alternating step by step, for each ZeRO
  stage (``--stages``) at DP = ``--nproc``. Both step ``torch.optim.AdamW``
  (``"torch_adam": true``) so the ZeRO machinery is what differs.
- ``pp``: our 1F1B (engine.initialize on the layer list, ``pipeline.stages`` = nproc)
  against ``torch.distributed.pipelining.Schedule1F1B`` on the same stages.
- ``fsdp``: our ZeRO-3 against PyTorch's FSDP2 (``fully_shard``) at DP = nproc.

Each case runs ``--repeats`` times in fresh processes; each repetition takes
``--warmup`` + ``--steps`` steps per system, in ABBA order, each step after a barrier and
timed as the slowest rank's. Reported: tokens/s (median step), the ratio ours/theirs of
throughputs per repetition (> 1: we are faster) and its median over repetitions, the
paired per-step ratio, the largest per-step loss difference (fp32: the losses must
agree), and the time split (forward / backward / optimizer compute, exposed collective
and point-to-point communication). A system that cannot run prints its row with the
reason. CPU ranks use gloo; with GPUs the same code runs on CUDA/NCCL, one rank per GPU
(``--bf16`` for the ds suite there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._compare_common import summarize_pair  # noqa: E402
from benchmarks._compare_model import ModelSpec  # noqa: E402
from benchmarks.common import launch, machine_description, markdown_table, write_json  # noqa: E402

SUITES = ("ds", "pp", "fsdp")
COLUMNS = ["case", "ours tok/s", "theirs tok/s", "ratio ours/theirs", "ratio IQR", "paired ratio",
           "max Δloss", "ours fwd/bwd/opt/comm ms", "theirs fwd/bwd/opt/comm ms", "note"]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--suite", nargs="+", choices=SUITES, default=list(SUITES))
    ap.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3], help="ZeRO stages of the ds suite")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (DP for ds/fsdp, PP stages for pp)")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per system per repetition")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="fresh-process repetitions of each case")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step (ds, fsdp)")
    ap.add_argument("--pp-microbatches", type=int, default=8, help="micro-batches per step (pp)")
    ap.add_argument("--bf16", action="store_true", help="ds suite in bf16 (GPUs); pp and fsdp stay fp32")
    ap.add_argument("--zero", action="append", default=[], metavar="KEY=VALUE",
                    help="a zero_optimization key for both systems of the ds suite (VALUE is JSON), e.g. "
                         "--zero stage3_max_reuse_distance=0; repeatable")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--json", default=None, metavar="PATH", help="write every number as JSON")
    args = ap.parse_args(argv)
    try:
        args.zero = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.zero)}
    except ValueError as exc:
        ap.error(f"--zero takes KEY=VALUE with a JSON value (e.g. stage3_max_reuse_distance=0): {exc}")
    if min(args.steps, args.repeats, args.nproc) < 1 or args.warmup < 0:
        ap.error("--steps, --repeats and --nproc must be >= 1, --warmup >= 0")
    if any(s not in (0, 1, 2, 3) for s in args.stages):
        ap.error("--stages must be among 0 1 2 3")
    if args.layers < args.nproc and "pp" in args.suite:
        ap.error(f"--layers ({args.layers}) must be >= --nproc ({args.nproc}) for the pp suite")
    return args


def _spec(args, grad_accum: int) -> ModelSpec:
    return ModelSpec(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads, seq=args.seq,
                     micro_batch=args.micro_batch, grad_accum=grad_accum)


def _cases(args) -> list[tuple[str, str, object, tuple, int, ModelSpec]]:
    """(suite, case name, rank fn, its args, tokens per step, spec)."""
    from benchmarks._compare_ds import rank_ds_vs_ours
    from benchmarks._compare_fsdp import rank_fsdp
    from benchmarks._compare_pp import rank_pp

    cases = []
    if "ds" in args.suite:
        s = _spec(args, args.grad_accum)
        tokens = s.micro_batch * s.grad_accum * args.nproc * s.seq
        for st in args.stages:
            cases.append(("ds", f"ZeRO-{st} dp{args.nproc} vs DeepSpeed", rank_ds_vs_ours,
                          (s.to_dict(), st, args.steps, args.warmup, args.timeout, args.bf16, args.zero), tokens, s))
    if "pp" in args.suite:
        s = _spec(args, args.pp_microbatches)
        cases.append(("pp", f"1F1B pp{args.nproc} m{s.grad_accum} vs torch Schedule1F1B", rank_pp,
                      (s.to_dict(), args.steps, args.warmup, args.timeout), s.micro_batch * s.grad_accum * s.seq, s))
    if "fsdp" in args.suite:
        s = _spec(args, args.grad_accum)
        cases.append(("fsdp", f"ZeRO-3 dp{args.nproc} vs FSDP2", rank_fsdp,
                      (s.to_dict(), args.steps, args.warmup, args.timeout),
                      s.micro_batch * s.grad_accum * args.nproc * s.seq, s))
    return cases


THEIRS = {"ds": "deepspeed", "pp": "torch", "fsdp": "fsdp2"}


def _deepspeed_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is None


DS_MISSING = "deepspeed not installed, skipping (pip install --no-build-isolation deepspeed)"


def run_case(args, case) -> dict:
    suite, name, fn, fargs, tokens, spec = case
    theirs = THEIRS[suite]
    reps, note = [], None
    if suite == "ds" and _deepspeed_missing():  # said once per row, before any rank starts
        print(f"  {name}: {DS_MISSING}", file=sys.stderr, flush=True)
        return {"suite": suite, "case": name, "theirs": theirs, "spec": spec.to_dict(), "tokens_per_step": tokens,
                "repetitions": reps, "note": DS_MISSING}
    for r in range(args.repeats):
        per_rank = launch(fn, args.nproc, *fargs, threads=args.threads, timeout=args.timeout)
        err = per_rank[0].get("deepspeed_error") if suite == "ds" else None
        if err:
            note = f"DeepSpeed could not run: {err}"
            break
        reps.append(summarize_pair(per_rank, "ours", theirs, tokens))
        print(f"  {name}, repetition {r + 1}/{args.repeats}: ours/{theirs} = {reps[-1]['ratio']:.3f}, "
              f"max Δloss = {reps[-1]['max_loss_diff']}", file=sys.stderr, flush=True)
    return {"suite": suite, "case": name, "theirs": theirs, "spec": spec.to_dict(), "tokens_per_step": tokens,
            "repetitions": reps, "note": note}


def _split_str(split: dict, suite: str) -> str:
    if suite == "pp":
        return f"pipe {split.get('pipeline', 0):.0f} / opt {split.get('optimizer', 0):.0f} / " \
               f"p2p {split.get('p2p', 0):.0f} / coll {split.get('comm', 0):.0f}"
    return "/".join(f"{split.get(k, 0):.0f}" for k in ("forward", "backward", "optimizer", "comm"))


def summary_row(res: dict) -> dict:
    reps = res["repetitions"]
    row = {"case": res["case"], "note": res["note"]}
    if not reps:
        return row
    med = statistics.median
    ratios = [r["ratio"] for r in reps]
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    theirs = res["theirs"]
    row.update({
        "ours tok/s": round(med([r["ours"]["tokens_per_s"] for r in reps]), 1),
        "theirs tok/s": round(med([r[theirs]["tokens_per_s"] for r in reps]), 1),
        "ratio ours/theirs": f"{med(ratios):.3f}", "ratio IQR": f"{q[2] - q[0]:.3f}",
        "paired ratio": f"{med([r['paired_ratio_median'] for r in reps]):.3f}",
        "max Δloss": _loss_diff(reps),
        "ours fwd/bwd/opt/comm ms": _split_str(_median_split(reps, "ours"), res["suite"]),
        "theirs fwd/bwd/opt/comm ms": _split_str(_median_split(reps, theirs), res["suite"]),
    })
    if res["note"] is None:
        row["note"] = f"{theirs}; {len(reps)} reps x {reps[0]['steps']} steps"
    return row


def _loss_diff(reps: list) -> str | None:
    diffs = [r["max_loss_diff"] for r in reps if r["max_loss_diff"] is not None]
    return f"{max(diffs):.2g}" if diffs else None


def _median_split(reps: list, who: str) -> dict:
    keys = reps[0][who]["split_ms"].keys()
    return {k: statistics.median([r[who]["split_ms"][k] for r in reps]) for k in keys}


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    machine = machine_description()
    results = []
    for case in _cases(args):
        print(f"{case[1]} ...", file=sys.stderr, flush=True)
        results.append(run_case(args, case))
    rows = [summary_row(r) for r in results]
    print(markdown_table(rows, COLUMNS))
    print(f"\n(ratio > 1: ours faster; {args.nproc} ranks x {args.threads} thread(s); "
          f"{time.perf_counter() - t0:.0f} s; pp columns: pipeline / optimizer / point-to-point wait / collectives)")
    if args.json:
        write_json(args.json, {"args": vars(args), "machine": machine, "results": results, "rows": rows,
                               "command": " ".join([os.path.basename(sys.executable)] + sys.argv)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
