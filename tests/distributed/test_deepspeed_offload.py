"""The Hugging Face DeepSpeed integration's ZeRO-2 and ZeRO-3 offload example configs
(tests/assets/hf_ds_config_zero{2,3}_offload.json, "auto" values filled) under a DeepSpeed-API
script (tests/assets/ds_offload_train.py: initialize(args=..., model=..., model_parameters=...)
with the config's AdamW and WarmupLR, gradient accumulation 2) with only its import changed
to ``import engine.compat.deepspeed as deepspeed``, on 2 gloo ranks under torchrun:

- the configs pass ``python -m engine.config`` unchanged (and the Trainer's default fill,
  warmup_min_lr 0, too);
- the script's losses equal real DeepSpeed 0.19.8's offload path on CPU (its DeepSpeedCPUAdam
  on the host; golden files tests/assets/ds_offload_train_deepspeed_z{2,3}.json written by
  running the unchanged script under DeepSpeed; the slow test re-runs DeepSpeed live).

The filled configs are what the Trainer writes for a 3-step warmup (warmup_min_lr 0,
warmup_max_lr = lr, warmup_num_steps 3), so the golden learning rates are WarmupLR's log ramp
0, 0.0063, 0.01, 0.01 and the losses follow it (the first step applies lr 0).
Tolerance: 1e-5 absolute on losses of O(1) (fp32; DeepSpeed's AVX Adam
orders the bias correction differently, ~1e-7 per step; measured max 3.6e-7). A missing
clip, a gradient shard copied before its reduction, or the wrong moments move losses by 1e-3+.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.distributed.spawn import free_port

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "tests" / "assets"
SCRIPT = ASSETS / "ds_offload_train.py"
ATOL = 1e-5


def _config(stage: int) -> Path:
    return ASSETS / f"hf_ds_config_zero{stage}_offload.json"


def _ours(tmp_path: Path) -> Path:
    text = SCRIPT.read_text()
    assert text.count("\nimport deepspeed\n") == 1
    out = tmp_path / "ours_offload_train.py"
    out.write_text(text.replace("\nimport deepspeed\n", "\nimport engine.compat.deepspeed as deepspeed\n"))
    return out


def _launch(script: Path, stage: int, workdir: Path, engine: bool) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / f"result_z{stage}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    if engine:
        env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(script), "--deepspeed", "--deepspeed_config", str(_config(stage)), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=str(workdir), env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def _golden(stage: int) -> dict:
    return json.loads((ASSETS / f"ds_offload_train_deepspeed_z{stage}.json").read_text())


def _same(ours: dict, theirs: dict, what: str) -> None:
    assert ours["world_size"] == theirs["world_size"] == 2
    for r, (a, b) in enumerate(zip(ours["ranks"], theirs["ranks"])):
        assert len(a["losses"]) == len(b["losses"]) == 8, what
        assert a["losses"] == pytest.approx(b["losses"], abs=ATOL), f"{what} rank {r}"
        assert a["lrs"] == pytest.approx(b["lrs"], rel=1e-12), f"{what} rank {r}"


@pytest.mark.parametrize("stage", [2, 3])
def test_hf_offload_configs_pass_the_config_checker(stage, tmp_path, capsys):
    """``python -m engine.config CONFIG --world-size 2`` (its main, in this process: the command
    line itself is test_shipped_configs.py's) accepts both and resolves the offload sections."""
    from engine.config.__main__ import main

    for fill_min_lr in (None, 0):  # as given, and with the Trainer's default warmup_min_lr
        path = _config(stage)
        if fill_min_lr is not None:
            cfg = json.loads(path.read_text())
            cfg["scheduler"]["params"]["warmup_min_lr"] = fill_min_lr
            path = tmp_path / "trainer_default.json"
            path.write_text(json.dumps(cfg))
        code = main([str(path), "--world-size", "2"])
        out, err = capsys.readouterr()
        assert code == 0, err[-3000:]
        z = json.loads(out)["zero_optimization"]
        assert z["stage"] == stage and z["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
        if stage == 3:
            assert z["offload_param"]["device"] == "cpu"
        else:  # off: written as DeepSpeed's default, null
            assert z["offload_param"] is None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_unchanged_script_equals_deepspeed_offload(stage, tmp_path):
    _same(_launch(_ours(tmp_path), stage, tmp_path / "ours", engine=True), _golden(stage), f"ZeRO-{stage} offload")


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [2, 3])
def test_golden_files_are_what_deepspeed_gives_now(stage, tmp_path):
    """Real DeepSpeed on CPU (its cpu_adam op JIT-builds on first use: minutes, once)."""
    pytest.importorskip("deepspeed")
    _same(_launch(SCRIPT, stage, tmp_path / "ds", engine=False), _golden(stage), f"DeepSpeed ZeRO-{stage} live")
