"""Global batches: deterministic in (seed, step), independent of dp/tp/pp and the
micro-batch split, epochs wrap with a fresh permutation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.data import (
    Batch,
    DataError,
    GlobalBatchSampler,
    accumulation_steps,
    batch_at,
    build_dataset,
    dp_slice,
    epoch_permutation,
    microbatches,
    sample_indices,
)
from engine.topology import Topology


def _build(cache_dir, document_masking=True):
    # Embedded default corpus with a small cap: ~60k tokens, trained once per cache dir.
    return build_dataset(train_files=None, tokenizer_model=None, cache_dir=str(cache_dir),
                         document_masking=document_masking, vocab_size=400, seq_len=16,
                         embedded_max_bytes=150_000)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="module")
def dataset(cache_dir):
    return _build(cache_dir)


G = 24


def test_split_over_dp_and_microbatches_reassembles_global_batch(dataset):
    sampler = GlobalBatchSampler(dataset, G, seed=1234)
    for step in (0, 7):
        full = sampler.batch_at(step)
        assert full.tokens.shape == (G, 17) and full.doc_ids.shape == (G, 17)
        for dp, micro in [(1, 24), (1, 1), (2, 3), (3, 2), (4, 6), (6, 4), (8, 1), (2, 12), (24, 1)]:
            gas = accumulation_steps(G, micro, dp)
            pieces = []
            for r in range(dp):
                mbs = sampler.local_microbatches(step, r, dp, micro)
                assert len(mbs) == gas and all(len(m) == micro for m in mbs)
                # Reading only the local rows equals slicing the global batch.
                assert Batch.cat(mbs).equal(dp_slice(full, r, dp))
                assert all(a.equal(b) for a, b in zip(mbs, microbatches(dp_slice(full, r, dp), micro)))
                pieces.extend(mbs)
            assert Batch.cat(pieces).equal(full), (dp, micro)
            # The plain-tensor path of the split helpers gives the same rows.
            flat = [m for r in range(dp) for m in microbatches(dp_slice(full.tokens, r, dp), micro)]
            assert torch.equal(torch.cat(flat), full.tokens)


def test_same_data_on_every_tp_and_pp_rank_of_a_replica(dataset):
    """Each rank of a 3D topology asks for its data the way the training loop does (by its
    dp coordinate); ranks of one DP replica must get identical rows, and the replicas
    together the global batch — for every (dp, tp, pp) shape with the same global batch."""
    reference = GlobalBatchSampler(dataset, G, seed=7)
    for dims in [(1, 1, 1), (2, 2, 2), (4, 2, 1), (1, 2, 4), (3, 1, 2), (8, 1, 1)]:
        topo = Topology(dp=dims[0], tp=dims[1], pp=dims[2])
        sampler = GlobalBatchSampler(dataset, G, seed=7)  # built per run, as each job would
        for step in (0, 3):
            by_dp: dict[int, Batch] = {}
            for rank in range(topo.world_size):
                c = topo.coord(rank)
                local = sampler.local_batch(step, c.dp, topo.dp)
                if c.dp in by_dp:
                    assert local.equal(by_dp[c.dp]), (dims, rank)
                by_dp[c.dp] = local
            glued = Batch.cat([by_dp[r] for r in range(topo.dp)])
            assert glued.equal(reference.batch_at(step)), dims


def test_deterministic_across_separately_built_samplers_and_datasets(dataset, cache_dir, tmp_path):
    a = GlobalBatchSampler(dataset, G, seed=3)
    b = GlobalBatchSampler(_build(cache_dir), G, seed=3)  # reopened from the cache
    c = GlobalBatchSampler(_build(tmp_path), G, seed=3)  # rebuilt from scratch elsewhere
    for step in [5, 0, 123, 5]:  # out of order: no hidden iteration state
        ref = a.batch_at(step)
        assert b.batch_at(step).equal(ref) and c.batch_at(step).equal(ref)
        assert batch_at(dataset, step, G, 3).equal(ref)
    assert not torch.equal(a.batch_at(0).tokens, a.batch_at(1).tokens)
    assert not torch.equal(a.batch_at(0).tokens, GlobalBatchSampler(dataset, G, 4).batch_at(0).tokens)


def _mix64_reference(x: int) -> int:
    m = (1 << 64) - 1
    x &= m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_epoch_permutation_matches_pure_python_reference():
    """The vectorised numpy hash (wrapping uint64 arithmetic) agrees with exact integer
    maths, so the order cannot drift with numpy's overflow or promotion rules."""
    golden = 0x9E3779B97F4A7C15
    for n, seed, epoch in [(1, 0, 0), (10, 0, 0), (257, 99, 3), (1000, 2**63 + 5, 12)]:
        base = _mix64_reference(_mix64_reference(seed) ^ _mix64_reference(epoch + golden))
        keys = [_mix64_reference(base + i * golden) for i in range(n)]
        expected = sorted(range(n), key=lambda i: keys[i])
        assert epoch_permutation(n, seed, epoch).tolist() == expected


def test_epochs_wrap_with_a_new_permutation():
    n, g, seed = 50, 8, 11  # 50 is not a multiple of 8: batches straddle epoch ends
    steps = 3 * n // g + 1
    samples = np.concatenate([sample_indices(s, g, n, seed) for s in range(steps)])
    for e in range(3):
        epoch = samples[e * n:(e + 1) * n]
        assert sorted(epoch.tolist()) == list(range(n))  # each sequence once per epoch
        assert np.array_equal(epoch, epoch_permutation(n, seed, e))
    assert not np.array_equal(epoch_permutation(n, seed, 0), epoch_permutation(n, seed, 1))
    # A global batch larger than the dataset spans several epochs.
    big = sample_indices(0, 3 * n, n, seed)
    assert np.array_equal(big, np.concatenate([epoch_permutation(n, seed, e) for e in range(3)]))


def test_bad_split_sizes(dataset):
    with pytest.raises(DataError, match="train_batch_size 24 is not divisible"):
        accumulation_steps(24, 5, 2)
    with pytest.raises(DataError, match="cannot be split over dp = 5"):
        dp_slice(torch.zeros(24, 3), 0, 5)
    with pytest.raises(DataError, match="out of range"):
        dp_slice(torch.zeros(24, 3), 2, 2)
    with pytest.raises(DataError, match="micro-batches of 5"):
        microbatches(torch.zeros(12, 3), 5)
    with pytest.raises(DataError, match="step must be"):
        GlobalBatchSampler(dataset, G, 0).indices_at(-1)
    with pytest.raises(DataError, match="seed must be"):
        GlobalBatchSampler(dataset, G, -1)
    with pytest.raises(DataError, match="global batch size must be"):
        GlobalBatchSampler(dataset, 0, 0)
