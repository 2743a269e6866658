"""Mixture of experts on CPU ranks: tokens/s and all-to-all bytes per rank at EP 1, 2, 4 next
to a dense MLP of the same active parameters, and the load-imbalance curve of training with
and without aux-free balancing.

    python benchmarks/moe.py [--hidden 256 --experts 8 --top-k 2 --ffn 256 --tokens 2048
        --sizes 1,2,4 --reps 5 --steps 30 --out benchmarks/results/moe_cpu.md]

1. Layer: each of EP gloo ranks holds ``--tokens`` tokens (B = 1 sequence) and E/EP experts;
   forward + backward of the MoE layer (dropless, top-k) is timed ``--reps`` times (median,
   slowest rank), next to the dense SwiGLU of inner size ``top_k * ffn`` (the same active
   parameters per token) on the same tokens. Bytes: what this rank hands to the token
   all-to-alls (rows for OTHER ranks x H x 4 bytes, dispatch + combine, forward + backward),
   counted at the call, next to the expectation ``4 * T * K * H * 4 * (EP-1)/EP`` bytes under
   uniform routing.
2. Balance: the tiny reference GPT with ``model.moe`` (top-1 of 8 experts, so collapse is
   possible) trained ``--steps`` steps in one process with load_balancing "none", "aux_free"
   and "aux_loss"; ``moe_load_imbalance`` (max/mean tokens per expert, worst layer) per step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import launch, machine_description, markdown_table, median  # noqa: E402


def _model_cfg(args: argparse.Namespace, **moe):  # type: ignore[no-untyped-def]
    from engine.models.config import ModelConfig

    spec = {"num_experts": args.experts, "expert_hidden_size": args.ffn, "top_k": args.top_k, **moe}
    return ModelConfig(vocab_size=256, hidden_size=args.hidden, num_layers=2, num_heads=4, seq_len=args.tokens,
                       moe=spec)


def _layer_rank(args: argparse.Namespace, ep: int) -> dict:
    from engine.distributed import comm
    from engine.distributed.env import init_distributed, shutdown
    from engine.distributed.groups import AxisGroup
    from engine.models.blocks import SwiGLU
    from engine.moe import dispatch
    from engine.moe.context import MoEContext
    from engine.moe.layer import MoELayer

    env = init_distributed(timeout_s=600, backend="gloo", device="cpu")
    group = AxisGroup.world() if ep > 1 else AxisGroup.single("ep")
    sent = [0]
    real = comm.all_to_all_single

    def counting(out, inp, out_splits, in_splits, g):  # type: ignore[no-untyped-def]
        if inp.dim() == 2 and inp.shape[1] == args.hidden:  # token rows (not the counts)
            off = sum(n for r, n in enumerate(in_splits) if r != g.rank)
            sent[0] += off * inp.shape[1] * inp.element_size()
        return real(out, inp, out_splits, in_splits, g)

    dispatch.comm.all_to_all_single = counting  # type: ignore[assignment]
    cfg = _model_cfg(args)
    assert cfg.moe is not None
    layer = MoELayer(cfg, cfg.moe, 0, 1234, MoEContext(ep_group=group)).train()
    dense = SwiGLU(cfg.__class__(**{**cfg.to_dict(), "moe": None, "ffn_hidden_size": args.top_k * args.ffn}),
                   0, AxisGroup.single("tp"), False, 1234)
    x = torch.randn(1, args.tokens, args.hidden, generator=torch.Generator().manual_seed(env.rank))
    out: dict = {}
    for name, mod in (("moe", layer), ("dense", dense)):
        times = []
        for _ in range(args.reps + 1):
            dist.barrier()
            sent[0] = 0
            t0 = time.perf_counter()
            y = mod(x.clone().requires_grad_(True))
            y.sum().backward()
            times.append(time.perf_counter() - t0)
        out[name] = median(times[1:])
        out[f"{name}_sent"] = sent[0]
    dispatch.comm.all_to_all_single = real  # type: ignore[assignment]
    del layer, dense, group  # the layer's EP group holds the default group: drop it before shutdown
    shutdown()
    return out


def layer_table(args: argparse.Namespace) -> list[dict]:
    rows = []
    for ep in args.sizes:
        per_rank = launch(_layer_rank, ep, args, ep)
        t_moe, t_dense = max(r["moe"] for r in per_rank), max(r["dense"] for r in per_rank)
        expect = 4 * args.tokens * args.top_k * args.hidden * 4 * (ep - 1) / ep
        rows.append({"EP": ep, "MoE tokens/s per rank": args.tokens / t_moe,
                     "dense tokens/s per rank": args.tokens / t_dense, "MoE / dense time": t_moe / t_dense,
                     "all-to-all MB sent per rank": max(r["moe_sent"] for r in per_rank) / 1e6,
                     "uniform-routing MB": expect / 1e6})
    return rows


def balance_curves(args: argparse.Namespace) -> dict[str, list[float]]:
    import engine
    from engine.config import load_config
    from engine.distributed.spawn import free_port
    from engine.training.trainer import build_data, train

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    std = os.path.dirname(os.__file__)
    curves = {}
    for mode in ("none", "aux_free", "aux_loss"):
        cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "seed": 3,
               "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
               "model": {"vocab_size": 256, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "seq_len": 32,
                         "moe": {"num_experts": 8, "top_k": 1, "expert_hidden_size": 32, "load_balancing": mode,
                                 "aux_loss_coef": 0.01}},
               "data": {"train_files": [os.path.join(std, "textwrap.py"), os.path.join(std, "argparse.py")],
                        "cache_dir": os.path.join(args.cache, "moe_bench")}}
        c = load_config(cfg, world_size=1)
        _, sampler = build_data(c)
        eng, *_ = engine.initialize(config=c)
        curves[mode] = [r["moe_load_imbalance"] for r in train(eng, sampler, args.steps, output_dir=None)]
        eng.destroy()
    return curves


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--cache", default=os.path.join(ROOT, ".cache"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = layer_table(args)
    table = markdown_table(rows, list(rows[0]))
    curves = balance_curves(args) if args.steps > 0 else {}
    steps = list(range(1, args.steps + 1))
    curve_rows = [{"step": s, **{m: c[s - 1] for m, c in curves.items()}} for s in steps]
    text = (f"# MoE on CPU ranks\n\n`python benchmarks/moe.py {' '.join(argv or sys.argv[1:])}`\n\n"
            f"Machine: {machine_description()}\n\n## Layer forward + backward (H {args.hidden}, E {args.experts}, "
            f"top-{args.top_k}, F {args.ffn}, {args.tokens} tokens per rank)\n\n{table}\n\n"
            f"## moe_load_imbalance per training step (top-1 of 8 experts)\n\n"
            + (markdown_table(curve_rows, ["step", *curves]) if curves else "(skipped)") + "\n")
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
