#!/usr/bin/env python
"""Train the reference GPT described by a DeepSpeed-format config.

    python launch/train.py --config configs/zero0.json --steps 50 --output runs/x      # 1 rank
    torchrun --nproc_per_node 8 launch/train.py --config configs/default.json --steps 100 --output runs/x
    deepspeed --num_gpus 8 launch/train.py --deepspeed_config configs/default.json --steps 100 --output runs/x
    srun -n 8 python launch/train.py --config configs/default.json --steps 100 --output runs/x

Checkpoints (Megatron's flags): ``--save DIR`` saves at the end, every ``--save-interval N``
steps (default: the config's ``checkpoint.save_interval``) and on SIGTERM/SIGUSR1 (then it
exits 0 after the current step); ``--load DIR`` resumes from the tag ``DIR/latest`` names,
at any (dp, tp, pp, ZeRO stage); ``--steps`` is the total step count to reach.

Writes ``metrics.jsonl`` (one JSON object per optimizer step), ``memory.json``,
``config.json`` (the resolved config) and TensorBoard events (if installed) into
``--output``, shows a progress bar on rank 0 and ends with a short greedy sample.
Bad input (config, paths, data, ``--steps``, world size) exits with status 2 on every
rank before any process group exists. See docs/training.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "engine")):  # run from a checkout without installing
    sys.path.insert(0, _ROOT)

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train the reference GPT with DP x TP x PP and ZeRO.",
                                allow_abbrev=False)
    p.add_argument("--config", "--deepspeed_config", dest="config", required=True, metavar="PATH",
                   help="DeepSpeed-format JSON config (see docs/config.md)")
    p.add_argument("--steps", type=int, required=True, metavar="N",
                   help="total optimizer steps to reach (>= 1; a run resumed at step k trains N - k more)")
    p.add_argument("--save", default=None, metavar="DIR",
                   help="checkpoint directory: save at the end, every --save-interval steps and on SIGTERM/SIGUSR1")
    p.add_argument("--load", default=None, metavar="DIR",
                   help="resume from the checkpoint DIR/latest names (saved at any layout)")
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
    p.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p.parse_args(argv)


def _bad_input(kind: str, exc: BaseException, speak: bool) -> int:
    if speak:
        print(f"{kind} error: {exc}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    from engine.config import ConfigError, load_config
    from engine.data import DataError
    from engine.dist.env import LaunchError, detect_launch

    # 1. where am I (no process group yet); one message per node for input errors
    try:
        info = detect_launch(os.environ, sys.argv if argv is None else [sys.argv[0], *argv])
    except LaunchError as exc:
        return _bad_input("launch", exc, True)
    speak = info.local_rank == 0
    # 2. config, steps, output, data: every rank checks, before any collective
    try:
        cfg = load_config(args.config, world_size=info.world_size)
    except ConfigError as exc:
        return _bad_input("config", exc, speak)
    if cfg.model is None:
        return _bad_input("config", ConfigError(
            f"{args.config} has no \"model\" section: launch/train.py trains the reference GPT it describes; "
            "add one with vocab_size, hidden_size, num_layers, num_heads and seq_len (see configs/default.json)"),
            speak)
    if args.steps < 1:
        return _bad_input("argument", ValueError(f"--steps must be at least 1, got {args.steps}"), speak)
    if args.save_interval is not None and args.save_interval < 0:
        return _bad_input("argument", ValueError(f"--save-interval must be >= 0, got {args.save_interval}"), speak)
    if args.load is not None and not os.path.isdir(args.load):
        return _bad_input("argument", ValueError(f"--load {args.load!r} is not a directory"), speak)
    if args.save is not None:
        try:
            os.makedirs(args.save, exist_ok=True)
        except OSError as exc:
            return _bad_input("argument", OSError(f"cannot use --save {args.save!r}: {exc}"), speak)
    if args.sample_tokens < 0:
        return _bad_input("argument", ValueError(f"--sample-tokens must be >= 0, got {args.sample_tokens}"), speak)
    try:
        os.makedirs(args.output, exist_ok=True)
        if not os.access(args.output, os.W_OK):
            raise PermissionError(f"{args.output} is not writable")
    except OSError as exc:
        return _bad_input("output", OSError(f"cannot use --output {args.output!r}: {exc}"), speak)
    try:
        from engine.runtime.trainer import build_data

        dataset, sampler = build_data(cfg)
    except DataError as exc:
        return _bad_input("data", exc, speak)
    return _run(args, cfg, dataset, sampler)


def _run(args: argparse.Namespace, cfg, dataset, sampler) -> int:
    import engine
    from engine.dist.env import PeerFailureError, failure_guard, init_distributed

    env = None
    try:
        env = init_distributed(timeout_s=args.timeout)
        with failure_guard(env, "training"):
            _train(args, cfg, dataset, sampler, env, engine)
    except KeyboardInterrupt:
        if env is None or env.rank == 0:
            print("\ninterrupted: stopping all ranks", file=sys.stderr, flush=True)
        # no collective on the way out: the peers are being interrupted too, and a peer
        # that is not fails its next collective at once when this process's sockets close
        os._exit(EXIT_INTERRUPTED)
    except PeerFailureError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        os._exit(1)
    _shutdown()
    return 0


def _train(args: argparse.Namespace, cfg, dataset, sampler, env, engine) -> None:
    from tqdm import tqdm

    from engine.checkpoint import load_checkpoint
    from engine.checkpoint.preempt import Checkpointer, StopTraining
    from engine.runtime.generate import gather_reference_model, greedy_generate
    from engine.runtime.trainer import train, write_memory_report, write_resolved_config

    rank0 = env.rank == 0
    eng, *_ = engine.initialize(config=cfg, dist_env=env)
    if args.load is not None:
        load_checkpoint(eng, args.load)  # nothing there yet: a warning, and a fresh start
    if rank0:
        write_resolved_config(cfg, args.output)
        _keep_metrics_up_to(os.path.join(args.output, "metrics.jsonl"), eng.global_steps)
    bar = tqdm(initial=min(eng.global_steps, args.steps), total=args.steps, disable=not rank0, unit="step",
               dynamic_ncols=True, file=sys.stderr)
    records: list = []
    interval = cfg.checkpoint.save_interval if args.save_interval is None else args.save_interval
    with Checkpointer(eng, args.save, interval) as ckpt:
        def on_step(rec: dict) -> None:
            records.append(rec)
            bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}", refresh=False)
            bar.update(1)
            if ckpt.after_step():
                raise StopTraining

        try:
            train(eng, sampler, max(0, args.steps - eng.global_steps), output_dir=args.output,
                  peak_tflops=args.peak_tflops, on_step=on_step)
        except StopTraining:
            pass
        bar.close()
        saved = ckpt.finish()
    if ckpt.preempted:
        if rank0:
            print(f"preempted at step {eng.global_steps}: checkpoint {saved}", flush=True)
        eng.destroy()
        return
    write_memory_report(eng, args.output)
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
