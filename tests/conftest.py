"""Shared pytest setup: makes tests/harness.py importable and marks GPU tests."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The strict NCCL-rules mode (engine.distributed.strict) is on in every rank the suite starts: the
# harness's spawned ranks and the subprocess runs of launch/train.py inherit it.
os.environ.setdefault("ENGINE_STRICT_COMM", "1")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
