"""Regenerate tests/assets/hf_trainer_ds_deepspeed.json: real DeepSpeed under Hugging Face's
Trainer, running tests/assets/hf_trainer_ds.py under torchrun on 2 CPU ranks (gloo), at
ZeRO-2 and ZeRO-3, with the Trainer's optimizer (``client``: HF's AdamW + linear schedule passed
to deepspeed.initialize) and with DeepSpeed's own from the config (``config``: AdamW +
WarmupDecayLR, "auto" values filled by HF), and at ZeRO-3 with the model built after
TrainingArguments by ``AutoModelForCausalLM.from_config`` (``from_config``: under
``deepspeed.zero.Init``, weights initialized gathered by HF's ``initialize_weights_zero3``).

    OMP_NUM_THREADS=1 python tests/assets/make_hf_trainer_golden.py /tmp/hf_golden
"""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = {**{f"zero{z}_{opt}": (z, opt) for z in (2, 3) for opt in ("client", "config")},
         "zero3_from_config": (3, "from_config")}


def run(work: str, zero: int, opt: str, port: int, via_alias: bool = False, env: "dict | None" = None) -> dict:
    """One torchrun launch of the script; its result (rank 0's JSON)."""
    os.makedirs(work, exist_ok=True)
    out = os.path.join(work, "result.json")
    cmd = ["torchrun", "--nproc_per_node", "2", "--master_port", str(port)]
    if via_alias:
        cmd += ["-m", "engine.compat.deepspeed"]
    cmd += [os.path.join(HERE, "hf_trainer_ds.py"), "--zero", str(zero), "--out", out]
    if opt == "config":
        cmd.append("--config_optimizer")
    elif opt == "from_config":
        cmd.append("--from_config")
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    if via_alias and "outlive shutdown()" in proc.stderr:  # the runner's teardown left a group alive
        raise RuntimeError(f"{' '.join(cmd)}: a process group outlived the teardown:\n{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def main(work: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)  # real DeepSpeed, nothing of this checkout on the path
    golden = {name: run(os.path.join(work, name), z, opt, 29661 + i, env=env)
              for i, (name, (z, opt)) in enumerate(CASES.items())}
    with open(os.path.join(HERE, "hf_trainer_ds_deepspeed.json"), "w") as f:
        json.dump(golden, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
