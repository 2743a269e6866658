"""Context-parallel attention on CPU ranks: work balance, bytes sent and tokens/s per mode.

    python benchmarks/context_parallel.py [--seq 4096 --heads 4 --kv-heads 2 --head-dim 16
        --docs 28 --sizes 1,2,4 --reps 3 --out benchmarks/results/context_parallel_cpu.md]

For each mode at each CP size (C = 1 is one process; hybrid runs at C = 4 with U = 2) it
starts C gloo ranks and runs the attention of one long sequence (head-tail shards, causal,
and causal-document with ``--docs`` random documents, also in the document-balanced order)
forward + backward ``--reps`` times, and prints per configuration:

- work max/mean: unmasked (q, k) pairs x query heads per rank, counted exactly
  (:mod:`engine.context_parallel.balance`: ring/hybrid ranks do their own rows, Ulysses
  ranks H/U heads of their group's rows), and the same for the score entries the kernel
  computed after skipping hidden blocks (``computed``);
- bytes sent per rank in forward + backward, measured by counting what this rank hands to
  ``isend`` / ``all_to_all_single`` / ``all_gather`` (the part that leaves the rank), next
  to the formula of docs/context_parallel.md ("Communication");
- tokens/s of attention forward + backward: B S / (slowest rank's median time).

``--steps-peak`` measures instead, for the same modes and sizes, the activation peak per rank
of one whole training step of a small GPT (``--peak-seq`` tokens, hidden 64, 2 layers, 4
heads, fp32; ``memory.json``'s ``activation_peak_bytes``: the exact live-tensor high-water
mark of the step's forward + backward over what the rank held before,
engine/training/memory_probe.py) relative to CP 1's, and the step's tokens/s (the step with
the probe excluded); with ``--out`` it rewrites only the results file's "Whole training
steps" section.
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


def _layout(mode: str, cp: int, u: int, rank: int):  # type: ignore[no-untyped-def]
    """Ulysses groups: runs of u consecutive CP ranks; ring groups: one rank of each."""
    from engine.context_parallel import CPLayout
    from engine.distributed.groups import AxisGroup

    r = cp // u
    uly = [dist.new_group(list(range(j * u, (j + 1) * u))) if u > 1 else None for j in range(r)][rank // u]
    ring = [dist.new_group(list(range(i, cp, u))) if r > 1 else None for i in range(u)][rank % u]
    ring_g = AxisGroup.of(ring, "cp_ring") if ring is not None else (
        None if mode == "ulysses" else AxisGroup.single("cp_ring", rank))
    return CPLayout(mode, cp, rank, u, ring_g, AxisGroup.of(uly, "cp_ulysses") if uly is not None else None)


class _Bytes:
    """Counts the bytes this rank sends through engine.distributed.comm."""

    def __init__(self) -> None:
        from engine.distributed import comm

        self.sent = 0
        p2p, a2a, ag = comm.batch_isend_irecv, comm.all_to_all_single, comm.all_gather

        def batch(ops):  # type: ignore[no-untyped-def]
            self.sent += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
            return p2p(ops)

        def all_to_all(out, inp, out_splits, in_splits, group):  # type: ignore[no-untyped-def]
            self.sent += inp.numel() * inp.element_size() * (group.size - 1) // group.size
            return a2a(out, inp, out_splits, in_splits, group)

        def all_gather(out, inp, group, async_op=False):  # type: ignore[no-untyped-def]
            self.sent += inp.numel() * inp.element_size() * (group.size - 1)
            return ag(out, inp, group, async_op)

        comm.batch_isend_irecv, comm.all_to_all_single, comm.all_gather = batch, all_to_all, all_gather


def formula_bytes(b: int, s: int, h: int, nkv: int, d: int, cp: int, u: int, elem: int = 4) -> int:
    """Bytes one rank sends in forward + backward (docs/context_parallel.md, "Communication").
    Ulysses (U > 1), per a2a (U-1)/U of the tensor: q, k, v, o forward; dO, dq, dk, dv backward;
    positions/doc ids (int64) all-gathered: (U-1) B 2 S/C 8. Ring over R = C/U with blocks of
    U S/C tokens and nkv_u = nkv'/U KV heads: (R-1) (K, V + meta) forward, (R-1) (K, V + meta)
    + R fp32 dK, dV backward. nkv' = lcm(nkv, U) (KV heads replicated when U does not divide)."""
    import math

    sl, r = s // cp, cp // u
    kvh = nkv if nkv % u == 0 else math.lcm(nkv, u)
    total = 0
    if u > 1:
        per = b * sl * d * elem * (u - 1) // u
        total += 2 * per * (2 * h + 2 * kvh)                     # fwd q, k, v, o; bwd do, dq, dk, dv
        total += (u - 1) * b * 2 * sl * 8
    if r > 1:
        blk_tokens, heads = u * sl, kvh // u
        kv = 2 * b * heads * blk_tokens * d * elem + b * 2 * blk_tokens * 8
        total += 2 * (r - 1) * kv + r * 2 * b * heads * blk_tokens * d * 4
    return total


def _work(layout, rows: list[torch.Tensor], doc, h: int) -> int:  # type: ignore[no-untyped-def]
    """Unmasked pairs x query heads this rank computes: its rows (ring/hybrid: its own,
    Ulysses: its group's, H/U heads)."""
    from engine.context_parallel.balance import token_work

    s = rows[0].numel() * layout.size
    u = layout.ulysses_size
    total = 0
    for bi, own in enumerate(rows):
        w = token_work(s, None if doc is None else doc[bi])
        total += int(w[own].sum()) * h
    if u > 1:  # Ulysses: the group's rows, H/U heads each: the group's mean
        t = torch.tensor([float(total)], device=torch.device("cpu"))  # gloo ranks
        assert layout.ulysses is not None
        dist.all_reduce(t, group=layout.ulysses.process_group)
        total = int(t.item()) // u
    return total


def _rank_main(args, mode: str, cp: int, u: int, order: str):  # type: ignore[no-untyped-def]
    from engine.context_parallel import head_tail_indices
    from engine.context_parallel.attention import context_parallel_attention
    from engine.context_parallel.sharding import balanced_document_indices
    from engine.distributed.env import init_distributed, shutdown

    env = init_distributed(timeout_s=600, backend="gloo", device="cpu")
    rank = env.rank
    layout = _layout(mode, cp, u, rank)
    counter = _Bytes()
    b, s, h, nkv, d = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    g = torch.Generator().manual_seed(0)
    doc = None
    if order != "causal":
        cuts = torch.stack([torch.randperm(s - 1, generator=g)[:args.docs - 1] + 1 for _ in range(b)])
        doc = torch.zeros(b, s, dtype=torch.long).scatter_(1, cuts, 1).cumsum(1)
    rows = [balanced_document_indices(doc[i], cp, rank) if order == "doc-balanced" and doc is not None
            else head_tail_indices(s, cp, rank) for i in range(b)]
    pos = torch.stack(rows)
    q, k, v = (torch.randn(b, n, s // cp, d, generator=g).requires_grad_() for n in (h, nkv, nkv))
    docs_l = None if doc is None else torch.stack([doc[i][rows[i]] for i in range(b)])
    times, stats = [], {}
    for _ in range(args.reps + 1):
        stats = {}
        dist.barrier()
        sent0 = counter.sent
        t0 = time.perf_counter()
        o = context_parallel_attention(q, k, v, layout, positions=pos, doc_ids=docs_l, stats=stats)
        o.backward(torch.ones_like(o))
        times.append(time.perf_counter() - t0)
        sent = counter.sent - sent0
    dist.barrier()
    out = {"time": median(times[1:]), "sent": sent, "work": _work(layout, rows, doc, h),
           "computed": stats["pairs_computed"]}
    del layout, q, k, v, o  # drop the group handles before shutdown joins gloo's threads
    shutdown()
    return out


def _step_peak_main(args, mode: str, cp: int, u: int):  # type: ignore[no-untyped-def]
    """Whole training steps of the small GPT at this layout: (activation peak bytes of the
    second step, seconds of the third)."""
    import engine
    from engine.distributed.env import init_distributed, shutdown
    from engine.training.memory_probe import memory_probe

    env = init_distributed(timeout_s=600, backend="gloo", device="cpu")
    s = args.peak_seq
    cp_section = {"size": cp, "mode": mode} if cp > 1 else {"size": 1}
    if mode == "hybrid":
        cp_section["ulysses_size"] = u
    cfg = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "seed": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "context_parallel": cp_section,
           "model": {"vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 4,
                     "seq_len": s}}
    eng, *_ = engine.initialize(config=cfg, dist_env=env)
    ids = torch.randint(0, 256, (1, s + 1), generator=torch.Generator().manual_seed(0))
    batch = (ids[:, :-1], ids[:, 1:])                                  # the whole row on every CP rank
    eng.train_batch(iter([batch]))                                     # lazily made state exists after it
    with memory_probe(eng, True):
        eng.train_batch(iter([batch]))
    dist.barrier()
    t0 = time.perf_counter()
    eng.train_batch(iter([batch]))
    seconds = time.perf_counter() - t0
    peak = eng.activation_peak_bytes
    eng.destroy()
    del eng
    shutdown()
    return peak, seconds


def steps_peak(args: argparse.Namespace, sizes: set[int]) -> list[dict]:
    """The ``--steps-peak`` table (module docstring)."""
    table: list[dict] = []
    base = None
    for mode, cp, u in CONFIGS:
        if cp not in sizes and cp != 1:
            continue
        res = launch(_step_peak_main, cp, args, mode, cp, u, timeout=3600)
        peak = max(r[0] for r in res)
        base = peak if cp == 1 else base
        row = {"mode": mode if cp > 1 else "one process", "C": cp, "U": u,
               "activation peak MB/rank (max)": peak / 2**20,
               "vs CP 1": peak / base if base else float("nan"),
               "ranks' peaks MB": " ".join(f"{r[0] / 2**20:.3f}" for r in res),
               "step s": max(r[1] for r in res), "tokens/s": args.peak_seq / max(r[1] for r in res)}
        table.append(row)
        print(row, flush=True)
    return table


CONFIGS = [("ring", 1, 1), ("ring", 2, 1), ("ulysses", 2, 2), ("ring", 4, 1), ("ulysses", 4, 4), ("hybrid", 4, 2)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--docs", type=int, default=28)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--sizes", default="1,2,4")
    p.add_argument("--orders", default="causal,doc,doc-balanced")
    p.add_argument("--out", default="")
    p.add_argument("--steps-peak", action="store_true",
                   help="whole training steps: activation peak per rank vs CP 1 (module docstring)")
    p.add_argument("--peak-seq", type=int, default=1024)
    args = p.parse_args()
    sizes = {int(x) for x in args.sizes.split(",")}
    if args.steps_peak:
        text = render(steps_peak(args, sizes))
        print(text)
        if args.out:
            _write_steps(args, text)
        return
    table = []
    for order in args.orders.split(","):
        for mode, cp, u in CONFIGS:
            if cp not in sizes:
                continue
            res = launch(_rank_main, cp, args, mode, cp, u, order, timeout=3600)
            work, comp = [r["work"] for r in res], [r["computed"] for r in res]
            row = {"mask/order": order, "mode": mode if cp > 1 else "one process", "C": cp, "U": u,
                   "work max/mean": max(work) * cp / sum(work), "computed max/mean": max(comp) * cp / sum(comp),
                   "computed/unmasked": sum(comp) / sum(work),
                   "MB sent/rank": max(r["sent"] for r in res) / 2**20,
                   "formula MB": formula_bytes(args.batch, args.seq, args.heads, args.kv_heads, args.head_dim,
                                               cp, u) / 2**20,
                   "fwd+bwd s": max(r["time"] for r in res),
                   "tokens/s": args.batch * args.seq / max(r["time"] for r in res)}
            table.append(row)
            print(row, flush=True)
    text = render(table)
    print(text)
    if args.out:
        _write(args, text)


RATIOS = ("work max/mean", "computed max/mean", "computed/unmasked", "MB sent/rank", "formula MB",
          "activation peak MB/rank (max)", "vs CP 1")
STEPS_HEADING = "\n## Whole training steps\n"


def render(table: list[dict]) -> str:
    """The markdown table, ratios and MB with 3 decimals (1.0 vs 1.02 matters here)."""
    rows = [{k: f"{v:.3f}" if k in RATIOS else v for k, v in r.items()} for r in table]
    return markdown_table(rows, list(table[0]))


def _write(args: argparse.Namespace, table: str) -> None:
    m = machine_description()
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(f"# Context-parallel attention on CPU ranks ({time.strftime('%Y-%m-%d')})\n\n")
        f.write(f"`python benchmarks/context_parallel.py --seq {args.seq} --heads {args.heads} --kv-heads "
                f"{args.kv_heads} --head-dim {args.head_dim} --docs {args.docs} --reps {args.reps} "
                f"--out {args.out}`\n\n")
        f.write(f"Machine: {m}. Gloo ranks, one thread each, fp32, batch {args.batch}.\n\n")
        f.write("## Attention (this benchmark)\n\n" + table + "\n\n")
        f.write(NOTES)
        f.write(STEPS_HEADING + "\nNot measured in this run: `--steps-peak` writes this section.\n")


def _write_steps(args: argparse.Namespace, table: str) -> None:
    """Replace the "Whole training steps" section of ``args.out`` (kept: the attention part)."""
    head = ""
    if os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as f:
            head = f.read().split(STEPS_HEADING)[0]
    m = machine_description()
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(head + STEPS_HEADING + "\n")
        f.write(f"`python benchmarks/context_parallel.py --steps-peak --peak-seq {args.peak_seq} --sizes {args.sizes} "
                f"--out {args.out}` ({time.strftime('%Y-%m-%d')})\n\n")
        f.write(f"Machine: {m}. A GPT of hidden 64, 2 layers, 4 heads (4 KV heads), vocab 256, "
                f"{args.peak_seq} tokens, batch 1, fp32, AdamW, no ZeRO; gloo ranks, one thread each.\n\n")
        f.write(table + "\n\n" + STEPS_NOTES)


STEPS_NOTES = """- activation peak: `memory.json`'s `activation_peak_bytes` of the step (the second; the
  exact high-water mark of tensor bytes allocated in its forward + backward over what the rank
  held before it: activations, gradients being produced, communication buffers); max over the
  ranks, and each rank's. The floor at CP 4 is the one-process model on S/4 tokens (0.279 of
  CP 1 at 1,024 tokens, tests/distributed/test_cp_train.py); what a mode adds above it is what
  its attention keeps of the other ranks' tokens and its buffers (docs/context_parallel.md,
  "Memory").
- step s / tokens/s: one step without the probe (the third); C ranks share the 2 cores here.
"""


NOTES = """Reading the table:
- work max/mean: exact unmasked (q, k) pairs x heads per rank; 1.00 for the causal mask with
  head-tail shards; with documents head-tail is off and the document-balanced order
  (`balanced_document_indices`) brings it back to ~1.00.
- computed: score entries actually computed after skipping fully hidden (q chunk, k chunk)
  pairs by position and document ranges; computed/unmasked > 1 is the masked part inside
  the blocks that are computed (half-diagonal blocks, documents cut by chunks).
- MB sent/rank: measured bytes handed to isend / all-to-all / all-gather, forward +
  backward; the formula column is `formula_bytes` (docs/context_parallel.md). The ring's
  dK/dV travel in fp32.
- tokens/s: on this shared 2-core machine C ranks share 2 cores, so tokens/s does not scale
  with C here; it shows the overhead of each mode, not the speed-up a GPU per rank gives.
  Other jobs ran at the same time (see the load average above), so the times are noisy
  (two repetitions after a warm-up, median per rank, slowest rank).
"""


if __name__ == "__main__":
    main()
