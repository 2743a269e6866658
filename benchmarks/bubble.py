"""Measure the pipeline bubble of the real executor on CPU ranks and compare it with theory.

    python benchmarks/bubble.py --stages 4 --microbatches 8 --schedule 1f1b [--json]

Starts ``--stages`` processes on gloo, each holding a synthetic stage of known cost: the
forward sleeps ``f`` (``--forward-ms``), the backward ``2f`` - ``f`` on the input-gradient
path and ``f`` on the weight-gradient path, so zb-h1's split backward is ``f`` + ``f``.
(With interleaved-1f1b and zb-v each of the v chunks costs ``f/v``.) After a warm-up step it runs
one measured step through :class:`engine.pipeline.executor.PipelineExecutor`, gathers
every rank's action timestamps and prints the measured bubble next to the analytic one
(and the simulator's prediction for the same costs). Writes a Chrome trace (open in
chrome://tracing or ui.perfetto.dev) and a PNG Gantt chart.

--json prints one JSON object: measured_bubble, analytic_bubble, simulated_bubble, ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from engine.distributed.groups import AxisGroup  # noqa: E402
from engine.distributed.spawn import SpawnError, spawn  # noqa: E402
from engine.pipeline.executor import PipelineExecutor  # noqa: E402
from engine.pipeline.schedule import SCHEDULES, V_SCHEDULES, build_all, placement_of  # noqa: E402
from engine.pipeline.simulate import bubble_formula, cost_table, simulate  # noqa: E402
from engine.pipeline.timeline import measured_bubble, write_chrome_trace, write_gantt_png  # noqa: E402

SHAPE = (2, 4, 8)  # (micro batch, seq, hidden) of the synthetic activations


class _SleepInputPath(torch.autograd.Function):
    """The input-gradient path: forward sleeps f, backward sleeps f."""

    @staticmethod
    def forward(ctx, x, seconds):
        time.sleep(seconds)
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class _SleepWeightPath(torch.autograd.Function):
    """The weight-gradient path: free forward, backward sleeps f."""

    @staticmethod
    def forward(ctx, w, seconds):
        ctx.seconds = seconds
        return w.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class SleepStage(torch.nn.Module):
    """y = sleep_x(x) * sleep_w(w): F = f, full B = 2f, input grad f + weight grad f."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds
        self.w = torch.nn.Parameter(torch.ones(SHAPE[-1]))

    def forward(self, x):  # (B, S, H) -> (B, S, H)
        return _SleepInputPath.apply(x, self.seconds) * _SleepWeightPath.apply(self.w, self.seconds)


def _data(m: int):
    # inputs require grad so that the first stage's backward also runs its input path (2f)
    return iter([(torch.randn(SHAPE, requires_grad=True), torch.zeros(())) for _ in range(m)])


def _rank_main(rank: int, world: int, args: argparse.Namespace) -> list:
    """One pipeline stage (gloo group joined by the launcher): its action records of the last step."""
    p, m, v = args.stages, args.microbatches, args.virtual_stages
    chunks = [SleepStage(args.forward_ms / 1e3 / v) for _ in range(v)]
    ex = PipelineExecutor(chunks, stage=rank, stage_ranks=list(range(p)), pp_group=AxisGroup.world(),
                          num_microbatches=m, activation_shape=SHAPE,
                          loss_fn=lambda out, _t: out.mean(), schedule=args.schedule)
    for _ in range(args.steps):
        dist.barrier()
        ex.train_batch(_data(m))
    return ex.records


def run(args: argparse.Namespace) -> dict:
    try:
        # strict NCCL-rules checks off: they add an all-gather per transfer to what is timed
        records = spawn(_rank_main, args.stages, (args,), timeout=300, env={"ENGINE_STRICT_COMM": "0"})
    except SpawnError as e:
        raise SystemExit(f"a rank failed: {e}") from None
    return _report(args, records)


def _report(args: argparse.Namespace, records) -> dict:
    p, m, v, name = args.stages, args.microbatches, args.virtual_stages, args.schedule
    try:
        analytic = bubble_formula(name, p, m, v)
    except ValueError:
        analytic = None  # zb-h1 with fewer microbatches than stages: no closed form
    # the simulator with this benchmark's costs: zb-h1's first stage has no input path to
    # split off (its inputs are data), so its weight pass is the whole 2f backward
    f = 1.0 / v
    split = name in ("zb-h1", *V_SCHEDULES)  # the schedules that split the backward
    first = cost_table(f, 2 * f, input_grad=1e-9 if split else None)
    rest = cost_table(f, 2 * f)

    def costs(rank, a):
        return (first if rank == 0 and a.chunk == 0 else rest)[a.kind.value]

    simulated = simulate(build_all(name, p, m, v), m, v, costs=costs, placement=placement_of(name)).bubble_fraction
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"bubble_{name}_p{p}_m{m}" + (f"_v{v}" if v > 1 else ""))
    write_chrome_trace(records, stem + ".trace.json", title=f"{name} p={p} m={m}")
    measured = measured_bubble(records)
    writer = write_gantt_png(records, stem + ".png",
                             title=f"{name}, p={p}, m={m}: measured bubble {measured:.3f}"
                                   + (f", analytic {analytic:.3f}" if analytic is not None else ""))
    t0 = min(r.start for recs in records for r in recs)
    t1 = max(r.end for recs in records for r in recs)
    return {"schedule": name, "stages": p, "microbatches": m, "virtual_stages": v,
            "forward_ms": args.forward_ms, "measured_bubble": round(measured, 4),
            "analytic_bubble": None if analytic is None else round(analytic, 4),
            "simulated_bubble": round(simulated, 4), "step_ms": round((t1 - t0) * 1e3, 1),
            "trace": stem + ".trace.json", "png": stem + ".png", "png_writer": writer}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    ap.add_argument("--virtual-stages", type=int, default=None,
                    help="model chunks per rank (interleaved-1f1b and zb-v; default 2 there, else 1)")
    ap.add_argument("--forward-ms", type=float, default=50.0, help="forward cost of one stage (backward is 2x)")
    ap.add_argument("--steps", type=int, default=2, help="steps to run; the last one is measured")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.virtual_stages is None:
        args.virtual_stages = 2 if args.schedule in ("interleaved-1f1b", *V_SCHEDULES) else 1
    if args.stages < 1 or args.microbatches < 1 or args.steps < 1 or args.forward_ms <= 0:
        ap.error("--stages, --microbatches and --steps must be >= 1 and --forward-ms > 0")
    build_all(args.schedule, args.stages, args.microbatches, args.virtual_stages)  # clear error early
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        analytic = "n/a" if result["analytic_bubble"] is None else f"{result['analytic_bubble']:.3f}"
        virtual = f" v={result['virtual_stages']}" if result["virtual_stages"] > 1 else ""
        print(f"{result['schedule']} p={result['stages']} m={result['microbatches']}{virtual}: "
              f"measured bubble {result['measured_bubble']:.3f}, analytic {analytic}, "
              f"simulated {result['simulated_bubble']:.3f} (step {result['step_ms']} ms)\n"
              f"trace: {result['trace']}\npng:   {result['png']} ({result['png_writer']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
