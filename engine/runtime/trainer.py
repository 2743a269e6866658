"""The training loop of the entry point (launch/train.py), as library calls.

- :func:`build_data`: the dataset and sampler of the config's ``data`` section (call it on
  every rank BEFORE any collective: it raises :class:`~engine.data.DataError` on bad
  input; the cache lock makes one process build while the others wait);
- :func:`train`: ``steps`` optimizer steps of ``engine.train_batch`` on the global batch of
  each step (``GlobalBatchSampler``, the same data whatever the layout), one metrics
  record per step (``metrics.jsonl`` on rank 0, TensorBoard when installed);
- :func:`write_memory_report`: per-rank parameter / gradient / optimizer-state / peak bytes,
  gathered to rank 0 as ``memory.json``;
- :func:`write_resolved_config`: ``config.json``.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Optional

import torch.distributed as dist

from engine.config import Config
from engine.data import GlobalBatchSampler, PackedDataset, build_dataset
from engine.metrics import MetricsWriter, StepTimer, device_peak_flops, mfu, peak_memory_bytes
from engine.models import flops_per_token

__all__ = ["build_data", "train", "write_memory_report", "write_resolved_config", "step_record"]

logger = logging.getLogger(__name__)


def build_data(cfg: Config) -> tuple[PackedDataset, GlobalBatchSampler]:
    """Dataset (tokenizer included) and the step-deterministic global-batch sampler."""
    d = cfg.data
    ds = build_dataset(train_files=list(d.train_files) if d.train_files is not None else None,
                       tokenizer_model=d.tokenizer_model, cache_dir=d.cache_dir,
                       document_masking=d.document_masking, vocab_size=cfg.model.vocab_size,
                       seq_len=cfg.model.seq_len)
    return ds, GlobalBatchSampler(ds, global_batch=cfg.train_batch_size, seed=cfg.seed)


def write_resolved_config(cfg: Config, output_dir: str) -> None:
    with open(os.path.join(output_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg.to_dict(), f, indent=2)
        f.write("\n")


def step_record(engine: Any, loss: float, seconds: float, loss_scale: float,
                peak_flops_total: Optional[float]) -> dict[str, Any]:
    """The metrics of the optimizer step just taken."""
    cfg: Config = engine.config
    tokens = cfg.train_batch_size * cfg.model.seq_len
    tps = tokens / seconds if seconds > 0 else float("inf")
    norm = engine.get_global_grad_norm()
    return {
        "step": engine.global_steps,
        "loss": loss,
        "lr": (engine.last_step_lr or engine.get_lr())[0],
        "grad_norm": None if norm is None else float(norm),
        "loss_scale": loss_scale,
        "skipped": engine.was_step_skipped(),
        "tokens": tokens,
        "tokens_per_s": tps,
        "step_time_ms": seconds * 1e3,
        "mfu": mfu(flops_per_token(cfg.model), tps, peak_flops_total),
        **({"phase_ms": dict(engine.timers.last)} if cfg.wall_clock_breakdown else {}),
    }


def train(engine: Any, sampler: GlobalBatchSampler, steps: int, *, output_dir: Optional[str],
          peak_tflops: Optional[float] = None,
          on_step: Optional[Callable[[dict[str, Any]], None]] = None,
          run_id: Optional[str] = None) -> list[dict[str, Any]]:
    """Run ``steps`` optimizer steps; returns the records (every rank computes them, rank 0
    writes them). ``peak_tflops``: per-device peak for MFU where the device table has none;
    ``run_id``: stored in every record as ``run_id`` (which job wrote it)."""
    cfg: Config = engine.config
    groups = engine.groups
    is_writer = engine.global_rank == 0
    writer = MetricsWriter(output_dir, is_writer=is_writer)
    peak = device_peak_flops(engine.device, cfg.precision, peak_tflops)
    peak_total = peak * cfg.world_size if peak is not None else None
    timer = StepTimer(engine.device)
    micro = cfg.train_micro_batch_size_per_gpu
    records = []
    try:
        for _ in range(steps):
            step = engine.global_steps  # the data of step s depends only on s: resumable, layout-free
            mbs = sampler.local_microbatches(step, groups.dp_rank, groups.dp_size, micro)
            data = iter([mb.to(engine.device) for mb in mbs])
            scale = engine.get_loss_scale()
            timer.start()
            loss = engine.train_batch(data)
            # read every step: metrics.jsonl is a live per-step log (the preemption and Ctrl-C
            # tests, and users, follow it), and StepTimer.stop() has already synchronised
            loss_value = float(loss.item())
            rec = step_record(engine, loss_value, timer.stop(), scale, peak_total)
            if run_id is not None:
                rec["run_id"] = run_id
            writer.write(rec)
            records.append(rec)
            if is_writer and cfg.steps_per_print and rec["step"] % cfg.steps_per_print == 0:
                logger.info("step %d: loss %.4f, lr %.3g, grad norm %s, %.0f tokens/s", rec["step"], rec["loss"],
                            rec["lr"], rec["grad_norm"], rec["tokens_per_s"])
            if on_step is not None:
                on_step(rec)
    finally:
        writer.close()
    return records


def write_memory_report(engine: Any, output_dir: str) -> Optional[dict[str, Any]]:
    """Gather each rank's bytes to rank 0 and write ``memory.json`` there (collective)."""
    mem = engine.memory_breakdown()
    coord = engine.groups.coord
    mine = {"rank": engine.global_rank, "dp": coord.dp, "tp": coord.tp, "pp": coord.pp,
            "params_bytes": int(mem["params"]), "grads_bytes": int(mem["grads"]),
            "optimizer_state_bytes": int(mem["optimizer_state"]),
            "bucket_buffers_bytes": int(mem.get("buckets", 0)),  # ZeRO-2/3 pooled reduction buffers
            "peak_bytes": peak_memory_bytes(engine.device),
            "peak_kind": "max allocated (CUDA)" if engine.device.type == "cuda" else
            "resident set high-water mark since start (CPU, VmHWM; exact for tensors with MALLOC_MMAP_THRESHOLD_ fixed)"}
    everyone: Optional[list] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    if dist.get_rank() != 0:
        return None
    report = {"world_size": dist.get_world_size(), "zero_stage": engine.config.zero.stage,
              "precision": engine.config.precision, "ranks": everyone}
    with open(os.path.join(output_dir, "memory.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    return report
