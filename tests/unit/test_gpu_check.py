"""The first GPU check (benchmarks/gpu_check.sh) as far as CPU can show it: the dry run
lists every step with its time box and the three files it would leave, writes nothing,
fits the 7-minute deadline; the smoke driver runs its cases on CPU and fails loudly."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECK = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
SMOKE = os.path.join(ROOT, "benchmarks", "gpu_smoke.py")


def test_dry_run_lists_steps_time_boxes_and_three_files(tmp_path):
    out = tmp_path / "out"
    before = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    r = subprocess.run(["bash", CHECK, str(out), "--dry-run"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    steps = re.findall(r"^(\w+) \(time box (\d+)s", r.stdout, flags=re.M)
    names = [n for n, _ in steps]
    assert names == ["ops_build", "versions", "smoke", "gpu_tests", "fused", "adam_kernel", "throughput"], r.stdout
    assert "deadline 420s" in r.stdout
    # every engine command runs with python3 (the GPU image has no `python`)
    assert all(line.split(": ", 1)[1].startswith("python3 ") for line in r.stdout.splitlines() if "time box" in line)
    assert "files left in" in r.stdout and "summary.md results.json logs.tar.gz" in r.stdout
    assert not out.exists()  # a dry run leaves nothing
    after = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    assert after == before  # and writes nothing into the tree


def test_check_requires_an_output_directory():
    r = subprocess.run(["bash", CHECK], capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "usage: bash benchmarks/gpu_check.sh OUT" in r.stderr


@pytest.mark.slow
def test_smoke_driver_runs_its_cases_on_cpu(tmp_path):
    out = tmp_path / "smoke.json"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, SMOKE, "smoke", "--device", "cpu", "--steps", "2", "--cases",
                        "zero3,ckpt_docmask,muon", "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["ok"] and set(res["cases"]) == {"zero3", "ckpt_docmask", "muon"}
    for case in res["cases"].values():
        assert case["ok"] and len(case["losses"]) == 2 and case["host_syncs_per_step"] is None
    bad = subprocess.run([sys.executable, SMOKE, "smoke", "--cases", "nope", "--out", str(out)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode != 0 and "unknown case(s) ['nope']" in bad.stderr
