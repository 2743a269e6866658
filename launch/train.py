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
import logging
import math
import os
import signal
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "engine")):  # run from a checkout without installing
    sys.path.insert(0, _ROOT)

# torch's C++ warnings are noise here: when a peer dies, the failure watch's next store call
# logs a 20-frame TCPStore stack before raising the error we report in one line
# (docs/launching.md); read once, when torch loads: set before any engine import
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
QUIET_RANK_EXIT_DELAY_S = 5.0  # how long ranks > 0 wait before exiting on a bad input rank 0 reports
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a collective timeout beyond a week is a typo (torch's C++ timer overflows on 1e10)


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
    p.add_argument("--timeout", type=float, default=1800.0, metavar="S",
                   help="collective timeout in seconds (default 1800, as init_distributed): "
                        "a hung or dead peer fails the run after this long")
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
    if not (math.isfinite(args.timeout) and 0 < args.timeout <= MAX_TIMEOUT_S):
        raise bad(f"--timeout must be a positive, finite number of seconds, at most {MAX_TIMEOUT_S:.0f} (7 days), "
                  f"got {args.timeout!r}")
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
    try:
        from engine.training.lifecycle import require_model  # torch is imported after the argument checks
        from engine.training.trainer import build_data

        require_model(cfg, args.config)
    except ConfigError as exc:
        raise _BadInput("config", str(exc)) from None
    try:
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
    from engine.distributed.env import LaunchError, detect_launch

    _default_preemption_signals()
    # 1. where am I (no process group yet): rank 0 alone speaks for input errors
    try:
        info = detect_launch(os.environ, sys.argv if argv is None else [sys.argv[0], *argv])
    except LaunchError as exc:  # no rank is known: every process says it
        print(f"launch error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    speak = info.rank == 0
    args = parse_args(argv, speak)
    # SIGTERM/SIGUSR1 are recorded from here to the process's exit (engine.checkpoint.preempt):
    # one during start-up work saves at the first step, one after the final save is ignored
    preempt = _preemption_handler() if args.save is not None else None
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    if args.log_level == "WARNING":  # the default: still say what the first run builds, and how long it took
        logging.getLogger("engine.build").setLevel(logging.INFO)  # (tokenizer, token file, fused kernels)
    # 2. arguments, config, data: every rank checks, before any collective
    try:
        cfg, dataset, sampler = _check_inputs(args, info.world_size)
    except _BadInput as exc:
        if speak:
            print(f"{exc.kind} error: {exc}", file=sys.stderr, flush=True)
        else:  # a launcher stops every rank at the first exit: let rank 0 say why before that
            time.sleep(QUIET_RANK_EXIT_DELAY_S)
        return EXIT_BAD_INPUT
    code = _run(args, cfg, dataset, sampler, preempt)
    if preempt is not None:  # the job is done: a late signal must not kill it during interpreter exit
        preempt.ignore_until_exit()
    return code


def _preemption_handler():
    from engine.checkpoint.preempt import PreemptionHandler

    return PreemptionHandler().install()


def _run(args: argparse.Namespace, cfg, dataset, sampler, preempt=None) -> int:
    from engine.distributed.env import PeerFailureError, failure_guard, init_distributed
    from engine.training.lifecycle import logs_dir

    env = None
    try:
        env = init_distributed(timeout_s=args.timeout)
        with failure_guard(env, "training", record_dir=logs_dir(args.output)):
            code = _job(args, cfg, dataset, sampler, env, preempt)
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


def _exit(code: int) -> None:
    """Leave without interpreter finalisation: broken process groups can abort it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _report_failure(args: argparse.Namespace, env, exc: BaseException) -> None:
    """One line naming this rank and the error; the traceback on stderr under --debug, else
    in OUTPUT/logs/rank<R>.log (named in the line)."""
    from engine.training.lifecycle import record_failure

    line, tb = record_failure(args.output, None if env is None else env.rank, exc, keep_traceback=not args.debug)
    if args.debug:
        sys.stderr.write(tb)
    print(line, file=sys.stderr, flush=True)


def _options(args: argparse.Namespace):
    """The flags as the library's TrainOptions."""
    from engine.training.trainer import TrainOptions

    return TrainOptions(steps=args.steps, output=args.output, save=args.save, load=args.load,
                        load_if_exists=args.load_if_exists, finetune=args.finetune,
                        load_optim=not args.no_load_optim, load_rng=not args.no_load_rng,
                        save_interval=args.save_interval, sample_tokens=args.sample_tokens, prompt=args.prompt,
                        peak_tflops=args.peak_tflops)


def _job(args: argparse.Namespace, cfg, dataset, sampler, env, preempt=None) -> int:
    """Claim and check the output locations (exit 2 on a problem anywhere), then train."""
    from engine.training.trainer import Trainer

    rank0 = env.rank == 0
    trainer = Trainer(cfg, dataset, sampler, env, _options(args),
                      notify=lambda line: print(line, file=sys.stderr, flush=True), preempt=preempt)
    with contextlib.ExitStack() as held:  # rank 0's directory locks, released at the end
        problem = trainer.claim_outputs(held)
        if problem is not None:
            if rank0:
                print(f"argument error: {problem}", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
        eng = trainer.start()
        progress = _Progress(rank0, eng.global_steps, args.steps, cfg.steps_per_print or 10)
        result = trainer.run(on_step=progress.update, on_loop_end=progress.close)
    if result.diverged is not None:  # every rank agrees (engine.training.divergence)
        if rank0:
            print(f"error: {result.diverged}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    if not rank0:
        return 0
    if result.preempted:
        print(f"preempted at step {result.final_step}: checkpoint {result.saved}", flush=True)
        return 0
    recs = result.records
    losses = f"loss {recs[0]['loss']:.4f} -> {recs[-1]['loss']:.4f}" if recs else "nothing to train"
    counts = (f"; {recs[-1]['applied_steps']} steps applied, {recs[-1]['skipped_steps']} skipped (non-finite)"
              if recs else "")
    print(f"trained {len(recs)} steps to step {result.final_step} ({cfg.topology}, ZeRO-{cfg.zero.stage}, "
          f"{cfg.precision}): {losses}{counts}; metrics in {os.path.join(args.output, 'metrics.jsonl')}"
          + (f"; checkpoint {result.saved}" if result.saved else ""), flush=True)
    if result.sample is not None:
        print("sample (greedy):\n" + result.sample, flush=True)
    return 0


class _Progress:
    """Rank 0's progress: a tqdm bar on a terminal, else one line every ``every`` steps (and
    at the last), so that logs hold no carriage-return lines; the line's tokens/s and
    loss, tokens/s and ms/step are means over the steps since the previous line (not the last
    step's alone)."""

    def __init__(self, show: bool, start: int, total: int, every: int) -> None:
        self.show, self.step, self.total, self.every = show, start, total, max(1, every)
        self.n, self.ms, self.tokens, self.loss = 0, 0.0, 0.0, 0.0  # since the last line
        self.bar = None
        if show and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(initial=min(start, total), total=total, unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(self, rec: dict) -> None:
        self.step = rec["step"]
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}", refresh=False)
            self.bar.update(1)
            return
        self.n, self.ms, self.loss = self.n + 1, self.ms + rec["step_time_ms"], self.loss + rec["loss"]
        self.tokens += rec.get("tokens") or rec["tokens_per_s"] * rec["step_time_ms"] / 1e3
        if self.show and (self.step % self.every == 0 or self.step >= self.total):
            tok_s = self.tokens / (self.ms / 1e3) if self.ms > 0 else rec["tokens_per_s"]
            print(f"step {self.step}/{self.total}: loss {self.loss / self.n:.4f}, {tok_s:.0f} tokens/s, "
                  f"{self.ms / self.n:.0f} ms/step (means of {self.n} step{'s' if self.n > 1 else ''})",
                  file=sys.stderr, flush=True)
            self.n, self.ms, self.tokens, self.loss = 0, 0.0, 0.0, 0.0

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _shutdown() -> None:
    try:
        from engine.distributed.env import shutdown
    except ImportError:  # older engine.distributed.env without shutdown(): tear the default group down directly
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return
    shutdown()


if __name__ == "__main__":
    sys.exit(main())
