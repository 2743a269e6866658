#!/usr/bin/env python
"""Per-rank peak ACTIVATION memory of a pipeline step, measured, for several schedules.

    PYTHONPATH=. python benchmarks/pipeline_memory.py --stages 4 --microbatches 8 --schedules 1f1b zb-v --json

Each schedule runs in fresh processes (``--stages`` ranks on gloo, CPU): the reference GPT
(``--hidden``, ``--layers`` blocks, ``--vocab``, ``--seq``; micro-batch ``--micro``) built
by ``engine.initialize`` with ``pipeline.schedule`` set, one warm-up step, then one measured
step under :class:`engine.zero.peak.LiveMemoryTracker` (the exact live-tensor high-water
mark). What is reported per rank: ``activation_peak`` = the peak of the bytes the step's
forward/backward (the executor's whole schedule) allocates and holds at once, storages
alive before it (parameters, gradient buffers, optimizer state) not counted: what the schedule holds
in flight: saved activations, stage outputs and received tensors, the split backward's
captured gradients (zb-h1 / zb-v) and the loss head's logits. ``predicted_chunks`` is the
simulator's peak of micro-batch chunks held on that rank (forward done, weight gradient
not yet).

Same model, same micro-batches: 1F1B cuts it into ``p`` pieces, zb-v into ``2p`` (two per
rank, V placement), so a zb-v chunk activation is half a 1F1B stage activation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from engine.distributed.spawn import SpawnError, spawn  # noqa: E402
from engine.pipeline.schedule import SCHEDULES, V_SCHEDULES, build_all, placement_of  # noqa: E402
from engine.pipeline.simulate import simulate  # noqa: E402


def _config(args: argparse.Namespace, schedule: str) -> dict:
    v = 2 if schedule in ("interleaved-1f1b", *V_SCHEDULES) else 1
    return {
        "train_batch_size": args.micro * args.microbatches, "train_micro_batch_size_per_gpu": args.micro,
        "seed": 3, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 0},
        "pipeline": {"stages": args.stages, "partition": args.partition, "schedule": schedule, "virtual_stages": v},
        "model": {"vocab_size": args.vocab, "hidden_size": args.hidden, "num_layers": args.layers,
                  "num_heads": 4, "seq_len": args.seq},
    }


def _rank_main(rank: int, world: int, args: argparse.Namespace, schedule: str) -> dict:
    import engine
    from engine.zero.peak import LiveMemoryTracker

    eng, *_ = engine.initialize(config=_config(args, schedule))
    g = torch.Generator().manual_seed(0)
    mbs = [(torch.randint(0, args.vocab, (args.micro, args.seq), generator=g),
            torch.randint(0, args.vocab, (args.micro, args.seq), generator=g)) for _ in range(args.microbatches)]
    eng.train_batch(iter(mbs))  # warm-up: optimizer state exists from here on
    # storages that exist before the step (weights, gradient buffers, optimizer state) are not
    # tracked: the peak is what the step allocates and holds at once
    with LiveMemoryTracker(device="cpu") as tracker:
        eng.pipeline.train(mbs)  # the schedule only: forward, backward, gradient accumulation
    peak = tracker.peak
    eng.optimizer.zero_grad()
    eng.destroy()
    return {"rank": rank, "activation_peak": peak}


def run(args: argparse.Namespace) -> dict:
    out = {}
    for schedule in args.schedules:
        v = 2 if schedule in ("interleaved-1f1b", *V_SCHEDULES) else 1
        sim = simulate(build_all(schedule, args.stages, args.microbatches, v), args.microbatches, v,
                       placement=placement_of(schedule))
        try:
            ranks = spawn(_rank_main, args.stages, (args, schedule), timeout=600,
                          env={"ENGINE_STRICT_COMM": "0"})
        except SpawnError as e:
            raise SystemExit(f"a rank failed: {e}") from None
        out[schedule] = [dict(r, predicted_chunks=sim.peak_activations[r["rank"]]) for r in ranks]
    return {"stages": args.stages, "microbatches": args.microbatches, "micro": args.micro, "seq": args.seq,
            "partition": args.partition,
            "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "schedules": out}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=["1f1b", "zb-v"])
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=6, help="blocks (zb-v at p stages needs 2p pieces)")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--partition", default="uniform", choices=["uniform", "blocks", "parameters"],
                    help="pipeline.partition: 'blocks' with --layers 2p gives every zb-v chunk one block and "
                         "every 1F1B stage two (equal pieces, the ZB paper's comparison)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    res = run(args)
    if args.json:
        print(json.dumps(res))
        return 0
    for name, ranks in res["schedules"].items():
        cells = ", ".join(f"rank {r['rank']}: {r['activation_peak'] / 2 ** 20:.2f} MiB ({r['predicted_chunks']} chunks)"
                          for r in ranks)
        print(f"{name}: {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
