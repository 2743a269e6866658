"""The data cache under concurrency: ranks that start together build each entry once,
never see a partial entry, and a failed build leaves nothing behind."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from harness import run_ranks

from engine.data import DataError, GlobalBatchSampler, build_dataset
from engine.data.cache import cached_build

_KW = dict(train_files=None, tokenizer_model=None, document_masking=True, vocab_size=400,
           seq_len=16, embedded_max_bytes=150_000)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _build_on_rank(rank: int, world_size: int, cache_dir: str):
    import torch.distributed as dist

    handler = _Collect()
    logger = logging.getLogger("engine.data")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    dist.barrier()  # every rank reaches the (empty) cache at the same moment
    ds = build_dataset(cache_dir=cache_dir, **_KW)
    sampler = GlobalBatchSampler(ds, 8, seed=5)
    local = [sampler.local_batch(step, rank, world_size) for step in range(3)]
    builds = [m for m in handler.messages if m.startswith("building data cache entry")]
    # numpy, not tensors: torch pickles tensors as shared memory that dies with the process.
    return builds, ds.tokenizer.sha256, [(b.tokens.numpy(), b.doc_ids.numpy()) for b in local]


def test_ranks_starting_together_build_once(tmp_path, caplog):
    cache_dir = str(tmp_path / "cache")
    world = 2
    out = run_ranks(_build_on_rank, world, cache_dir, timeout=180)
    builds = [b for rank_builds, _, _ in out for b in rank_builds]
    # One tokenizer and one token file in total, whichever rank got the lock first.
    assert len(builds) == 2, builds
    assert len({sha for _, sha, _ in out}) == 1
    assert not [e for e in os.listdir(cache_dir) if ".tmp-" in e]
    # The two DP ranks' rows, glued, are the global batch a single process reads from the cache.
    with caplog.at_level(logging.INFO, logger="engine.data"):
        ds = build_dataset(cache_dir=cache_dir, **_KW)
    assert not [r for r in caplog.records if r.getMessage().startswith("building")]
    sampler = GlobalBatchSampler(ds, 8, seed=5)
    for step in range(3):
        ref = sampler.batch_at(step)
        tokens = torch.cat([torch.from_numpy(out[r][2][step][0]) for r in range(world)])
        doc_ids = torch.cat([torch.from_numpy(out[r][2][step][1]) for r in range(world)])
        assert torch.equal(tokens, ref.tokens) and torch.equal(doc_ids, ref.doc_ids)


def test_failed_build_leaves_no_entry_and_can_be_retried(tmp_path):
    entry = str(tmp_path / "thing")

    def broken(tmp: str) -> None:
        with open(os.path.join(tmp, "half"), "w") as f:
            f.write("partial")
        raise RuntimeError("builder crashed")

    with pytest.raises(RuntimeError, match="builder crashed"):
        cached_build(entry, broken)
    assert not os.path.exists(entry)
    assert [e for e in os.listdir(tmp_path) if ".tmp-" in e] == []

    def good(tmp: str) -> None:
        with open(os.path.join(tmp, "data"), "w") as f:
            f.write("done")

    assert cached_build(entry, good) == (entry, True)
    assert cached_build(entry, broken) == (entry, False)  # complete entries are never rebuilt
    assert open(os.path.join(entry, "data")).read() == "done"


def test_foreign_directory_is_not_overwritten(tmp_path):
    entry = tmp_path / "foreign"
    entry.mkdir()
    (entry / "mine.txt").write_text("user data")
    with pytest.raises(DataError, match="not a complete cache entry; delete it"):
        cached_build(str(entry), lambda tmp: None)
    assert (entry / "mine.txt").read_text() == "user data"
