"""Every command in README.md and docs/*.md, checked so that it cannot rot.

The commands are the lines of the fenced ``bash`` / ``sh`` / untagged blocks, and the inline
code spans, that start with a command word (``python``, ``torchrun``, ``deepspeed``, ``srun``,
``sbatch``, ``bash``, ``pip``), continuation lines joined, ``&&`` chains split. For each:

- the script, module or file it runs exists (``launch/train.py``, ``python -m engine.plot``,
  ``bash benchmarks/gpu_check.sh``, ...);
- every ``--flag`` after the script is one its ``--help`` (of the subcommand, where one is
  named) lists: the help is taken in-process (``runpy``), once per script and subcommand;
- every shipped config it names exists, and with ``launch/train.py`` loads at the world size
  the launcher flags give (``--nproc_per_node`` x ``--nnodes``, ``--num_gpus``, srun's
  ``--nodes`` x ``--ntasks-per-node``, 1 for plain ``python``) with no key it ignores;
- ``python -m pytest -m EXPR`` names only markers pytest.ini declares.

Commands that need what this machine lacks (GPUs, more nodes, 200 steps of 8 ranks) are run
for real only in their cheap form: tests/unit/test_docs_commands.py::test_quick_start_next_steps
trains a tiny model with ``--save``, samples from it with the documented ``--load ... --steps``
form and plots it with ``python -m engine.plot``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import sysconfig
from functools import cache
from pathlib import Path

import pytest
from harness import scaled

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
WORDS = ("python", "python3", "torchrun", "deepspeed", "srun", "sbatch", "bash", "pip")
# launcher options that take a value (the next token) before the script
_LAUNCHER_VALUE_OPTS = {"--nproc_per_node", "--nnodes", "--num_gpus", "--hostfile", "--master_addr", "--master_port",
                        "--nodes", "--ntasks-per-node", "--rdzv_backend", "--rdzv_endpoint", "--num_nodes",
                        "--include", "--exclude", "-n", "-N"}
# documented forms that name a placeholder rather than a file of this repository
_NOT_OURS = {"train.py", "my_script.py"}
# modules that run the script named after them (python -m RUNNER SCRIPT ARGS): the script is checked
_RUNNERS = {"engine.compat.deepspeed"}
# run by setuptools, not argparse: only checked to exist
_FILE_ONLY = {"setup.py"}
# scripts the engine writes at run time (not in the checkout): checked as the module they run
_WRITTEN = {"SAVE_DIR/zero_to_fp32.py": "engine.compat.zero_to_fp32"}  # engine.save_checkpoint writes it


def _blocks(text: str) -> list[str]:
    lines: list[str] = []
    for m in re.finditer(r"^```([a-z]*)\n(.*?)^```", text, re.S | re.M):
        if m.group(1) in ("bash", "sh", "shell", ""):
            body = re.sub(r"\\\n\s*", " ", m.group(2))  # continuation lines
            lines += body.splitlines()
    body = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    lines += re.findall(r"`([^`\n]+)`", body)
    return lines


def _commands(line: str) -> list[str]:
    line = re.sub(r"\$\([^)]*\)", "HOST", line)  # $(scontrol show hostnames | head -1)
    line = re.sub(r"\s#.*$", "", line).strip()   # a trailing comment
    out = []
    for part in line.split("&&"):
        part = part.strip()
        toks = part.split()
        while toks and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", toks[0]):  # VAR=value prefixes
            toks.pop(0)
        if toks and toks[0] in WORDS and len(toks) > 1:
            out.append(" ".join(toks))
    return out


def documented_commands() -> list[tuple[str, str]]:
    found: dict[str, str] = {}
    for doc in DOCS:
        for line in _blocks(doc.read_text(encoding="utf-8")):
            for cmd in _commands(line):
                found.setdefault(cmd, doc.name)
    return sorted((doc, cmd) for cmd, doc in found.items())


COMMANDS = documented_commands()


def _split(cmd: str) -> list[str]:
    cmd = re.sub(r"\[([^\]]*)\]", r"\1", cmd)  # optional parts: [--device cuda] -> --device cuda
    return [t for t in shlex.split(cmd) if t != "..."]


def _target(toks: list[str]) -> tuple[str, str, list[str], dict[str, str]]:
    """(kind, name, its arguments, launcher options) of one command: kind is script, module, file, pip or none."""
    opts: dict[str, str] = {}
    i = 0
    head = toks[0]
    if head == "pip":
        return "pip", "", toks[1:], opts
    if head in ("bash", "sbatch"):
        return "file", toks[1], toks[2:], opts
    if head in ("torchrun", "deepspeed", "srun"):
        i = 1
        while i < len(toks) and toks[i].startswith("-"):
            if toks[i] in ("-m", "--module") and head != "srun":  # the launcher runs a module
                kind, name, args, _ = _target(["python", "-m", *toks[i + 1:]])
                return kind, name, args, opts
            key, _, val = toks[i].partition("=")
            if not val and key in _LAUNCHER_VALUE_OPTS and i + 1 < len(toks):
                val = toks[i + 1]
                i += 1
            opts[key] = val
            i += 1
        if i < len(toks) and toks[i] in ("python", "python3"):
            i += 1
        elif i < len(toks) and toks[i] == "torchrun":  # srun ... torchrun ...
            kind, name, args, inner = _target(toks[i:])
            return kind, name, args, {**opts, **inner}
    else:  # python / python3
        i = 1
    if i >= len(toks):
        return "none", "", [], opts
    if toks[i] == "-m":
        if toks[i + 1] in _RUNNERS:  # runs the script (or -m module) after it: check that one
            return _target(["python", *toks[i + 2:]])[:3] + (opts,)
        return "module", toks[i + 1], toks[i + 2:], opts
    return "script", toks[i], toks[i + 1:], opts


@cache
def help_text(kind: str, name: str, sub: str = "") -> str:
    """``--help`` of a script or module, in this process (no interpreter start per command)."""
    argv0 = str(ROOT / name) if kind == "script" else name
    saved = sys.argv[:], sys.path[:], dict(os.environ)
    sys.argv = [argv0, *([sub] if sub else []), "--help"]
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            try:
                if kind == "module":
                    sys.modules.pop(f"{name}.__main__", None)  # imported by another test: run it afresh
                    runpy.run_module(name, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(argv0, run_name="__main__")
            except SystemExit as exc:
                assert exc.code in (0, None), f"{name} {sub} --help exited {exc.code}"
    finally:
        sys.argv, sys.path[:] = saved[0], saved[1]
        os.environ.clear()
        os.environ.update(saved[2])
    return buf.getvalue()


def _subcommand(kind: str, name: str, args: list[str]) -> str:
    top = help_text(kind, name)
    m = re.search(r"\{([\w,-]+)\}", top)
    if m and args and args[0] in m.group(1).split(","):
        return args[0]
    return ""


def _world(opts: dict[str, str], launcher: str) -> int | None:
    if launcher == "torchrun":
        return int(opts.get("--nproc_per_node", 1)) * int(opts.get("--nnodes", 1))
    if launcher == "deepspeed":
        return None if "--hostfile" in opts else int(opts.get("--num_gpus", 1))
    if launcher == "srun":
        if "--nnodes" in opts:  # srun ... torchrun: the torchrun options decide
            return int(opts.get("--nproc_per_node", 1)) * int(opts["--nnodes"])
        if "--nodes" in opts and "--ntasks-per-node" in opts:
            return int(opts["--nodes"]) * int(opts["--ntasks-per-node"])
        return None
    return 1


def test_the_docs_have_commands():
    """The extraction itself: the quick start's commands are among those found."""
    cmds = [c for _, c in COMMANDS]
    assert any(c.startswith("torchrun --nproc_per_node 8 launch/train.py --config configs/default.json") for c in cmds)
    assert "python -m pytest -q" in cmds and any(c.startswith("python -m engine.plot") for c in cmds)
    assert len(COMMANDS) > 30, len(COMMANDS)


@pytest.mark.parametrize("doc,cmd", COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in COMMANDS])
def test_documented_command(doc, cmd):
    from engine.config import load_config

    toks = _split(cmd)
    kind, name, args, opts = _target(toks)
    if kind in ("none", "pip"):
        return  # a bare launcher option (`srun --kill-on-bad-exit=1`) or an install line
    if name in _NOT_OURS:
        return
    if kind == "script" and name in _WRITTEN:
        kind, name = "module", _WRITTEN[name]
    if kind == "module" and name == "pytest":
        markers = re.findall(r"^\s+(\w+):", (ROOT / "pytest.ini").read_text(), re.M)
        for i, a in enumerate(args):
            if a == "-m":
                assert set(re.findall(r"\w+", args[i + 1])) - {"not", "and", "or"} <= set(markers), cmd
        return
    if kind == "file" or name in _FILE_ONLY:
        assert (ROOT / name).is_file(), f"{doc}: `{cmd}`: no file {name}"
        return
    if kind == "script":
        assert (ROOT / name).is_file(), f"{doc}: `{cmd}`: no script {name}"
    sub = _subcommand(kind, name, args)
    text = help_text(kind, name, sub)
    for a in args:
        if a.startswith("--"):
            flag = a.split("=", 1)[0]
            assert re.search(re.escape(flag) + r"\b", text), f"{doc}: `{cmd}`: {name} {sub} has no {flag}"
    configs = [a for a in args if a.endswith(".json") and a.startswith(("configs/", "benchmarks/configs/"))]
    for c in configs:
        assert (ROOT / c).is_file(), f"{doc}: `{cmd}`: no config {c}"
    if name == "launch/train.py" and configs:
        world = _world(opts, toks[0])
        if world is not None:
            cfg = load_config(ROOT / configs[0], world_size=world)
            assert cfg.ignored_keys == (), f"{doc}: `{cmd}`: {configs[0]} sets keys with no effect"


STD = sysconfig.get_paths()["stdlib"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_start_next_steps(tmp_path):
    """The quick start's train --save / --load --steps N --sample-tokens / engine.plot chain, cheap:
    1 rank, a tiny model, 2 steps."""
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "model": {"vocab_size": 256, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "seq_len": 16},
           "data": {"train_files": [os.path.join(STD, "textwrap.py")], "cache_dir": str(tmp_path / "cache")}}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)  # launch/train.py finds the engine by itself

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *argv], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                              timeout=scaled(150))

    train = run(str(ROOT / "launch" / "train.py"), "--config", "cfg.json", "--steps", "2", "--output", "runs/q",
                "--save", "runs/q/ckpt", "--sample-tokens", "0")
    assert train.returncode == 0, train.stderr[-3000:]
    assert "checkpoint" in train.stdout and "built the tokenizer (256 pieces) in" in train.stderr
    sample = run(str(ROOT / "launch" / "train.py"), "--config", "cfg.json", "--load", "runs/q/ckpt", "--steps", "2",
                 "--output", "runs/sample", "--sample-tokens", "8", "--prompt", "def main(")
    assert sample.returncode == 0, sample.stderr[-3000:]
    assert "sample (greedy):\ndef main(" in sample.stdout, sample.stdout
    assert "built the tokenizer" not in sample.stderr  # cached by the first run
    env["PYTHONPATH"] = str(ROOT)
    plot = run("-m", "engine.plot", "runs/q")
    assert plot.returncode == 0, plot.stderr
    assert plot.stdout.strip().splitlines()[-1].startswith("wrote runs/q/loss.")
