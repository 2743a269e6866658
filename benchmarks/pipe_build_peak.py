#!/usr/bin/env python
"""Per-rank peak tensor memory while a DeepSpeed-style ``PipelineModule`` is constructed.

    PYTHONPATH=. python benchmarks/pipe_build_peak.py --stages 2 --layers 8 --width 64 --json

``--stages`` ranks (gloo, CPU) each construct ``PipelineModule([LayerSpec(nn.Linear, width,
width)] * layers, num_stages=stages, partition_method=...)`` under
:class:`engine.zero.peak.LiveMemoryTracker` (exact live storage bytes) and report the peak,
the bytes of the stage they keep, one layer's bytes and the whole model's. A rank that builds
only its stage (one foreign layer at a time, for the RNG stream) peaks at most at its stage
plus one layer; a build of every layer peaks at the whole model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from engine.distributed.spawn import spawn  # noqa: E402


def _rank_main(rank: int, world: int, args: argparse.Namespace) -> dict:
    from engine.pipe import LayerSpec, PipelineModule
    from engine.zero.peak import LiveMemoryTracker

    torch.manual_seed(0)
    with LiveMemoryTracker() as t:
        net = PipelineModule([LayerSpec(nn.Linear, args.width, args.width) for _ in range(args.layers)],
                             num_stages=args.stages, partition_method=args.method)
    layer = (args.width * args.width + args.width) * 4
    return {"rank": rank, "peak": t.peak, "stage": sum(p.numel() * p.element_size() for p in net.parameters()),
            "layer": layer, "whole": layer * args.layers}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--method", default="parameters")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    ranks = spawn(_rank_main, args.stages, (args,), timeout=300)
    if args.json:
        print(json.dumps({"args": vars(args), "ranks": ranks}))
    else:
        for r in ranks:
            print(f"rank {r['rank']}: peak {r['peak']} B  stage {r['stage']} B  one layer {r['layer']} B  "
                  f"whole model {r['whole']} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
