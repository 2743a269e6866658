"""Every JSON file in configs/ loads, round-trips through to_dict, and has the shape docs/config.md promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import scaled

from engine.config import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"

# The world sizes each shipped config is meant for (docs/config.md, "Shipped configs").
WORLD_SIZES = {
    "default.json": [8],
    "zero0.json": [2],
    "zero1.json": [2],
    "zero2.json": [2],
    "zero3.json": [2],
    "single_gpu.json": [1],
    "multinode.json": [16, 32],
    "zero3_300m_dp8.json": [8],
    "llama-8b.json": [8],
    "llama-70b.json": [64],
}


def test_every_shipped_config_is_listed():
    assert sorted(p.name for p in CONFIGS.glob("*.json")) == sorted(WORLD_SIZES)


@pytest.mark.parametrize("name,world", [(n, w) for n, ws in WORLD_SIZES.items() for w in ws])
def test_shipped_config_loads_and_round_trips(name, world):
    cfg = load_config(CONFIGS / name, world_size=world)
    assert cfg.world_size == world and cfg.dp * cfg.tp * cfg.pp == world
    assert cfg.train_batch_size == cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * cfg.dp
    again = load_config(json.loads(json.dumps(cfg.to_dict())), world_size=world)
    assert again == cfg


def test_default_is_the_cpu_3d_reference_run():
    cfg = load_config(CONFIGS / "default.json", world_size=8)
    assert (cfg.dp, cfg.tp, cfg.pp) == (2, 2, 2)
    assert cfg.zero.stage == 1 and cfg.pipeline.schedule == "1f1b" and cfg.precision == "fp32"
    assert cfg.gradient_accumulation_steps >= 4  # enough microbatches for 1F1B's steady state on 2 stages
    assert cfg.optimizer.type == "AdamW" and cfg.scheduler is not None and cfg.gradient_clipping == 1.0
    m = cfg.model
    assert (m.vocab_size, m.hidden_size, m.num_layers, m.num_heads, m.seq_len) == (2048, 128, 4, 4, 128)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_variants(stage):
    cfg = load_config(CONFIGS / f"zero{stage}.json", world_size=2)
    assert cfg.zero.stage == stage and cfg.dp == 2 and cfg.tp == cfg.pp == 1


def test_single_gpu_and_multinode():
    one = load_config(CONFIGS / "single_gpu.json", world_size=1)
    assert one.precision == "bf16" and one.zero.stage == 0 and one.world_size == 1
    multi = load_config(CONFIGS / "multinode.json", world_size=16)
    assert (multi.tp, multi.pp, multi.dp) == (1, 2, 8)  # the planner's pick: tests/unit/test_planner_configs.py
    assert multi.precision == "bf16" and multi.zero.stage == 3 and multi.pipeline.schedule == "zb-h1"
    assert load_config(CONFIGS / "multinode.json", world_size=32).dp == 16


@pytest.mark.parametrize("name,world", [(n, ws[0]) for n, ws in WORLD_SIZES.items()])
def test_shipped_configs_trigger_no_warning(name, world, caplog, recwarn):
    """A shipped config sets no key the engine ignores ("no effect here, remove it") and nothing
    the reference model warns about (check_reference_support: partition_activations)."""
    import logging

    from engine.pipeline.stages import check_reference_support

    with caplog.at_level(logging.WARNING):
        cfg = load_config(CONFIGS / name, world_size=world)
        check_reference_support(cfg)
    assert cfg.ignored_keys == (), f"{name} sets keys that have no effect: {cfg.ignored_keys}"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert [str(w.message) for w in recwarn] == []


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks" / "configs").glob("*.json")), ids=lambda p: p.name)
def test_benchmark_configs_set_no_ignored_key(path):
    raw = json.loads(path.read_text())
    world = raw.get("pipeline", {}).get("stages", 1) * raw.get("tensor_parallel", {}).get("autotp_size", 1)
    assert load_config(path, world_size=world).ignored_keys == ()


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "engine.config", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=scaled(120))


def test_cli(tmp_path, capsys):
    from engine.config.__main__ import main

    # Success in-process (each subprocess imports torch through engine.models: seconds on a busy machine).
    assert main([str(CONFIGS / "default.json"), "--world-size", "8"]) == 0
    out = capsys.readouterr()
    assert load_config(json.loads(out.out), world_size=8) == load_config(CONFIGS / "default.json", world_size=8)
    assert "dp=2 tp=2 pp=2" in out.err

    # Failure through the real entry point: exit status 2 and one readable line.
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dict(json.loads((CONFIGS / "zero1.json").read_text()), zero_optimisation={})))
    res = _cli(str(bad), "--world-size", "2")
    assert res.returncode == 2 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: "), res.stderr
    assert "zero_optimisation" in lines[0] and "did you mean 'zero_optimization'" in lines[0]
