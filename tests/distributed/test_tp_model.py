"""The whole reference GPT at TP = 2 and 4 against TP = 1, on gloo, fp32.

Every rank builds the dense model (``tp_group=NO_TP``) and its TP shard of the same model
from the same seed, then runs three forward passes with two SGD steps in between and
compares, at every step: the (gathered) logits, the loss, and every (gathered) gradient.
It also checks that the sharded initialisation is exactly the slice of the dense one,
that TP-replicated parameters (norm weights) stay bit-identical across TP ranks, and
that a model built as two pipeline stages (tied head copy) equals the whole one.

Tolerance (fp32): ``rtol=1e-5`` plus ``atol = 1e-5 * max|expected|``. TP changes the
summation order of the row-parallel reductions and of the all-reduced input gradients (a
few ulp per op), and two optimizer steps amplify that: the measured max abs difference is
~1e-6 of the tensor's largest magnitude (e.g. 2.5e-6 on step-2 logits of magnitude 2), so
an elementwise-only tolerance would trip on near-zero entries. A missing or doubled
all-reduce gives errors of the order of the values themselves. SGD (not Adam) so that a gradient
differing by 1 ulp cannot flip the sign of an update on a near-zero element.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_ranks

from engine.distributed.groups import NO_TP, AxisGroup
from engine.models import GPT, ModelConfig, build_stage_layers
from engine.placement import has_placement, placement_of
from engine.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from engine.tensor_parallel.layers import gather_full_tensor
from engine.tensor_parallel.mappings import all_gather_along_dim

RTOL, ATOL_OF_MAX = 1e-5, 1e-5
SEED = 4321
B = 2


def _cfg(tie: bool) -> ModelConfig:
    # vocab 101 is divisible by neither 2 nor 4 (padded vocabulary); GQA: 8 heads, 4 kv heads
    return ModelConfig(vocab_size=101, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
                       seq_len=16, tie_embeddings=tie)


def _batch(cfg: ModelConfig, step: int):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, cfg.vocab_size, (B, cfg.seq_len), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (B, cfg.seq_len), generator=g)
    targets[0, -1] = -100                                      # one ignored token
    return ids, targets


class _Mismatches:
    def __init__(self):
        self.found: list[str] = []

    def close(self, actual, expected, what):
        try:
            scale = expected.abs().max().item() if expected.numel() else 0.0
            torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL_OF_MAX * scale)
        except AssertionError as e:
            self.found.append(f"{what}: {str(e).splitlines()[0]} {str(e).splitlines()[-1]}")

    def exact(self, actual, expected, what):
        if not torch.equal(actual, expected):
            self.found.append(f"{what}: not bit-identical")


def _gathered_logits(logits: torch.Tensor, group, vocab: int) -> torch.Tensor:
    return all_gather_along_dim(logits.detach(), -1, group)[..., :vocab]  # (B, S, V)


def _check_replicas_identical(tp_model, group, m: _Mismatches, when: str):
    world = group.size
    named = [(n, p) for n, p in tp_model.named_parameters() if not placement_of(p).tp_sharded]
    flat = torch.cat([t.reshape(-1) for _, p in named for t in (p.detach(), p.grad) if t is not None])
    copies = all_gather_along_dim(flat.unsqueeze(0), 0, group)          # (tp, n): one collective
    for r in range(1, world):
        m.exact(copies[r], copies[0], f"{when}: replicated parameters/grads on TP rank {r} vs rank 0 "
                                      f"({[n for n, _ in named]})")


def _compare_model(cfg: ModelConfig, group, sequence_parallel: bool) -> list[str]:
    m = _Mismatches()
    ref = GPT(cfg, NO_TP, seed=SEED)
    tp = GPT(cfg, group, sequence_parallel=sequence_parallel, seed=SEED)
    ref_params, tp_params = dict(ref.named_parameters()), dict(tp.named_parameters())
    assert ref_params.keys() == tp_params.keys(), (ref_params.keys(), tp_params.keys())
    for name, p in tp_params.items():
        assert has_placement(p), f"{name} has no placement"
        m.exact(gather_full_tensor(p.detach(), p, group), ref_params[name].detach(), f"init {name}")
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    opt_tp = torch.optim.SGD(tp.parameters(), lr=0.2, momentum=0.9)
    for step in range(3):                       # forward at steps 0, 1, 2; two optimizer steps
        ids, targets = _batch(cfg, step)
        logits_ref = ref(ids)
        loss_ref = F.cross_entropy(logits_ref.flatten(0, 1), targets.flatten(), ignore_index=-100)
        logits_tp = tp(ids)
        loss_tp = vocab_parallel_cross_entropy(logits_tp, targets, group)
        m.close(_gathered_logits(logits_tp, group, cfg.vocab_size), logits_ref.detach(), f"step {step} logits")
        m.close(loss_tp.detach(), loss_ref.detach(), f"step {step} loss")
        m.close(tp(ids, targets).detach(), loss_tp.detach(), f"step {step} GPT.forward(ids, targets)")
        loss_ref.backward()
        loss_tp.backward()
        for name, p in tp_params.items():
            m.close(gather_full_tensor(p.grad, p, group), ref_params[name].grad, f"step {step} grad {name}")
        _check_replicas_identical(tp, group, m, f"step {step}")
        if step < 2:
            opt_ref.step()
            opt_tp.step()
            opt_ref.zero_grad()
            opt_tp.zero_grad()
    return m.found


def _compare_pipeline_split(cfg: ModelConfig, group) -> list[str]:
    """Two stages built separately (the second holds a marked copy of the tied weight)
    compose to the whole TP model."""
    m = _Mismatches()
    whole = GPT(cfg, group, seed=SEED)
    first = build_stage_layers(cfg, group, seed=SEED, start=0, stop=2)
    second = build_stage_layers(cfg, group, seed=SEED, start=2)
    if cfg.tie_embeddings and not placement_of(second[-1].weight).tied_copy:
        m.found.append("the head built without the embedding is not marked as a tied copy")
    ids, _ = _batch(cfg, 0)
    h = ids
    for layer in first + second:
        h = layer(h)
    m.exact(h.detach(), whole(ids).detach(), "stage-split logits")
    return m.found


def _tp_groups(world_size: int) -> dict:
    """TP degree -> this rank's TP group: TP=2 on the pairs {0,1} and {2,3} (group-relative
    ranks differ from global ones), TP=4 on all four. Every rank creates every group."""
    mine = {}
    for tp in (2, 4):
        for start in range(0, world_size, tp):
            ranks = list(range(start, start + tp))
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine[tp] = AxisGroup.of(group, "tp")
    return mine


def _rank_main(rank, world_size):
    torch.use_deterministic_algorithms(True)
    results = {}
    for tp, group in _tp_groups(world_size).items():
        results[tp] = {
            "tied": _compare_model(_cfg(tie=True), group, sequence_parallel=False),
            "tied, sequence parallel": _compare_model(_cfg(tie=True), group, sequence_parallel=True),
            "untied, sequence parallel": _compare_model(_cfg(tie=False), group, sequence_parallel=True),
            "pipeline split, tied": _compare_pipeline_split(_cfg(tie=True), group),
        }
    return results


_RESULTS: list = []


@pytest.mark.parametrize("tp", [2, 4])
def test_model_matches_tp1(tp):
    if not _RESULTS:  # one 4-rank spawn serves both TP degrees (spawning dominates the runtime)
        _RESULTS.extend(run_ranks(_rank_main, 4, timeout=180))
    failed = {f"rank {r}, {case}": msgs for r, res in enumerate(_RESULTS)
              for case, msgs in res[tp].items() if msgs}
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items())
