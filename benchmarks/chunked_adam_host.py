"""Host cost per chunk of :class:`engine.optim.ChunkedAdamW` (torch's AdamW stepped in
chunks), the figure that makes small chunks host-bound on a GPU.

    python3 benchmarks/chunked_adam_host.py [--numel 65536] [--chunks 1 16 256 4096] [--device cpu|cuda]

Steps one ``numel``-element parameter cut into each number of chunks and prints the time per
step and per chunk. With many tiny chunks the per-chunk time is the host's (Python and
kernel launches), which a GPU cannot hide: a 1B-element master in 1M-element chunks is ~1000
chunks per step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine.optim.chunked_adam import ChunkedAdamW  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=65536)
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 16, 256, 4096])
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    print("| chunks | chunk elements | ms/step | us/chunk |\n|---|---|---|---|")
    for k in args.chunks:
        w = torch.nn.Parameter(torch.zeros(args.numel, device=args.device))
        w.grad = torch.ones_like(w)
        opt = ChunkedAdamW([w], chunk_numel=max(1, args.numel // k), foreach=True)
        opt.step()  # state allocated
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.reps):
            opt.step()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / args.reps
        print(f"| {k} | {args.numel // k} | {dt * 1e3:.2f} | {dt / k * 1e6:.1f} |")


if __name__ == "__main__":
    main()
