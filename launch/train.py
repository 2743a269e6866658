#!/usr/bin/env python
"""Train the reference GPT described by a DeepSpeed-format config.

    python launch/train.py --config configs/zero0.json --steps 50 --output runs/x      # 1 rank
    torchrun --nproc_per_node 8 launch/train.py --config configs/default.json --steps 100 --output runs/x
    deepspeed --num_gpus 8 launch/train.py --deepspeed_config configs/default.json --steps 100 --output runs/x
    srun -n 8 python launch/train.py --config configs/default.json --steps 100 --output runs/x

Checkpoints (Megatron's flags): ``--save DIR`` saves at the end, every ``--save-interval N``
steps (default: the config's ``checkpoint.save_interval``) and on SIGTERM/SIGUSR1 (then it
exits 0 after the current step); ``--load PATH`` resumes from a save directory (the tag its
``latest`` names) or a tag directory, at any (dp, tp, pp, ZeRO stage); ``--steps`` is the
total step count to reach. See docs/checkpoints.md for ``--load-if-exists``,
``--finetune``, ``--no-load-optim``, ``--no-load-rng`` and the guards.

Writes ``metrics.jsonl`` (one JSON object per optimizer step, with the job's ``run_id``),
``memory.json``, ``config.json`` (the resolved config) and TensorBoard events (if
installed) into ``--output``, shows progress on rank 0 and ends with a short greedy sample.
Rank 0 locks ``--output`` and ``--save`` (one job per folder).

Exit status (docs/training.md): 0 trained or preempted cleanly; 2 bad input, one line from
rank 0 (arguments, config and data before any process group exists; folders, locks and
``--load`` right after, agreed by all ranks); 1 a runtime failure, one line per rank (the
traceback in ``OUTPUT/logs/rank<R>.log``, or on stderr with ``--debug``); 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "engine")):  # run from a checkout without installing
    sys.path.insert(0, _ROOT)

EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class _RankParser(argparse.ArgumentParser):
    """argparse whose usage errors and --help are printed by rank 0 only (every rank parses)."""

    speak = True

    def print_usage(self, file=None) -> None:
        if self.speak:
            super().print_usage(file)

    def print_help(self, file=None) -> None:
        if self.speak:
            super().print_help(file)

    def exit(self, status=0, message=None):
        if message and self.speak:
            sys.stderr.write(message)
        sys.exit(status)


def parse_args(argv: list[str] | None = None, speak: bool = True) -> argparse.Namespace:
    p = _RankParser(description="Train the reference GPT with DP x TP x PP and ZeRO.", allow_abbrev=False)
    p.speak = speak
    p.add_argument("--config", "--deepspeed_config", dest="config", required=True, metavar="PATH",
                   help="DeepSpeed-format JSON config (see docs/config.md)")
    p.add_argument("--deepspeed", action="store_true",
                   help="accepted as DeepSpeed scripts pass it (the engine is always on); the config comes "
                        "from --config / --deepspeed_config")
    p.add_argument("--steps", type=int, required=True, metavar="N",
                   help="total optimizer steps to reach (>= 1; a run resumed at step k trains N - k more)")
    p.add_argument("--save", default=None, metavar="DIR",
                   help="checkpoint directory: save at the end, every --save-interval steps and on SIGTERM/SIGUSR1")
    p.add_argument("--load", default=None, metavar="PATH",
                   help="resume from a save directory (the tag its 'latest' names) or a tag directory "
                        "(e.g. DIR/global_step8), saved at any layout; no checkpoint there is an error")
    p.add_argument("--load-if-exists", action="store_true",
                   help="with --load: start from step 0 when PATH holds no checkpoint (restart loops)")
    p.add_argument("--finetune", action="store_true",
                   help="with --load: load the weights only; step, optimizer, LR schedule and RNG start fresh")
    p.add_argument("--no-load-optim", action="store_true",
                   help="with --load: do not load the optimizer state (weights, step and LR schedule are loaded)")
    p.add_argument("--no-load-rng", action="store_true", help="with --load: do not restore the RNG states")
    p.add_argument("--save-interval", type=int, default=None, metavar="N",
                   help="save every N steps (default: the config's checkpoint.save_interval; 0: only at the end)")
    p.add_argument("--output", default=os.path.join("runs", "latest"), metavar="DIR",
                   help="where metrics.jsonl, memory.json and config.json go (default: runs/latest)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None,
                   help="set by the deepspeed launcher; the rank is read from the environment")
    p.add_argument("--sample-tokens", type=int, default=48, metavar="N",
                   help="greedy tokens to generate on rank 0 at the end (0: no sample)")
    p.add_argument("--prompt", default="    def __init__(self", help="prompt of the final sample")
    p.add_argument("--peak-tflops", type=float, default=None, metavar="T",
                   help="per-device peak TFLOP/s for MFU where the device is not in the table (e.g. CPUs)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="collective timeout in seconds: a hung or dead peer fails the run after this long")
    p.add_argument("--debug", action="store_true",
                   help="print full tracebacks of failures (otherwise: one line, traceback in OUTPUT/logs/)")
    p.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p.parse_args(argv)


class _BadInput(Exception):
    def __init__(self, kind: str, msg: str) -> None:
        super().__init__(msg)
        self.kind = kind


def _check_arguments(args: argparse.Namespace) -> None:
    """Flag values that are wrong on their own (no filesystem, no config)."""
    bad = lambda msg: _BadInput("argument", msg)
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise bad(f"--timeout must be a positive, finite number of seconds, got {args.timeout!r}")
    if args.steps < 1:
        raise bad(f"--steps must be at least 1, got {args.steps}")
    if args.save_interval is not None and args.save_interval < 0:
        raise bad(f"--save-interval must be >= 0, got {args.save_interval}")
    if args.sample_tokens < 0:
        raise bad(f"--sample-tokens must be >= 0, got {args.sample_tokens}")
    for flag in ("load_if_exists", "finetune", "no_load_optim", "no_load_rng"):
        if getattr(args, flag) and args.load is None:
            raise bad(f"--{flag.replace('_', '-')} needs --load PATH (the checkpoint to load)")


def _check_inputs(args: argparse.Namespace, world_size: int):
    """Every rank, before any process group: arguments, config, data. Raises _BadInput."""
    from engine.config import ConfigError, load_config
    from engine.data import DataError

    _check_arguments(args)
    try:
        cfg = load_config(args.config, world_size=world_size)
    except ConfigError as exc:
        raise _BadInput("config", str(exc)) from None
    if cfg.model is None:
        raise _BadInput("config", f"{args.config} has no \"model\" section: launch/train.py trains the reference "
                                  "GPT it describes; add one with vocab_size, hidden_size, num_layers, num_heads "
                                  "and seq_len (see configs/default.json)")
    try:
        from engine.runtime.trainer import build_data

        dataset, sampler = build_data(cfg)
    except DataError as exc:
        raise _BadInput("data", str(exc)) from None
    return cfg, dataset, sampler


def _default_preemption_signals() -> None:
    """A launcher may start us with SIGTERM/SIGUSR1 ignored (the torchrun recipe in
    docs/training.md keeps the launcher alive that way): the ranks must still react."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        if signal.getsignal(sig) is signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)


def main(argv: list[str] | None = None) -> int:
    from engine.dist.env import LaunchError, detect_launch

    _default_preemption_signals()
    # 1. where am I (no process group yet): rank 0 alone speaks for input errors
    try:
        info = detect_launch(os.environ, sys.argv if argv is None else [sys.argv[0], *argv])
    except LaunchError as exc:  # no rank is known: every process says it
        print(f"launch error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    speak = info.rank == 0
    args = parse_args(argv, speak)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    # 2. arguments, config, data: every rank checks, before any collective
    try:
        cfg, dataset, sampler = _check_inputs(args, info.world_size)
    except _BadInput as exc:
        if speak:
            print(f"{exc.kind} error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    return _run(args, cfg, dataset, sampler)


def _run(args: argparse.Namespace, cfg, dataset, sampler) -> int:
    from engine.dist.env import PeerFailureError, failure_guard, init_distributed

    env = None
    try:
        env = init_distributed(timeout_s=args.timeout)
        with failure_guard(env, "training", record_dir=_logs_dir(args)):
            code = _job(args, cfg, dataset, sampler, env)
    except KeyboardInterrupt:
        if env is None or env.rank == 0:
            print("\ninterrupted: stopping all ranks", file=sys.stderr, flush=True)
        # no collective on the way out: the peers are being interrupted too, and a peer
        # that is not fails its next collective at once when this process's sockets close
        _exit(EXIT_INTERRUPTED)
    except PeerFailureError as exc:  # this rank only stopped because of another
        print(f"error: {exc}", file=sys.stderr, flush=True)
        _exit(EXIT_FAILURE)
    except Exception as exc:  # noqa: BLE001 - this rank's own failure: one line, traceback aside
        _report_failure(args, env, exc)
        _exit(EXIT_FAILURE)
    _shutdown()
    return code


def _logs_dir(args: argparse.Namespace) -> str:
    """Per-rank tracebacks (rank<R>.log) and failure records (rank<R>.failed, read by the
    peers when the failing rank hosted the rendezvous store)."""
    return os.path.join(args.output, "logs")


def _exit(code: int) -> None:
    """Leave without interpreter finalisation: broken process groups can abort it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _report_failure(args: argparse.Namespace, env, exc: BaseException) -> None:
    """One line naming this rank and the error; the traceback goes to stderr under --debug,
    else to OUTPUT/logs/rank<R>.log (named in the line)."""
    import traceback

    rank = "?" if env is None else env.rank
    first = (str(exc).strip().splitlines() or [""])[0][:1000]
    tb = "".join(traceback.format_exception(exc))
    where = ""
    if args.debug:
        sys.stderr.write(tb)
    else:
        try:
            path = os.path.join(_logs_dir(args), f"rank{rank}.log")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(tb)
            where = f" (traceback: {path}; or run with --debug)"
        except OSError:
            where = " (run with --debug for the traceback)"
    print(f"error: rank {rank}: {type(exc).__name__}: {first}{where}", file=sys.stderr, flush=True)


def _clear_failure_records(logs: str) -> None:
    for name in os.listdir(logs) if os.path.isdir(logs) else []:
        if name.endswith((".failed", ".stopped")):
            os.remove(os.path.join(logs, name))


def _job(args: argparse.Namespace, cfg, dataset, sampler, env) -> int:
    """Claim and check the output locations (exit 2 on a problem anywhere), then train."""
    import uuid

    import torch.distributed as dist

    from engine.runtime.outputs import agree_on_problems, prepare_locations

    box = [uuid.uuid4().hex[:12] if env.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    run_id = box[0]  # in every metrics record and in the locks' holder lines
    with contextlib.ExitStack() as held:  # rank 0's directory locks, released at the end
        problem, location = prepare_locations(output=args.output, save=args.save, load=args.load,
                                              load_if_exists=args.load_if_exists, finetune=args.finetune,
                                              rank=env.rank, run_id=run_id, stack=held)
        if problem is None and env.rank == 0:  # the folder is ours now: a previous run's records go
            _clear_failure_records(_logs_dir(args))
        problem = agree_on_problems(problem)  # (collective: after it, every record is this run's)
        if problem is not None:
            if env.rank == 0:
                print(f"argument error: {problem}", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
        import engine

        _train(args, cfg, dataset, sampler, env, engine, run_id, location)
    return 0


def _load(args: argparse.Namespace, eng, location, rank0: bool) -> None:
    """Load the checkpoint at ``location`` as the --finetune / --no-load-* flags say."""
    from engine.checkpoint import load_checkpoint, read_metadata

    load_dir, tag = location
    path, _ = load_checkpoint(eng, load_dir, tag, load_optimizer_states=not (args.no_load_optim or args.finetune),
                              load_module_only=args.finetune, load_rng_states=not args.no_load_rng)
    if path is None:  # 'latest' vanished since the check (another process removed it)
        raise RuntimeError(f"no checkpoint to load in {load_dir}: its 'latest' file is gone")
    if rank0:
        saved = read_metadata(path)["config"].get("train_batch_size")
        if saved is not None and saved != eng.config.train_batch_size and not args.finetune:
            logging.getLogger("train").warning(
                "the checkpoint %s was trained with a global batch of %s sequences (train_batch_size), this run "
                "uses %s: from step %d on every step reads a batch of the new size, so the data stream does not "
                "continue where the checkpoint's run would have", path, saved, eng.config.train_batch_size,
                eng.global_steps)
        what = "weights only (--finetune)" if args.finetune else "resuming"
        print(f"loaded {path}: {what} at step {eng.global_steps}", file=sys.stderr, flush=True)


class _Progress:
    """Rank 0's progress: a tqdm bar on a terminal, else one line every ``every`` steps (and
    at the last), so that logs hold no carriage-return lines."""

    def __init__(self, show: bool, start: int, total: int, every: int) -> None:
        self.show, self.step, self.total, self.every = show, start, total, max(1, every)
        self.bar = None
        if show and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(initial=min(start, total), total=total, unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(self, rec: dict) -> None:
        self.step = rec["step"]
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}", refresh=False)
            self.bar.update(1)
        elif self.show and (self.step % self.every == 0 or self.step >= self.total):
            print(f"step {self.step}/{self.total}: loss {rec['loss']:.4f}, {rec['tokens_per_s']:.0f} tokens/s, "
                  f"{rec['step_time_ms']:.0f} ms/step", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _checkpoint_bytes(eng) -> int:
    """About one checkpoint: the optimizer state (fp32 masters and moments) of every rank,
    counted once per DP replica under ZeRO-0 (one replica writes it). Collective."""
    import torch
    import torch.distributed as dist

    # on the engine's device: NCCL takes no CPU tensors
    mine = torch.tensor([float(eng.memory_breakdown()["optimizer_state"])], dtype=torch.float64, device=eng.device)
    dist.all_reduce(mine)
    return int(mine.item() / (eng.config.dp if eng.config.zero.stage == 0 else 1))


def _train(args: argparse.Namespace, cfg, dataset, sampler, env, engine, run_id: str, location) -> None:
    from engine.checkpoint.preempt import Checkpointer, StopTraining
    from engine.runtime.generate import gather_reference_model, greedy_generate
    from engine.runtime.outputs import warn_if_low_space
    from engine.runtime.trainer import train, write_memory_report, write_resolved_config

    rank0 = env.rank == 0
    eng, *_ = engine.initialize(config=cfg, dist_env=env)
    if location is not None:
        _load(args, eng, location, rank0)
    elif args.load is not None and rank0:
        print(f"nothing to resume in {args.load} (--load-if-exists): starting at step 0", file=sys.stderr, flush=True)
    need = _checkpoint_bytes(eng) if args.save is not None else 0
    if rank0:
        write_resolved_config(cfg, args.output)
        _keep_metrics_up_to(os.path.join(args.output, "metrics.jsonl"), eng.global_steps)  # under the lock
        if args.save is not None:
            warn_if_low_space([(args.save, "--save")], need)
    progress = _Progress(rank0, eng.global_steps, args.steps, cfg.steps_per_print or 10)
    records: list = []
    interval = cfg.checkpoint.save_interval if args.save_interval is None else args.save_interval
    with Checkpointer(eng, args.save, interval) as ckpt:
        def on_step(rec: dict) -> None:
            records.append(rec)
            progress.update(rec)
            if ckpt.after_step():
                raise StopTraining

        try:
            train(eng, sampler, max(0, args.steps - eng.global_steps), output_dir=args.output,
                  peak_tflops=args.peak_tflops, on_step=on_step, run_id=run_id)
        except StopTraining:
            pass
        progress.close()
        saved = ckpt.finish()
    if ckpt.preempted:
        if rank0:
            print(f"preempted at step {eng.global_steps}: checkpoint {saved}", flush=True)
        eng.destroy()
        return
    write_memory_report(eng, args.output)
    # ---- end-of-run sample (one call site; rank 0 prints it)
    model = gather_reference_model(eng) if args.sample_tokens > 0 else None
    if rank0:
        losses = f"loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}" if records else "nothing to train"
        print(f"trained {len(records)} steps to step {eng.global_steps} ({cfg.topology}, ZeRO-{cfg.zero.stage}, "
              f"{cfg.precision}): {losses}; metrics in {os.path.join(args.output, 'metrics.jsonl')}"
              + (f"; checkpoint {saved}" if saved else ""), flush=True)
        if model is not None:
            tok = dataset.tokenizer
            ids = greedy_generate(model, tok.encode(args.prompt), args.sample_tokens)
            print("sample (greedy):\n" + tok.decode(ids), flush=True)
    eng.destroy()  # let the process groups go before shutdown() tears them down


def _keep_metrics_up_to(path: str, step: int) -> None:
    """A fresh run starts a new metrics file; a resumed one keeps the records up to its step
    (a crashed run may have logged steps after its last checkpoint)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        keep = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(keep)


def _shutdown() -> None:
    try:
        from engine.dist.env import shutdown
    except ImportError:  # older engine.dist.env without shutdown(): tear the default group down directly
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return
    shutdown()


if __name__ == "__main__":
    sys.exit(main())
