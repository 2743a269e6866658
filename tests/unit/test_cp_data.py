"""The context-parallel data path and wiring, pure (no processes): a micro-batch cut to a
rank's head-tail shard, the hybrid group lists, and the chunk's refusal of unsharded input
under CP (and of shard positions without CP)."""

from __future__ import annotations

import pytest
import torch

from engine.context_parallel.data import shard_microbatch
from engine.context_parallel.groups import hybrid_rank_lists
from engine.context_parallel.layout import CPLayout
from engine.data import Batch
from engine.data.microbatch import to_microbatch
from engine.data.packing import position_ids_from_doc_ids
from engine.distributed.groups import AxisGroup


def _layout(cp: int, rank: int) -> CPLayout:
    return CPLayout("ring", cp, rank, 1, AxisGroup.single("cp"), None)  # groups unused by the data path


@pytest.mark.parametrize("cp", [2, 4])
def test_shards_are_head_tail_and_cover_the_row(cp):
    g = torch.Generator().manual_seed(0)
    s = 32
    tokens = torch.randint(0, 100, (3, s + 1), generator=g)
    docs = torch.cumsum((torch.rand(3, s + 1, generator=g) < 0.2).long(), 1)
    batch = Batch(tokens, docs)
    seen = torch.zeros(3, s, dtype=torch.long)
    c = s // (2 * cp)
    for r in range(cp):
        mb = shard_microbatch(to_microbatch(batch), _layout(cp, r))
        ids, tg = mb.split()
        pos = mb.kwargs["positions"]
        want = torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * cp - 1 - r) * c, (2 * cp - r) * c)])
        assert ids.shape == tg.shape == pos.shape == (3, s // cp)
        assert torch.equal(pos, want.expand(3, -1))
        assert torch.equal(ids, batch.inputs[:, want]) and torch.equal(tg, batch.targets[:, want])
        assert torch.equal(mb.kwargs["doc_ids"], batch.input_doc_ids[:, want])
        # per-document positions of the WHOLE row, then cut (a document may start on another rank)
        assert torch.equal(mb.kwargs["position_ids"], position_ids_from_doc_ids(batch.input_doc_ids)[:, want])
        seen[:, want] += 1
    assert torch.equal(seen, torch.ones_like(seen))  # every position on exactly one rank


def test_without_documents_only_positions_travel():
    mb = shard_microbatch(to_microbatch((torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long))),
                          _layout(2, 1))
    assert set(mb.kwargs) == {"positions"} and mb.kwargs["positions"][0].tolist() == [2, 3, 4, 5]


def test_bad_micro_batches_are_refused():
    with pytest.raises(ValueError, match="not divisible by 2 x context_parallel.size = 4"):
        shard_microbatch(to_microbatch((torch.zeros(1, 6, dtype=torch.long),) * 2), _layout(2, 0))
    with pytest.raises(ValueError, match="shards token ids, targets and doc_ids only"):
        shard_microbatch(to_microbatch({"input_ids": torch.zeros(1, 8), "labels": torch.zeros(1, 8),
                                        "attention_mask": torch.ones(1, 8)}), _layout(2, 0))
    with pytest.raises(ValueError, match="one shape"):
        shard_microbatch(to_microbatch((torch.zeros(1, 8), torch.zeros(1, 4))), _layout(2, 0))


def test_hybrid_rank_lists():
    g = [1, 3, 5, 7, 9, 11, 13, 15]  # a CP group of 8 (tp = 2)
    ulysses, ring = hybrid_rank_lists(g, 2)
    assert ulysses == [[1, 3], [5, 7], [9, 11], [13, 15]] and ring == [[1, 5, 9, 13], [3, 7, 11, 15]]
    for cp_rank, r in enumerate(g):  # cp_rank = ring_index * U + ulysses_index
        ui = next(u.index(r) for u in ulysses if r in u)
        ri = next(x.index(r) for x in ring if r in x)
        assert cp_rank == ri * 2 + ui


def test_chunk_refuses_whole_sequences_under_cp_and_positions_without_it():
    from engine.models import ModelConfig, build_stage_layers
    from engine.pipeline.stages import StageChunk, whole_sequences

    cfg = ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, seq_len=8)
    chunk = StageChunk(build_stage_layers(cfg), 0, 3, cp=_layout(2, 0))
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="context parallelism is on .* got no positions"):
        chunk(ids)
    with whole_sequences([chunk]):  # explicit: the sampler's whole prompts
        assert chunk(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 32)
    assert chunk.cp is not None
    plain = StageChunk(build_stage_layers(cfg), 0, 3)
    with pytest.raises(ValueError, match="context parallelism is off"):
        plain(ids, positions=torch.arange(4)[None])
