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
from engine.checkpoint.format import CheckpointError, read_latest
from engine.checkpoint.preempt import Checkpointer, PreemptionHandler
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
from engine.training.divergence import DivergenceGuard
from engine.training.lifecycle import clear_failure_records, logs_dir, require_model
from engine.training.memory_probe import memory_probe
from engine.training.outputs import Location, agree_on_problems, prepare_locations, warn_if_low_space
from engine.training.resume import metrics_problem, model_differences

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
        "applied_steps": engine.global_steps - engine.skipped_steps,  # cumulative (over resumes too)
        "skipped_steps": engine.skipped_steps,
        "tokens": tokens,
        "tokens_per_s": tps,
        "step_time_ms": seconds * 1e3,
        "mfu": mfu(flops_per_token(model), tps, peak_flops_total),
        "context_parallel": cfg.cp,  # each rank held seq_len / context_parallel tokens of a sequence
        **engine.moe_metrics(),  # model.moe: moe_aux_loss, moe_load_imbalance (, moe_dropped_tokens)
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
            "offloaded_bytes": int(mem.get("offloaded", 0)),  # ZeRO-Offload: host memory
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
    diverged: Optional[str] = None  # the line to print when the run stopped on non-finite steps


class Trainer:
    """The reference GPT of ``cfg`` trained on ``dataset`` / ``sampler`` (:func:`build_data`)
    as ``options`` say. Collective: every rank makes one and calls the same methods in order
    (:meth:`claim_outputs`, :meth:`start`, :meth:`run`). ``notify``: rank 0's notices
    (resuming, nothing to resume), one line each. ``preempt``: the SIGTERM/SIGUSR1 handler
    the entry point installed at start-up and keeps until the process exits (None: the
    checkpointer installs one around the loop)."""

    def __init__(self, cfg: Config, dataset: PackedDataset, sampler: GlobalBatchSampler, env: DistEnv,
                 options: TrainOptions, *, notify: Callable[[str], None] = lambda line: None,
                 preempt: Optional[PreemptionHandler] = None) -> None:
        self.cfg, self.dataset, self.sampler, self.env, self.options = cfg, dataset, sampler, env, options
        self.notify, self.preempt = notify, preempt
        self.loaded: Optional[str] = None  # the checkpoint this run started from
        self._need = 0  # bytes of one checkpoint (start() counts them)
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
        if problem is None and self.location is not None:
            problem = self._resume_problem(self.location)
        if problem is None and self.rank0:  # the folder is ours now: a previous run's records go
            clear_failure_records(o.output)
        return agree_on_problems(problem)  # (collective: after it, every record is this run's)

    def _resume_problem(self, location: Location) -> Optional[str]:
        """What this run cannot honour in the checkpoint it resumes: another model (unless
        ``--finetune``), or a metrics file of the output it cannot continue (rank 0)."""
        o = self.options
        load_dir, tag = location
        try:
            tag = tag if tag is not None else read_latest(load_dir)
            saved = read_metadata(os.path.join(load_dir, tag))["config"].get("model") if tag else None
        except (CheckpointError, OSError, KeyError, TypeError):
            saved = None  # unreadable metadata is the load's to report, with its own message
        model = require_model(self.cfg)
        if saved is not None and not o.finetune:
            diffs = model_differences(saved, model.to_dict())
            if diffs:
                key, was, now = diffs[0]
                more = f" (and {', '.join('model.' + d[0] for d in diffs[1:])})" if len(diffs) > 1 else ""
                return (f"the checkpoint {os.path.join(load_dir, str(tag))} was trained with model.{key} = {was}, "
                        f"the config {'has' if now is not None else 'leaves it unset:'} {now}{more}: a resumed run "
                        "trains the same model; use the checkpoint's value, or --finetune to load its weights into "
                        "the changed model (step, optimizer and schedule start fresh)")
        return metrics_problem(o.output) if self.rank0 and not o.finetune else None

    def start(self) -> Engine:
        """Build the engine, load the checkpoint, write ``config.json`` (collective)."""
        o = self.options
        eng, *_ = initialize(config=self.cfg, dist_env=self.env)
        self._engine = eng
        if self.location is not None:
            self._load(self.location)
        elif o.load is not None and self.rank0:
            self.notify(f"nothing to resume in {o.load} (--load-if-exists): starting at step 0")
        self._need = self._checkpoint_bytes() if o.save is not None else 0
        if self.rank0:
            write_resolved_config(self.cfg, o.output)
            keep_metrics_up_to(o.output, eng.global_steps, warn=logger.warning)  # under the lock
            if o.save is not None:  # at start-up: a run whose only save is at the end hears it now
                warn_if_low_space([(o.save, "--save")], self._need, when="at start-up")
        return eng

    def _before_save(self) -> None:
        """Rank 0, before every save: the disk is tested again against a whole checkpoint."""
        if self.rank0 and self.options.save is not None:
            warn_if_low_space([(self.options.save, "--save")], self._need,
                              when=f"before the save at step {self.engine.global_steps}")

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
        self.loaded = path

    def _checkpoint_bytes(self) -> int:
        """One checkpoint's size: each owned master shard and its element-wise optimizer state,
        summed over the ranks. Before the first step the moments do not exist yet: they are
        counted from the optimizer's kind (Adam/AdamW/Muon two per element, Lion one), so
        the estimate is the real size from the start. Collective."""
        eng = self.engine
        view = eng.optimizer.shard_view()
        per_elem = 1 if "lion" in view.optimizer_class.lower() else 2
        mine = 0
        for gi, g in enumerate(view.groups):
            if not g.owner:
                continue
            st = view.group_state(gi)
            master = st.master.numel() * st.master.element_size()
            state = sum(v.numel() * v.element_size() for v in st.elementwise.values())
            mine += master + (state if state else per_elem * st.master.numel() * 4)
        total = torch.tensor([float(mine)], dtype=torch.float64, device=eng.device)  # NCCL takes no CPU tensors
        dist.all_reduce(total)
        return int(total.item())

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
        guard = DivergenceGuard(self.cfg.max_consecutive_nonfinite_steps)
        with Checkpointer(eng, o.save, interval, saver=saver, preempt=self.preempt,
                          before_save=self._before_save) as ckpt:
            def step_done(rec: dict[str, Any]) -> None:
                result.records.append(rec)
                if on_step is not None:
                    on_step(rec)

            def checkpoint(rec: dict[str, Any]) -> bool:
                guard.observe(rec)
                stop = ckpt.after_step(hold=guard.in_streak)  # no periodic save of a skipped step's state
                rec.update(ckpt.step_metrics)  # save_blocked_s / save_write_s on the steps that saved
                return stop or guard.tripped

            train(eng, self.sampler, max(0, o.steps - eng.global_steps), output_dir=o.output,
                  peak_tflops=o.peak_tflops, on_step=step_done, run_id=self.run_id, after_step=checkpoint)
            if on_loop_end is not None:
                on_loop_end()
            diverged = guard.tripped and not ckpt.preempted
            result.saved = ckpt.finish(final_save=not diverged)
        result.final_step, result.preempted = eng.global_steps, ckpt.preempted
        if self.preempt is not None and self.preempt.repeats and self.rank0:
            logger.warning("%d more SIGTERM/SIGUSR1 received after the first: ignored", self.preempt.repeats)
        if diverged:
            result.diverged = guard.message(result.saved or self.loaded)
        elif not ckpt.preempted:
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
