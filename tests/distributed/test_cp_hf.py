"""Context parallelism for a Hugging Face model through the DeepSpeed-style loop
(``engine.compat.deepspeed``), against one process.

A tiny random ``LlamaForCausalLM`` (2 layers, hidden 32, 4 query heads, 2 KV heads, vocab
128) trains STEPS steps of a client SGD (``optimizer=`` a callable, as DeepSpeed scripts pass
one; plain SGD so that the weights differ from one process's by lr times the gradient error,
where Adam's first steps, about lr times the sign of each gradient, would amplify summation
noise in near-zero gradients) on the same whole batches (B = 2, S = 32, some labels -100 so
that the shards' target counts differ) with ``sequence_parallel_size`` 2 and 4 (Ulysses;
at 4 the 2 KV heads are replicated) and with the ring (``context_parallel`` mode "ring"):
``loss = engine(input_ids=..., labels=...).loss; engine.backward(loss); engine.step()``,
every CP rank given the same whole batch (the engine cuts it). The losses, the gradient
norms (before clipping) and the final weights equal one process's (the model's own loss, no
CP) within RTOL = 1e-5 relative (weights: 1e-6 absolute; measured at CP 2: losses 1e-7, weights 1e-8): CP changes only the order of floating-point
sums (the attention's softmax over shards, the loss's sum over ranks, the gradient
average). A loss normalised per shard, labels shifted after sharding, rotary at local
positions or a shard attending only to itself each move the first loss by > 1e-3; the
check that CP is on: each rank's logits cover S / C tokens.
"""

from __future__ import annotations

import pytest
from harness import run_ranks

pytest.importorskip("transformers")

STEPS = 3
RTOL = 1e-5
B, S, V = 2, 32, 128


def _model(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=S, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def _batches():
    import torch

    g = torch.Generator().manual_seed(3)
    out = []
    for step in range(STEPS):
        ids = torch.randint(0, V, (B, S), generator=g)
        labels = ids.clone()
        labels[0, : 5 + step] = -100        # ignored targets: shards count different numbers
        labels[1, -3:] = -100
        out.append((ids, labels))
    return out


def _sgd(params):
    import torch

    return torch.optim.SGD(params, lr=0.5)


def _train(rank, world, cp_section):
    import engine.compat.deepspeed as deepspeed

    model = _model()
    config = {"train_batch_size": B, "train_micro_batch_size_per_gpu": B, "gradient_clipping": 1.0}
    config.update(cp_section)
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=_sgd, config=config)
    losses, norms, seen = [], [], set()
    for ids, labels in _batches():
        out = eng(input_ids=ids, labels=labels)
        seen.add(out.logits.shape[1])
        assert out[0] is out.loss and out["loss"] is out.loss        # the loss first, as HF gives it with labels
        eng.backward(out.loss)
        eng.step()
        losses.append(float(out.loss.detach()))
        norms.append(eng.get_global_grad_norm())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    eng.destroy()
    return losses, norms, seen, weights if rank == 0 else None


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_train, 1, {}, timeout=300)[0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,section", [
    (2, {"sequence_parallel_size": 2}),
    (4, {"sequence_parallel_size": 4}),
    pytest.param(4, {"context_parallel": {"size": 4, "mode": "ring"}}, marks=pytest.mark.extended),
], ids=["ulysses2", "ulysses4", "ring4"])
def test_hf_llama_under_context_parallel_equals_one_process(reference, world, section):
    import torch

    ref_losses, ref_norms, ref_seen, ref_w = reference
    assert ref_seen == {S}
    results = run_ranks(_train, world, section, timeout=500)
    for losses, norms, seen, _ in results:
        assert seen == {S // world}                 # CP is on: each rank ran S / C tokens
        assert losses == pytest.approx(ref_losses, rel=RTOL)
        assert norms == pytest.approx(ref_norms, rel=RTOL)
    assert abs(ref_losses[0] - ref_losses[1]) > 1e-3    # the steps train (a wrong loss would show)
    weights = results[0][3]
    for k, w in ref_w.items():
        torch.testing.assert_close(weights[k], w, rtol=0, atol=1e-6, msg=k)


def _refusals(rank, world):
    """Rank 0 is given a padding mask (refused), rank 1 a valid batch; then both are given
    different batches. Each rank reports the message it raised: none may wait in the
    fingerprint's collective for a peer that raised before it."""
    import torch

    import engine.compat.deepspeed as deepspeed

    model = _model()
    config = {"train_batch_size": B, "train_micro_batch_size_per_gpu": B, "sequence_parallel_size": 2}
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=_sgd, config=config)
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(5))
    got = []
    mask = torch.ones(B, S, dtype=torch.long)
    if rank == 0:
        mask[0, -4:] = 0
    for kwargs in ({"attention_mask": mask}, {"input_ids": ids + rank}):
        try:
            eng(**{"input_ids": ids, "labels": ids, **kwargs})
            got.append("accepted")
        except ValueError as e:
            got.append(str(e))
    eng.destroy()
    return got


def test_a_refused_batch_on_one_cp_rank_is_raised_on_every_rank():
    (mask0, diff0), (mask1, diff1) = run_ranks(_refusals, 2, timeout=300)
    assert "padding masks are not supported" in mask0
    assert "another context-parallel rank of this replica refused its batch" in mask1
    assert "same whole batch" in diff0 and "same whole batch" in diff1
