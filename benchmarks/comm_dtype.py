"""``communication_data_type``: bytes per step and loss drift of bf16 / fp16 gradient
reductions against fp32, at ZeRO stages 0-3.

    python3 benchmarks/comm_dtype.py --steps 50 --nproc 2 [--stages 0 1 2 3] [--precision fp32]

Each rank trains the reference GPT (a small one: ``--hidden``, ``--layers``) from the same
seed on the same data once per (stage, communication dtype) and counts the bytes the ZeRO
gradient reductions hand to their collectives. Prints a markdown table: bytes per step,
their ratio to fp32's, and the loss drift (max and final |loss - fp32 loss| / fp32 loss over
the steps). The data are learnable synthetic rows (arithmetic sequences mod the vocabulary),
so the loss falls and the drift is that of a model that trains. Runs on CPU (gloo) or on
GPUs (NCCL, one per rank).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from common import launch, markdown_table  # noqa: E402


class _Counting:
    """The ``comm`` module as the ZeRO buckets see it, counting gradient-reduction bytes."""

    def __init__(self, real, sent: list) -> None:
        self._real, self._sent = real, sent

    def __getattr__(self, name):
        return getattr(self._real, name)

    def reduce_scatter(self, out, inp, group, **kw):
        self._sent.append(inp.numel() * inp.element_size())
        return self._real.reduce_scatter(out, inp, group, **kw)

    def all_reduce(self, t, group, **kw):
        self._sent.append(t.numel() * t.element_size())
        return self._real.all_reduce(t, group, **kw)


def _config(args, stage: int, comm: str) -> dict:
    c = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "seed": 11,
         "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
         "zero_optimization": {"stage": stage, "reduce_bucket_size": 200_000},
         "communication_data_type": comm,
         "model": {"vocab_size": 512, "hidden_size": args.hidden, "num_layers": args.layers, "num_heads": 4,
                   "seq_len": 64}}
    if args.precision != "fp32":
        c[args.precision] = {"enabled": True}
    return c


def _rank(args) -> dict:
    import engine
    import engine.zero.buckets as zb
    import engine.zero.stage0 as z0
    from engine.distributed.env import init_distributed

    env = init_distributed()
    sent: list = []
    zb.comm = z0.comm = _Counting(zb.comm, sent)
    out = {}
    for stage in args.stages:
        for comm in args.dtypes:
            sent.clear()
            eng, *_ = engine.initialize(config=_config(args, stage, comm))
            dp, rank = eng.groups.dp_size, eng.groups.dp_rank
            losses = []
            for s in range(args.steps):
                # learnable rows: a random start, then +1 (mod V) or +7 by row parity, so the loss falls
                g = torch.Generator().manual_seed(1000 * s)
                start = torch.randint(0, 512, (dp * 4, 1), generator=g)
                stride = 1 + 6 * (torch.arange(dp * 4).view(-1, 1) % 2)
                ids = ((start + stride * torch.arange(65)) % 512)[rank * 4:(rank + 1) * 4].to(env.device)
                mbs = [(ids[i:i + 2, :-1], ids[i:i + 2, 1:]) for i in (0, 2)]
                losses.append(eng.train_batch(iter(mbs)).item())
            eng.destroy()
            out[(stage, comm)] = {"losses": losses, "bytes_per_step": sum(sent) / args.steps}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "fp16"])
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="the model's compute dtype")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    if "fp32" not in args.dtypes:
        args.dtypes = ["fp32"] + args.dtypes
    r = launch(_rank, args.nproc, args)[0]
    rows = []
    cols = ["stage", "communication_data_type", "MB/step", "vs fp32", "max rel drift", "final rel drift",
            "loss[0]", f"loss[{args.steps - 1}]"]
    for stage in args.stages:
        ref = r[(stage, "fp32")]
        for comm in args.dtypes:
            got = r[(stage, comm)]
            drift = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]
            rows.append(dict(zip(cols, [stage, comm, f"{got['bytes_per_step'] / 1e6:.3f}",
                                        f"{got['bytes_per_step'] / ref['bytes_per_step']:.3f}", f"{max(drift):.2e}",
                                        f"{drift[-1]:.2e}", f"{got['losses'][0]:.4f}", f"{got['losses'][-1]:.4f}"])))
    print(markdown_table(rows, cols))


if __name__ == "__main__":
    main()
