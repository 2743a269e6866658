"""Launching the DeepSpeed example equivalents of tests/ds_examples/ on 2 gloo ranks, under
real DeepSpeed 0.19.8 (``which="ds"``: the script as it is, ``import deepspeed`` finding the
installed package) or under this engine (``which="ours"``: the same unedited script, every rank
started through ``-m engine.compat.deepspeed``, which aliases ``deepspeed`` to the engine),
with torchrun or the ``deepspeed`` launcher. Each rank writes its record to
``<workdir>/<run>.rank<R>.json`` (tests/ds_examples/_losslog.py).

DeepSpeed's records are kept in tests/assets/ds_examples_deepspeed.json, which this module
rewrites by running every scenario under real DeepSpeed with torchrun:

    OMP_NUM_THREADS=1 PYTHONPATH=tests/distributed:. python tests/distributed/_ds_examples_runner.py --write-golden [SCENARIO ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "tests" / "ds_examples"
GOLDEN = ROOT / "tests" / "assets" / "ds_examples_deepspeed.json"
WORLD = 2

# scenario -> its runs in order: (run name, script, arguments); "{work}" is the scenario's
# working directory (checkpoints), "{ex}" tests/ds_examples
_BERT = ["--max_seq_length", "32", "--num_layers", "2", "--num_heads", "4", "--ff_dim", "64", "--h_dim", "32",
         "--dropout", "0.0", "--batch_size", "4", "--checkpoint_every", "3", "--dtype", "fp32"]
SCENARIOS: dict[str, list[tuple[str, str, list[str]]]] = {
    "pipeline": [("train", "pipeline_parallelism_train.py",
                  ["--deepspeed_config", "{ex}/pipeline_ds_config.json", "-s", "4", "--backend", "gloo",
                   "--num_samples", "64"])],
    "cifar10": [("train", "cifar10_deepspeed.py",
                 ["--deepspeed", "--dtype", "fp32", "--stage", "1", "--num_samples", "96", "--epochs", "2",
                  "--max_steps", "4"])],
    "hello_deepspeed": [("train", "hello_deepspeed_train_bert_ds.py",
                         [*_BERT, "--checkpoint_dir", "{work}/ckpt", "--num_iterations", "5"]),
                        ("resume", "hello_deepspeed_train_bert_ds.py",
                         ["--load_checkpoint_dir", "{work}/ckpt/bert_pretrain", "--num_iterations", "9",
                          "--dtype", "fp32"])],  # dtype is not among the hparams the original saves
    "zero_to_fp32": [("train", "zero_to_fp32_flow.py", ["--zero_stage", "3", "--save_dir", "{work}/ckpt"])],
    "autotp": [("train", "autotp_training.py", ["--autotp_size", "2", "--zero_stage", "1"])],
    "bf16_master_weight": [("train", "bf16_master_weight_train.py",
                            ["--deepspeed_config", "{ex}/bf16_configs/baseline.json"])],
    # the same example with bf16 master weights, gradients and Adam moments under torch_autocast
    # (its bf16_full.json); its bf16_master_wg.json (bf16 masters, fp32 moments) is refused by
    # DeepSpeed without ZeRO-Offload and by the engine alike (test_ds_examples.py)
    "bf16_full": [("train", "bf16_master_weight_train.py",
                   ["--deepspeed_config", "{ex}/bf16_configs/bf16_full.json"])],
}


def _env(which: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    # the suite's strict NCCL-rules mode (tests/conftest.py) checks the engine's own code; these
    # are users' scripts and models (Hugging Face's masks read a bool on the host in the forward)
    env.pop("ENGINE_STRICT_COMM", None)
    if which == "ours":
        env["PYTHONPATH"] = str(ROOT)  # this checkout's engine
    return env


def launch(which: str, launcher: str, script: str, args: list[str], workdir: Path, run: str,
           timeout: float = 300) -> dict[str, Any]:
    """Run one script on WORLD ranks; returns ``{rank: record}``."""
    from engine.distributed.spawn import free_port

    workdir.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    if launcher == "torchrun":
        cmd = ["torchrun", "--nproc_per_node", str(WORLD), "--master_port", port]
        alias = ["-m", "engine.compat.deepspeed"]
    else:
        cmd = ["deepspeed", "--num_gpus", str(WORLD), "--master_port", port]
        alias = ["--module", "engine.compat.deepspeed"]
    if which == "ours":
        cmd += alias
    log = workdir / run
    args = [a.replace("{work}", str(workdir)).replace("{ex}", str(EXAMPLES)) for a in args]
    cmd += [str(EXAMPLES / script), *args, "--loss_log_file", str(log)]
    proc = subprocess.run(cmd, cwd=str(workdir), env=_env(which), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{which} {launcher} {script} failed ({proc.returncode}):\n"
                             + proc.stdout[-3000:] + proc.stderr[-6000:])
    return {str(r): json.loads(Path(f"{log}.rank{r}.json").read_text()) for r in range(WORLD)}


def run_scenario(name: str, which: str, launcher: str, workdir: Path, timeout: float = 300) -> dict[str, Any]:
    """Every run of scenario ``name`` in order: ``{run: {rank: record}}``."""
    return {run: launch(which, launcher, script, args, workdir, run, timeout)
            for run, script, args in SCENARIOS[name]}


def golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())["scenarios"]


def write_golden(work: Path, names: list[str]) -> None:
    """Run ``names`` (all when empty) under real DeepSpeed into the golden file, keeping the
    other scenarios' records; written after each scenario."""
    import deepspeed
    import torch

    out = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"scenarios": {}}
    out.update({"deepspeed": deepspeed.__version__, "torch": torch.__version__, "launcher": "torchrun",
                "world_size": WORLD})
    for name in names or SCENARIOS:
        out["scenarios"][name] = run_scenario(name, "ds", "torchrun", work / name, timeout=900)
        GOLDEN.write_text(json.dumps(out, indent=1) + "\n")
        print(name, "done", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--write-golden"]:
        raise SystemExit(__doc__)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        write_golden(Path(tmp), sys.argv[2:])
