"""Measured per-layer saved bytes (benchmarks/activation_memory.py: unique storages kept for
backward, by saved-tensor hooks) within 5% of the documented formula
(engine/models/activation_memory.py, docs/activation_memory.md) for none, selective and full
recomputation, without sequence parallelism (one process) and with it (2 TP ranks), fp32
and bf16. The formula counts every tensor the block keeps, so the measured figure is exact
today; 5% is the issue's bound, leaving room for a kernel that saves a little more (e.g. a
different attention backend's statistics). A term missing or counted twice in the formula
moves a row by more than 5% (the smallest term checked, the log-sum-exp, is ~0.3%: it is
covered by the exact check of the core_attn difference)."""

from __future__ import annotations

import os
import sys

import pytest
from harness import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

NAMES = ["none", "selective (default: norm, mlp_act)", "selective norm, core_attn, mlp_act", "selective mlp",
         "full uniform 1", "full uniform 2", "full block 1"]


def _rows(tp_group, sp, dtype_name):
    import torch

    from benchmarks.activation_memory import measure_rows, tiny_model

    return measure_rows(tiny_model(64, 2, 32), 2, tp_group, sp, getattr(torch, dtype_name), NAMES, torchtitan=False)


def _check(rows):
    by = {r["policy"]: r for r in rows}
    for r in rows:
        assert abs(r["ratio"] - 1) <= 0.05, r
    # the orderings the policies promise
    assert by["full uniform 2"]["measured"] < by["full uniform 1"]["measured"] < by["selective mlp"]["measured"]
    assert by["selective (default: norm, mlp_act)"]["measured"] < by["none"]["measured"]
    assert by["selective (default: norm, mlp_act)"]["recompute_flops"] == 0
    assert by["full uniform 1"]["recompute_flops"] > 0


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.extended)])
def test_formula_without_sequence_parallelism(dtype):
    from engine.distributed.groups import NO_TP

    _check(_rows(NO_TP, False, dtype))


def _sp_rank(rank, world, dtype):
    import torch.distributed as dist

    from engine.distributed.groups import AxisGroup

    return _rows(AxisGroup.of(dist.group.WORLD, "tp"), True, dtype)


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_formula_with_sequence_parallelism():
    rows = run_ranks(_sp_rank, 2, "float32", timeout=240)
    for r in rows:
        _check(r)
