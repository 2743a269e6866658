"""The training loop of the entry point (launch/train.py), as a library :class:`Trainer`.

``launch/train.py`` is a thin CLI over it (arguments, launch environment, exit codes,
progress display); the :class:`Trainer` does the job: it claims the output folders
(:meth:`Trainer.claim_outputs`), builds the engine and loads the checkpoint
(:meth:`Trainer.start`), trains with periodic and preemption checkpoints, writes
``config.json``, ``metrics.jsonl`` and ``memory.json`` and takes the end-of-run greedy
sample (:meth:`Trainer.run`). Its notices go through a callback, never to a stream.

- :func:`build_data`: the dataset and sampler of the config's ``data`` section (call it on
  every rank BEFORE any collective: it raises :class:`~engine.data.DataError` on bad
  input; the cache lock makes one process build while the others wait);
- :func:`train`: ``steps`` optimizer steps of ``engine.train_batch`` on the global batch of
  each step (``GlobalBatchSampler``, the same data whatever the layout), one metrics
  record per step, written by rank 0 to ``metrics.jsonl`` and the config's monitors
  (``tensorboard``, ``csv_monitor``, ``wandb``: DeepSpeed's tags against samples) in one
  fan-out (:class:`engine.monitor.Monitor`);
- :func:`write_memory_report`: per-rank parameter / gradient / optimizer-state / peak bytes,
  gathered to rank 0 as ``memory.json``;
- :func:`write_resolved_config`: ``config.json``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from engine.assembly.initialize import initialize
from engine.checkpoint import load_checkpoint, read_metadata
from engine.checkpoint.preempt import Checkpointer
from engine.config import Config
from engine.data import GlobalBatchSampler, PackedDataset, build_dataset
from engine.distributed.env import DistEnv
from engine.distributed.groups import ParallelGroups
from engine.engine import Engine
from engine.generate import gather_reference_model, generates_sharded, greedy_generate, greedy_generate_sharded
from engine.metrics import StepTimer, device_peak_flops, mfu, peak_memory_bytes
from engine.models import flops_per_token
from engine.monitor import Monitor
from engine.monitor.jsonl import JsonlMonitor, keep_metrics_up_to
from engine.topology import Role
from engine.training.lifecycle import clear_failure_records, logs_dir, require_model
from engine.training.memory_probe import memory_probe
from engine.training.outputs import Location, agree_on_problems, prepare_locations, warn_if_low_space

__all__ = ["Trainer", "TrainOptions", "TrainResult", "build_data", "train", "write_memory_report",
           "write_resolved_config", "step_record"]

logger = logging.getLogger(__name__)


def _groups(engine: Engine) -> ParallelGroups:
    if engine.groups is None:
        raise RuntimeError("the engine was destroyed (engine.destroy()): build a new one to train")
    return engine.groups


def build_data(cfg: Config) -> tuple[PackedDataset, GlobalBatchSampler]:
    """Dataset (tokenizer included) and the step-deterministic global-batch sampler."""
    d, model = cfg.data, require_model(cfg)
    ds = build_dataset(train_files=list(d.train_files) if d.train_files is not None else None,
                       tokenizer_model=d.tokenizer_model, cache_dir=d.cache_dir,
                       document_masking=d.document_masking, vocab_size=model.vocab_size,
                       seq_len=model.seq_len)
    return ds, GlobalBatchSampler(ds, global_batch=cfg.train_batch_size, seed=cfg.seed)


def write_resolved_config(cfg: Config, output_dir: str) -> None:
    with open(os.path.join(output_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg.to_dict(), f, indent=2)
        f.write("\n")


def step_record(engine: Engine, loss: float, seconds: float, loss_scale: float,
                peak_flops_total: Optional[float]) -> dict[str, Any]:
    """The metrics of the optimizer step just taken."""
    cfg: Config = engine.config
    model = require_model(cfg)
    tokens = cfg.train_batch_size * model.seq_len
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
        "mfu": mfu(flops_per_token(model), tps, peak_flops_total),
        "context_parallel": cfg.cp,  # each rank held seq_len / context_parallel tokens of a sequence
        **({"phase_ms": dict(engine.timers.last)} if cfg.wall_clock_breakdown else {}),
    }


def train(engine: Engine, sampler: GlobalBatchSampler, steps: int, *, output_dir: Optional[str],
          peak_tflops: Optional[float] = None,
          on_step: Optional[Callable[[dict[str, Any]], None]] = None,
          run_id: Optional[str] = None,
          after_step: Optional[Callable[[dict[str, Any]], bool]] = None) -> list[dict[str, Any]]:
    """Run ``steps`` optimizer steps; returns the records (every rank computes them, rank 0
    writes them). ``peak_tflops``: per-device peak for MFU where the device table has none;
    ``run_id``: stored in every record as ``run_id`` (which job wrote it); ``after_step(record)``:
    after each step, before its record is written (a checkpoint adds its fields); True
    ends the loop once the record is written and ``on_step`` has seen it."""
    cfg: Config = engine.config
    batch_role = _groups(engine).role(Role.BATCH)  # the ranks that read different rows of the batch
    is_writer = engine.global_rank == 0
    # One fan-out per step: the config's monitors (engine.monitor, rank 0) and metrics.jsonl
    # get the same values, the loss read to the host once; the engine's own per-step write
    # is off meanwhile, so TensorBoard has one writer with DeepSpeed's tags.
    base, engine.monitor = engine.monitor, None
    rows = JsonlMonitor(output_dir) if is_writer and output_dir else None
    monitor = Monitor(([] if base is None else base.backends) + ([rows] if rows is not None else []))
    peak = device_peak_flops(engine.device, cfg.precision, peak_tflops)
    peak_total = peak * cfg.world_size if peak is not None else None
    timer = StepTimer(engine.device)
    micro = cfg.train_micro_batch_size_per_gpu
    records = []
    try:
        for i in range(steps):
            step = engine.global_steps  # the data of step s depends only on s: resumable, layout-free
            mbs = sampler.local_microbatches(step, batch_role.rank, batch_role.size, micro)
            data = iter([mb.to(engine.device) for mb in mbs])
            scale = engine.get_loss_scale()
            timer.start()
            with memory_probe(engine, i == min(1, steps - 1)):  # activation_peak_bytes (memory_probe.py)
                loss = engine.train_batch(data)
            loss_value = float(loss.item())  # the step's one host read of the loss
            rec = step_record(engine, loss_value, timer.stop(), scale, peak_total)
            if run_id is not None:
                rec["run_id"] = run_id
            stop = after_step(rec) if after_step is not None else False
            if monitor.enabled:
                monitor.write_events(engine.step_events(loss_value), rec)
            records.append(rec)
            if is_writer and cfg.steps_per_print and rec["step"] % cfg.steps_per_print == 0:
                logger.info("step %d: loss %.4f, lr %.3g, grad norm %s, %.0f tokens/s", rec["step"], rec["loss"],
                            rec["lr"], rec["grad_norm"], rec["tokens_per_s"])
            if on_step is not None:
                on_step(rec)
            if stop:
                break
    finally:
        if rows is not None:
            rows.close()
        engine.monitor = base
    return records


def write_memory_report(engine: Engine, output_dir: str) -> Optional[dict[str, Any]]:
    """Gather each rank's bytes to rank 0 and write ``memory.json`` there (collective)."""
    mem = engine.memory_breakdown()
    coord = _groups(engine).coord
    mine = {"rank": engine.global_rank, **coord._asdict(),
            "params_bytes": int(mem["params"]), "grads_bytes": int(mem["grads"]),
            "optimizer_state_bytes": int(mem["optimizer_state"]),
            "bucket_buffers_bytes": int(mem.get("buckets", 0)),  # ZeRO-2/3 pooled reduction buffers
            # forward + backward of one step, over what the rank held before it (exact, measured)
            "activation_peak_bytes": engine.activation_peak_bytes,
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


@dataclass(frozen=True)
class TrainOptions:
    """What a training job is asked to do (launch/train.py's flags, same names)."""

    steps: int                          # total optimizer steps to reach
    output: str                         # metrics.jsonl, memory.json, config.json, logs/
    save: Optional[str] = None          # checkpoint directory
    load: Optional[str] = None          # save directory or tag directory to resume from
    load_if_exists: bool = False
    finetune: bool = False              # weights only
    load_optim: bool = True
    load_rng: bool = True
    save_interval: Optional[int] = None  # None: the config's checkpoint.save_interval
    sample_tokens: int = 48             # greedy tokens of the end-of-run sample (0: none)
    prompt: str = "    def __init__(self"
    peak_tflops: Optional[float] = None

    @property
    def logs_dir(self) -> str:
        """Per-rank tracebacks and failure records."""
        return logs_dir(self.output)


@dataclass
class TrainResult:
    """What a :meth:`Trainer.run` did (``sample``: rank 0's decoded greedy sample)."""

    records: list[dict[str, Any]] = field(default_factory=list)
    final_step: int = 0
    saved: Optional[str] = None
    preempted: bool = False
    sample: Optional[str] = None


class Trainer:
    """The reference GPT of ``cfg`` trained on ``dataset`` / ``sampler`` (:func:`build_data`)
    as ``options`` say. Collective: every rank makes one and calls the same methods in order
    (:meth:`claim_outputs`, :meth:`start`, :meth:`run`). ``notify``: rank 0's notices
    (resuming, nothing to resume), one line each."""

    def __init__(self, cfg: Config, dataset: PackedDataset, sampler: GlobalBatchSampler, env: DistEnv,
                 options: TrainOptions, *, notify: Callable[[str], None] = lambda line: None) -> None:
        self.cfg, self.dataset, self.sampler, self.env, self.options = cfg, dataset, sampler, env, options
        self.notify = notify
        self.rank0 = env.rank == 0
        self.run_id = ""
        self.location: Optional[Location] = None
        self._engine: Optional[Engine] = None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("Trainer.start() builds the engine: call it first")
        return self._engine

    def claim_outputs(self, held: contextlib.ExitStack) -> Optional[str]:
        """Rank 0 locks the output and save folders (released when ``held`` closes); every
        rank checks them and the load path. Returns the first problem of any rank (the same
        on every rank), None when all is well. Collective."""
        o = self.options
        box = [uuid.uuid4().hex[:12] if self.rank0 else None]
        dist.broadcast_object_list(box, src=0)
        self.run_id = str(box[0])  # in every metrics record and in the locks' holder lines
        problem, self.location = prepare_locations(output=o.output, save=o.save, load=o.load,
                                                   load_if_exists=o.load_if_exists, finetune=o.finetune,
                                                   rank=self.env.rank, run_id=self.run_id, stack=held)
        if problem is None and self.rank0:  # the folder is ours now: a previous run's records go
            clear_failure_records(o.output)
        return agree_on_problems(problem)  # (collective: after it, every record is this run's)

    def start(self) -> Engine:
        """Build the engine, load the checkpoint, write ``config.json`` (collective)."""
        o = self.options
        eng, *_ = initialize(config=self.cfg, dist_env=self.env)
        self._engine = eng
        if self.location is not None:
            self._load(self.location)
        elif o.load is not None and self.rank0:
            self.notify(f"nothing to resume in {o.load} (--load-if-exists): starting at step 0")
        need = self._checkpoint_bytes() if o.save is not None else 0
        if self.rank0:
            write_resolved_config(self.cfg, o.output)
            keep_metrics_up_to(o.output, eng.global_steps)  # under the lock
            if o.save is not None:
                warn_if_low_space([(o.save, "--save")], need)
        return eng

    def _load(self, location: Location) -> None:
        """Load the checkpoint at ``location`` as the finetune / load_* options say."""
        o, eng = self.options, self.engine
        load_dir, tag = location
        path, _ = load_checkpoint(eng, load_dir, tag, load_optimizer_states=o.load_optim and not o.finetune,
                                  load_module_only=o.finetune, load_rng_states=o.load_rng)
        if path is None:  # 'latest' vanished since the check (another process removed it)
            raise RuntimeError(f"no checkpoint to load in {load_dir}: its 'latest' file is gone")
        if self.rank0:
            saved = read_metadata(path)["config"].get("train_batch_size")
            if saved is not None and saved != eng.config.train_batch_size and not o.finetune:
                logger.warning(
                    "the checkpoint %s was trained with a global batch of %s sequences (train_batch_size), this run "
                    "uses %s: from step %d on every step reads a batch of the new size, so the data stream does not "
                    "continue where the checkpoint's run would have", path, saved, eng.config.train_batch_size,
                    eng.global_steps)
            what = "weights only (--finetune)" if o.finetune else "resuming"
            self.notify(f"loaded {path}: {what} at step {eng.global_steps}")

    def _checkpoint_bytes(self) -> int:
        """About one checkpoint: the optimizer state (fp32 masters and moments) of every rank,
        counted once per replica of the grad role under ZeRO-0 (one replica writes it). Collective."""
        eng = self.engine
        # on the engine's device: NCCL takes no CPU tensors
        mine = torch.tensor([float(eng.memory_breakdown()["optimizer_state"])], dtype=torch.float64,
                            device=eng.device)
        dist.all_reduce(mine)
        return int(mine.item() / (eng.config.topology.role_size(Role.GRAD) if eng.config.zero.stage == 0 else 1))

    def run(self, on_step: Optional[Callable[[dict[str, Any]], None]] = None,
            on_loop_end: Optional[Callable[[], None]] = None) -> TrainResult:
        """Train up to ``options.steps`` (checkpoints every ``save_interval`` steps, at the end
        and on SIGTERM/SIGUSR1, after which it stops cleanly), then write ``memory.json`` and
        take the greedy sample. ``on_step(record)`` after each step; ``on_loop_end()`` after
        the last, before the final save. The engine is destroyed at the end. Collective."""
        o, eng = self.options, self.engine
        result = TrainResult()
        interval = self.cfg.checkpoint.save_interval if o.save_interval is None else o.save_interval
        saver = eng.checkpoint_saver() if self.cfg.checkpoint.async_save and o.save is not None else None
        with Checkpointer(eng, o.save, interval, saver=saver) as ckpt:
            def step_done(rec: dict[str, Any]) -> None:
                result.records.append(rec)
                if on_step is not None:
                    on_step(rec)

            def checkpoint(rec: dict[str, Any]) -> bool:
                stop = ckpt.after_step()
                rec.update(ckpt.step_metrics)  # save_blocked_s / save_write_s on the steps that saved
                return stop

            train(eng, self.sampler, max(0, o.steps - eng.global_steps), output_dir=o.output,
                  peak_tflops=o.peak_tflops, on_step=step_done, run_id=self.run_id, after_step=checkpoint)
            if on_loop_end is not None:
                on_loop_end()
            result.saved = ckpt.finish()
        result.final_step, result.preempted = eng.global_steps, ckpt.preempted
        if not ckpt.preempted:
            write_memory_report(eng, o.output)
            tok = self.dataset.tokenizer
            if o.sample_tokens > 0 and generates_sharded(eng):  # ZeRO-3: never a whole copy, every rank
                ids = greedy_generate_sharded(eng, tok.encode(o.prompt), o.sample_tokens)  # collective
                result.sample = tok.decode(ids) if dist.get_rank() == 0 else None
            else:
                model = gather_reference_model(eng) if o.sample_tokens > 0 else None  # collective
                if model is not None:
                    result.sample = tok.decode(greedy_generate(model, tok.encode(o.prompt), o.sample_tokens))
        eng.destroy()  # let the process groups go before shutdown() tears them down
        return result
