"""Synchronous vs asynchronous checkpoints: how long the training loop is blocked, and the
host memory the asynchronous save costs.

    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/async_checkpoint.py            # ~29M parameters, DP 2

For each mode (a fresh pair of ranks each, ZeRO-1, fp32, CPU/gloo or CUDA/NCCL) the reference
GPT trains ``--steps`` steps through the entry point's :class:`Checkpointer`, saving every
``--interval`` steps; the per-step ``save_blocked_s`` it reports is what ``metrics.jsonl``
carries (synchronous: the whole save; asynchronous: the snapshot into host buffers plus any
wait for the previous save). Also reported: the background write time (``save_write_s``),
the step time of steps without a save (the writer thread competes for the CPU), and the
resident-set growth of each rank from before its first save to the end, against the bytes
the rank writes (its shard: fp32 masters and the AdamW moments it owns).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import ROOT, launch, machine_description, markdown_table  # noqa: E402

MMAP_THRESHOLD = "131072"  # glibc's: freed tensors go back to the OS, so the RSS is what is live


def config(a: dict) -> dict:
    return {
        "train_batch_size": a["batch"] * 2, "train_micro_batch_size_per_gpu": a["batch"], "seed": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "model": {"vocab_size": a["vocab"], "hidden_size": a["hidden"], "num_layers": a["layers"], "num_heads": 8,
                  "seq_len": a["seq"]},
        "checkpoint": {"async_save": a["mode"] == "async"},
    }


def _shard_bytes(eng) -> int:
    """The bytes this rank writes: its fp32 master shards and element-wise optimizer state."""
    view = eng.optimizer.shard_view()
    total = 0
    for gi, grp in enumerate(view.groups):
        if grp.owner:
            st = view.group_state(gi)
            total += sum(t.numel() * t.element_size() for t in [st.master, *st.elementwise.values()])
    return total


def _rank(a: dict) -> dict:
    import torch

    import engine
    from engine.checkpoint.preempt import Checkpointer
    from engine.distributed.env import init_distributed, shutdown
    from engine.metrics import current_memory_bytes

    env = init_distributed(timeout_s=1200)
    eng, *_ = engine.initialize(config=config(a), dist_env=env)
    cpu, m = torch.device("cpu"), a
    g = torch.Generator().manual_seed(env.rank)
    saver = eng.checkpoint_saver() if a["mode"] == "async" else None
    rows, rss, shard = [], {}, 0
    with Checkpointer(eng, a["dir"], a["interval"], saver=saver) as ckpt:
        for s in range(a["steps"]):
            ids = torch.randint(0, m["vocab"], (m["batch"], m["seq"] + 1), generator=g)
            t0 = time.perf_counter()
            eng.train_batch(iter([(ids[:, :-1], ids[:, 1:])]))
            step_s = time.perf_counter() - t0
            if s + 1 == a["interval"]:  # before the first save; the moments exist after the first step
                shard = _shard_bytes(eng)
                gc.collect()
                rss["before"] = current_memory_bytes(cpu)
            ckpt.after_step()
            rows.append({"step": s + 1, "step_s": step_s, **ckpt.step_metrics})
        ckpt.finish()
    gc.collect()
    rss["after"] = current_memory_bytes(cpu)
    out = {"rank": env.rank, "rows": rows, "shard_bytes": shard, "rss": rss,
           "buffers": saver.buffers.nbytes if saver is not None else 0,
           "params": sum(p.numel() for p in eng.module.parameters())}
    eng.destroy()
    del eng, ckpt, saver  # the saver and the Checkpointer hold the engine, which holds the groups
    gc.collect()
    shutdown()
    return out


def summarise(mode: str, ranks: list[dict]) -> dict:
    saved = [r for rk in ranks for r in rk["rows"] if "save_blocked_s" in r]
    writes = [r["save_write_s"] for rk in ranks for r in rk["rows"] if "save_write_s" in r]
    plain = [r["step_s"] for rk in ranks for r in rk["rows"] if "save_blocked_s" not in r and r["step"] > 1]
    growth = [(rk["rss"]["after"] - rk["rss"]["before"]) / rk["shard_bytes"] for rk in ranks]
    return {"mode": mode, "saves": len(saved) // len(ranks),
            "mean save_blocked_s": statistics.mean(r["save_blocked_s"] for r in saved),
            "max save_blocked_s": max(r["save_blocked_s"] for r in saved),
            "mean save_write_s": statistics.mean(writes) if writes else float("nan"),
            "median step_s (no save)": statistics.median(plain) if plain else float("nan"),
            "shard MB/rank": ranks[0]["shard_bytes"] / 2**20,
            "RSS growth / shard (max rank)": max(growth)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for k, v in (("hidden", 512), ("layers", 8), ("vocab", 8192), ("seq", 64), ("batch", 2), ("steps", 13),
                 ("interval", 3), ("threads", 1)):
        p.add_argument(f"--{k}", type=int, default=v)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    a = vars(p.parse_args())
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD  # inherited by the spawned ranks
    results, params = [], 0
    for mode in ("sync", "async"):
        with tempfile.TemporaryDirectory(dir=a["out"]) as d:
            ranks = launch(_rank, 2, {**a, "mode": mode, "dir": d}, threads=a["threads"], timeout=3000)
        params = ranks[0]["params"]
        results.append(summarise(mode, ranks))
    ratio = results[1]["mean save_blocked_s"] / results[0]["mean save_blocked_s"]
    cols = list(results[0])
    args = " ".join(f"--{k} {v}" for k, v in a.items() if k != "out")
    text = (f"# Asynchronous vs synchronous checkpoints (DP 2, ZeRO-1, fp32, {params / 1e6:.1f}M parameters)\n\n"
            f"`MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']} python benchmarks/async_checkpoint.py "
            f"{args}`\n\n{markdown_table(results, cols)}\n\n"
            f"async / sync mean save_blocked_s: **{ratio:.3f}**\n\nMachine: {machine_description()}\n")
    print(text)
    os.makedirs(a["out"], exist_ok=True)
    name = f"async_checkpoint_{datetime.date.today().isoformat()}.md"
    with open(os.path.join(a["out"], name), "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main()
