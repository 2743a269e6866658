"""launch/train.py on bad input: one clear message and exit status 2, before any process
group exists (so every rank exits on its own, without waiting for a peer)."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import time

import pytest
from harness import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(ROOT, "launch", "train.py")
STD = sysconfig.get_paths()["stdlib"]

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
                "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")


@pytest.fixture(scope="module")
def train_mod():
    spec = importlib.util.spec_from_file_location("train_entry", TRAIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for v in _LAUNCH_VARS:
        monkeypatch.delenv(v, raising=False)


def _cfg(tmp_path, **over) -> str:
    cfg = {
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "model": {"vocab_size": 256, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "seq_len": 16},
        "data": {"train_files": [os.path.join(STD, "textwrap.py")], "cache_dir": str(tmp_path / "cache")},
    }
    for k, v in over.items():
        cfg[k] = v
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _main(train_mod, capsys, *argv):
    t0 = time.monotonic()
    code = train_mod.main(list(argv))
    err = capsys.readouterr().err
    return code, err, time.monotonic() - t0


def test_missing_config_file(train_mod, capsys, tmp_path):
    code, err, _ = _main(train_mod, capsys, "--config", str(tmp_path / "nope.json"), "--steps", "1")
    assert code == 2 and err.startswith("config error:") and "nope.json" in err
    assert err.count("\n") == 1  # one line, no traceback


def test_invalid_config(train_mod, capsys, tmp_path):
    code, err, _ = _main(train_mod, capsys, "--config", _cfg(tmp_path, zero_optimization={"stagee": 1}),
                         "--steps", "1")
    assert code == 2 and "config error:" in err and "stagee" in err


def test_config_without_a_model_section(train_mod, capsys, tmp_path):
    code, err, _ = _main(train_mod, capsys, "--config", _cfg(tmp_path, model=None), "--steps", "1")
    assert code == 2 and err.startswith("config error:") and "no \"model\" section" in err


def test_steps_zero(train_mod, capsys, tmp_path):
    code, err, _ = _main(train_mod, capsys, "--config", _cfg(tmp_path), "--steps", "0")
    assert code == 2 and "--steps must be at least 1" in err


def test_missing_steps_is_a_usage_error(train_mod, tmp_path):
    with pytest.raises(SystemExit) as e:
        train_mod.main(["--config", _cfg(tmp_path)])
    assert e.value.code == 2


def test_output_that_is_a_file(train_mod, capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    code, err, _ = _main(train_mod, capsys, "--config", _cfg(tmp_path), "--steps", "1", "--output",
                         str(tmp_path / "f"))
    assert code == 2 and err.startswith("argument error:") and "--output" in err and "not a directory" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e10"])
def test_invalid_timeout(train_mod, capsys, tmp_path, value):
    """Was: exit 1 with a traceback from init_distributed (1e10: a C++ stack)."""
    code, err, _ = _main(train_mod, capsys, "--config", _cfg(tmp_path), "--steps", "1", "--timeout", value)
    assert code == 2 and err.startswith("argument error: --timeout must be a positive, finite number")
    assert err.count("\n") == 1


@pytest.mark.parametrize("flag", ["--load-if-exists", "--finetune", "--no-load-optim", "--no-load-rng"])
def test_load_flags_need_load(train_mod, capsys, tmp_path, flag):
    code, err, _ = _main(train_mod, capsys, "--config", _cfg(tmp_path), "--steps", "1", flag)
    assert code == 2 and f"{flag} needs --load PATH" in err


def test_deepspeed_flag_is_accepted(train_mod):
    args = train_mod.parse_args(["--deepspeed", "--deepspeed_config", "c.json", "--steps", "1"])
    assert args.deepspeed and args.config == "c.json"


@pytest.mark.parametrize("rank", [0, 1])
def test_usage_errors_are_printed_by_rank_0_only(train_mod, capsys, monkeypatch, rank):
    """Every rank parses the command line; argparse's usage message comes from rank 0 alone."""
    for k, v in dict(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                     TORCHELASTIC_RUN_ID="x", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        train_mod.main(["--config", "c.json", "--steps", "1", "--bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert ("unrecognized arguments: --bogus" in err) == (rank == 0) and (err == "") == (rank == 1)


@pytest.mark.parametrize("what", ["missing", "empty", "directory"])
def test_bad_data_files(train_mod, capsys, tmp_path, what):
    path = tmp_path / "data.txt"
    if what == "empty":
        path.write_text("")
    elif what == "directory":
        path.mkdir()
    data = {"train_files": [str(path)], "cache_dir": str(tmp_path / "cache")}
    code, err, _ = _main(train_mod, capsys, "--config", _cfg(tmp_path, data=data), "--steps", "1",
                         "--output", str(tmp_path / "out"))
    assert code == 2 and err.startswith("data error:") and "data.txt" in err


def test_tokenizer_that_does_not_match_the_vocab_size(train_mod, capsys, tmp_path):
    from engine.config import load_config
    from engine.training.trainer import build_data

    build_data(load_config(_cfg(tmp_path), world_size=1))  # trains a 256-piece tokenizer into the cache
    model_file = glob.glob(str(tmp_path / "cache" / "tokenizer-*" / "tokenizer.model"))[0]
    data = {"train_files": [os.path.join(STD, "textwrap.py")], "tokenizer_model": model_file,
            "cache_dir": str(tmp_path / "cache")}
    model = {"vocab_size": 320, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "seq_len": 16}
    code, err, _ = _main(train_mod, capsys, "--config", _cfg(tmp_path, data=data, model=model), "--steps", "1",
                         "--output", str(tmp_path / "out"))
    assert code == 2 and "data error" in err and "256" in err and "320" in err


@pytest.mark.parametrize("rank", [0, 1])
def test_world_size_that_does_not_match_the_config_exits_on_every_rank(train_mod, capsys, tmp_path, monkeypatch,
                                                                        rank):
    """Rank 1 of 3 (no peer exists): it must exit 2 at once, not wait in a rendezvous.
    Only rank 0 prints, so the job shows the message once."""
    cfg = _cfg(tmp_path, tensor_parallel={"autotp_size": 2})
    for k, v in dict(RANK=str(rank), WORLD_SIZE="3", LOCAL_RANK=str(rank), LOCAL_SIZE="3",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT="29999").items():
        monkeypatch.setenv(k, v)
    code, err, seconds = _main(train_mod, capsys, "--deepspeed_config", cfg, "--steps", "1",
                               f"--local_rank={rank}")
    assert code == 2 and seconds < 30
    if rank == 0:
        assert "config error" in err and "3" in err and "divisible" in err
    else:
        assert err == ""


def test_script_runs_from_the_repo_root_without_installing(tmp_path):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    for v in _LAUNCH_VARS:
        env.pop(v, None)
    proc = subprocess.run([sys.executable, "launch/train.py", "--config", str(tmp_path / "missing.json"),
                           "--steps", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(120))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("config error:") and "Traceback" not in proc.stderr


def test_default_timeout_is_30_minutes(train_mod):
    """A first-step JIT build or a large save on NCCL can take minutes: the default collective
    timeout is 30 minutes, ``init_distributed``'s default and torch's ``default_pg_timeout``
    (was 600 s). DeepSpeed 0.19 itself defaults to 10 minutes (``DEEPSPEED_TIMEOUT``)."""
    import datetime
    import inspect

    from torch.distributed.constants import default_pg_timeout

    from engine.distributed.env import init_distributed

    ours = train_mod.parse_args(["--config", "c.json", "--steps", "1"], speak=False).timeout
    assert ours == inspect.signature(init_distributed).parameters["timeout_s"].default == 1800.0
    assert datetime.timedelta(seconds=ours) == default_pg_timeout


def test_progress_line_reports_means_over_its_interval(train_mod, capsys):
    """Without a terminal: one line every `every` steps, its loss, tokens/s and ms/step the
    means of the steps since the previous line (not the last step's alone)."""
    prog = train_mod._Progress(True, 0, 4, 2)
    for step, (loss, ms) in enumerate([(8.0, 100.0), (6.0, 300.0), (5.0, 200.0), (4.0, 200.0)], 1):
        prog.update({"step": step, "loss": loss, "step_time_ms": ms, "tokens": 1000,
                     "tokens_per_s": 1000 / (ms / 1e3)})
    prog.close()
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["step 2/4: loss 7.0000, 5000 tokens/s, 200 ms/step (means of 2 steps)",
                     "step 4/4: loss 4.5000, 5000 tokens/s, 200 ms/step (means of 2 steps)"]


def test_first_run_builds_are_announced_with_their_time(tmp_path, caplog):
    """The tokenizer and token file a first run builds are named, with how long they took, on
    the 'engine.build' logger that launch/train.py shows by default."""
    import logging

    from engine.data import build_dataset

    kw = dict(train_files=[os.path.join(STD, "textwrap.py")], tokenizer_model=None, cache_dir=str(tmp_path),
              document_masking=False, vocab_size=256, seq_len=16)
    with caplog.at_level(logging.INFO, logger="engine.build"):
        build_dataset(**kw)
    msgs = [r.getMessage() for r in caplog.records if r.name == "engine.build"]
    assert msgs[0].startswith("building the tokenizer (256 pieces) (once; cached in ")
    assert any(m.startswith("built the tokenizer (256 pieces) in ") and m.endswith(" s") for m in msgs), msgs
    assert any(m.startswith("built the token file in ") for m in msgs), msgs
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.build"):
        build_dataset(**kw)  # cached: nothing to say
    assert [r for r in caplog.records if r.name == "engine.build"] == []


def test_the_launcher_shows_build_messages_by_default(train_mod, capsys, tmp_path):
    import logging

    code, _, _ = _main(train_mod, capsys, "--config", str(tmp_path / "nope.json"), "--steps", "1")
    assert code == 2 and logging.getLogger("engine.build").level == logging.INFO
