"""Tokens/s of a Hugging Face Llama trained three ways on the same 2 ranks, in one run:

- ``autotp``: this engine, ``tensor_parallel.autotp_size = 2`` (AutoTP, DP 1, ZeRO-1);
- ``dp``: this engine, TP 1 x DP 2 (ZeRO-1), the same global batch split over the ranks;
- ``dtensor``: PyTorch's DTensor tensor parallelism (``parallelize_module`` with
  ``ColwiseParallel`` on q/k/v/gate/up and ``RowwiseParallel`` on o/down) on the same model,
  with ``torch.optim.AdamW`` (foreach) and ``clip_grad_norm_``.

Every variant starts from the same weights and runs fp32 AdamW with clipping; the first
step's losses are checked equal (1e-4) before anything is timed. Timing: ``--reps``
rounds, each running ``--steps`` optimizer steps of every variant in turn (interleaved so
machine noise hits all three alike); the table gives the median tokens/s over the rounds
and the ratio to DTensor. On a shared machine compare the ratios, not the absolute figures.

    python benchmarks/autotp.py [--hidden 256 --layers 4 --seq 128 --batch 8 --steps 3 --reps 5]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import ROOT, launch, machine_description, markdown_table, median, write_json  # noqa: E402

LR, CLIP = 1e-4, 1.0


def _model(a: dict[str, Any]):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=a["vocab"], hidden_size=a["hidden"], num_hidden_layers=a["layers"],
                         num_attention_heads=a["heads"], num_key_value_heads=a["heads"] // 2,
                         intermediate_size=4 * a["hidden"], max_position_embeddings=a["seq"],
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg).float()


def _batch(a: dict[str, Any], step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, a["vocab"], (a["batch"], a["seq"]), generator=g)


def _engine(a: dict[str, Any], tp: int, env: Any):
    import engine

    micro = a["batch"] // (2 // tp)
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
           "train_batch_size": a["batch"], "gradient_clipping": CLIP, "seed": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
           "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": tp}}
    eng, *_ = engine.initialize(model=_model(a), config=cfg, dist_env=env)
    rank = eng.groups.dp_rank

    def step(s: int) -> float:
        ids = _batch(a, s)[rank * micro:(rank + 1) * micro]
        out = eng(input_ids=ids, labels=ids)
        eng.backward(out.loss)
        eng.step()
        return out.loss.item()
    return step


def _clip(params: list[torch.nn.Parameter]) -> None:
    """clip_grad_norm_ over a mix of DTensor (sharded) and plain (replicated) gradients,
    which torch's own refuses to mix: the two partial norms are combined here."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    dt = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    n_dt = torch.nn.utils.get_total_norm(dt).full_tensor() if dt else torch.zeros(())
    n_plain = torch.nn.utils.get_total_norm(plain) if plain else torch.zeros(())
    total = torch.sqrt(n_dt ** 2 + n_plain ** 2)
    coef = torch.clamp(CLIP / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)


def _dtensor(a: dict[str, Any]):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _model(a)
    mesh = init_device_mesh("cpu", (2,))
    plan = {}
    for i in range(a["layers"]):
        for n in ("q_proj", "k_proj", "v_proj"):
            plan[f"model.layers.{i}.self_attn.{n}"] = ColwiseParallel()
        plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"model.layers.{i}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.up_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    from torch.distributed.tensor import DTensor

    # foreach kernels refuse to mix DTensor and plain tensors: one AdamW for each kind
    params = list(model.parameters())
    sharded = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    opts = [torch.optim.AdamW(ps, lr=LR, weight_decay=0.0, foreach=True) for ps in (sharded, plain)]

    def step(s: int) -> float:
        ids = _batch(a, s)
        loss = model(ids, labels=ids).loss
        loss.backward()
        _clip(params)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def _rank(a: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from engine.distributed.env import init_distributed, shutdown

    env = init_distributed(timeout_s=600)
    torch.set_num_threads(a["threads"])
    variants = {"autotp": _engine(a, 2, env), "dp": _engine(a, 1, env), "dtensor": _dtensor(a)}
    first = {k: fn(0) for k, fn in variants.items()}        # same weights, same global batch
    losses = torch.tensor(list(first.values()), device=env.device)
    dist.all_reduce(losses)  # the DP variant's loss is per rank: compare the means
    check = {k: v / 2 for k, v in zip(first, losses.tolist())}
    if max(check.values()) - min(check.values()) > 1e-4:
        raise RuntimeError(f"the variants disagree on the first step's loss: {check}")
    times: dict[str, list[float]] = {k: [] for k in variants}
    step = 1
    for _ in range(a["reps"]):
        for k, fn in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(a["steps"]):
                fn(step)
            dist.barrier()
            times[k].append(time.perf_counter() - t0)
        step += 1
    shutdown()
    return {"first_loss": check, "times": times}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for k, v in (("hidden", 256), ("layers", 4), ("heads", 8), ("vocab", 2048), ("seq", 128), ("batch", 8),
                 ("steps", 3), ("reps", 5), ("threads", 1)):
        p.add_argument(f"--{k}", type=int, default=v)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    a = vars(p.parse_args())
    res = launch(_rank, 2, a, threads=a["threads"])[0]
    tokens = a["batch"] * a["seq"] * a["steps"]
    rows = []
    base = median([tokens / t for t in res["times"]["dtensor"]])
    for k, ts in res["times"].items():
        tps = [tokens / t for t in ts]
        rows.append({"variant": k, "tokens/s (median)": median(tps), "min": min(tps), "max": max(tps),
                     "vs DTensor TP": median(tps) / base})
    table = markdown_table(rows, ["variant", "tokens/s (median)", "min", "max", "vs DTensor TP"])
    machine = machine_description()
    text = (f"# AutoTP vs DP vs DTensor TP (HF Llama, 2 ranks)\n\n`python benchmarks/autotp.py "
            f"{' '.join(f'--{k} {v}' for k, v in a.items() if k != 'out')}`\n\n{table}\n\n"
            f"First-step losses (checked equal): {res['first_loss']}\n\nMachine: {machine}\n")
    print(text)
    stamp = datetime.date.today().isoformat()
    os.makedirs(a["out"], exist_ok=True)
    with open(os.path.join(a["out"], f"autotp_cpu-{os.cpu_count()}core_{stamp}.md"), "w") as f:
        f.write(text)
    write_json(os.path.join(a["out"], "data", f"autotp_{stamp}.json"), {"args": a, "machine": machine, **res})


if __name__ == "__main__":
    main()
