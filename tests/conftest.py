"""Shared pytest setup: makes tests/harness.py importable, marks GPU tests, scales every
wall-clock limit by ``ENGINE_TEST_TIME_SCALE`` (tests/harness.py: ``scaled``), says how many
parallel workers ``-n auto`` starts (pytest.ini; ``ENGINE_TEST_WORKERS``) and hands them the
heaviest files first."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The strict NCCL-rules mode (engine.distributed.strict) is on in every rank the suite starts: the
# harness's spawned ranks and the subprocess runs of launch/train.py inherit it.
os.environ.setdefault("ENGINE_STRICT_COMM", "1")

from harness import scaled  # noqa: E402  (tests/ is on sys.path from here on)

# The failure watch's and the failure guard's grace periods (default 5 s: how long a rank that
# noticed a peer's failure waits for a blocked call to return, and for the other survivors to
# check in, before it exits) are wall-clock margins too: scaled like every other limit, so a
# loaded machine does not turn a clean stop into exit 75. ENGINE_FAILURE_GRACE_S is the
# training entry point's (launch/train.py); ENGINE_FAILURE_WATCH_GRACE the watch's.
for _name in ("ENGINE_FAILURE_WATCH_GRACE", "ENGINE_FAILURE_GRACE_S"):
    os.environ.setdefault(_name, f"{scaled(5.0):g}")


WORKERS_ENV = "ENGINE_TEST_WORKERS"
_GIB_PER_WORKER = 3  # a worker's fork server plus an 8-rank test's ranks: about 3 GiB at its peak
_MAX_WORKERS = 8


def pytest_xdist_auto_num_workers(config):
    """How many workers ``-n auto`` (pytest.ini) starts: ``ENGINE_TEST_WORKERS`` if set, else
    one per core this process may use, at most 8 and at most one per 3 GiB of memory. Each
    worker runs whole files (``--dist loadfile``); their multi-rank tests share the cores, which
    the suite's scaled time limits already allow for (a second copy of the suite beside it)."""
    raw = os.environ.get(WORKERS_ENV, "").strip()
    if raw:
        if not raw.isdigit():
            raise pytest.UsageError(f"{WORKERS_ENV}={raw!r}: give a whole number of workers (0: no workers)")
        return int(raw)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):  # not POSIX: no memory bound
        gib = float(_GIB_PER_WORKER * _MAX_WORKERS)
    return max(1, min(cores, _MAX_WORKERS, int(gib // _GIB_PER_WORKER)))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """pytest-timeout's per-test limit (pytest.ini: 600 s on a quiet machine) scaled too,
    unless given on the command line."""
    if getattr(config.option, "timeout", None) is None:
        try:
            ini = config.getini("timeout")
        except ValueError:  # pytest-timeout not installed
            return
        if ini:
            config.option.timeout = scaled(float(ini))


def _heaviest_files_first(items: list) -> None:
    """Files with more tests marked slow first, then the other multi-rank files, then the rest,
    each file's tests together and in their order: the workers (``--dist loadfile``) take files
    in this order, so the long ones start early and the short ones fill in at the end instead
    of one worker finishing a long file alone."""
    slow: dict = {}
    first: dict = {}
    for i, item in enumerate(items):
        slow[item.path] = slow.get(item.path, 0) + ("slow" in item.keywords)
        first.setdefault(item.path, i)
    items.sort(key=lambda it: (-slow[it.path], "distributed" not in it.path.parts, first[it.path]))


def pytest_collection_modifyitems(config, items):
    import torch

    # The long composition matrices (marked extended) run with ENGINE_EXTENDED_TESTS=1; by
    # default each feature keeps its representative cases and the rest are deselected (pytest
    # reports the count), so the README's command stays within CI's time.
    if os.environ.get("ENGINE_EXTENDED_TESTS", "") in ("", "0"):
        extended = [item for item in items if "extended" in item.keywords]
        if extended:
            config.hook.pytest_deselected(items=extended)
            items[:] = [item for item in items if "extended" not in item.keywords]

    _heaviest_files_first(items)
    for item in items:  # a test's own @pytest.mark.timeout(N) is a quiet-machine figure too
        mark = item.get_closest_marker("timeout")
        if mark is not None and mark.args and isinstance(mark.args[0], (int, float)):
            item.add_marker(pytest.mark.timeout(scaled(float(mark.args[0])), *mark.args[1:], **mark.kwargs),
                            append=False)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
