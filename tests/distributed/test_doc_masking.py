"""Document masking through the engine's pipeline: packed micro-batches (``engine.data.Batch``
with document ids) trained with ``data.document_masking`` at PP = 3 with 1F1B and with
interleaved 1F1B (two chunks per rank, so each rank uses a micro-batch's document ids
twice), against the dense single-process GPT. Three stages cover what PP = 2 does (the
first stage feeds the ids, the last computes the loss) plus a middle stage that does
neither and takes the document ids from its own copy of the micro-batches. (TP = 2 with
sequence parallelism and document ids is checked in test_fp8_model.py's TP run.)

1. Per-document logits: the last stage's logits of the first step (initial weights) equal,
   for every document of every packed row, the dense model's logits for that document run
   alone (no mask). atol 2e-5 on logits of O(1): only fp32 summation order differs
   (measured 6e-8); without the mask they are off by 8e-2.
2. Training: 3 AdamW steps give the dense model's losses (trained with ``doc_ids``): the
   first (same weights) within rtol 2e-6 (measured equal), all within rtol 2e-5
   (reduction-order noise amplified by Adam, as in test_engine_api.py; measured 2.2e-6).
   Dropping the mask changes the first loss by 1.1e-4 relative (the initial model is near
   uniform, so the logits check is the sharp one); a stage without its document ids is
   an error (``StageChunk`` checks config against data).
"""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks

TINY = {"vocab_size": 64, "hidden_size": 16, "num_layers": 6, "num_heads": 2, "seq_len": 16}
STEPS, MICRO, GA, LR = 3, 2, 3, 1e-2  # interleaved 1F1B over 3 stages x 2 chunks: 6 | layers, 3 | GA
ATOL_LOGITS, RTOL_LOSS = 2e-5, 2e-5


def _microbatches(step):
    """GA packed micro-batches of MICRO rows: random documents of 1..10 tokens back to back."""
    from engine.data import Batch

    g = torch.Generator().manual_seed(900 + step)
    s = TINY["seq_len"] + 1
    rows, docs = [], []
    for _ in range(GA * MICRO):
        ids = torch.zeros(s, dtype=torch.long)
        i, d = 0, 0
        while i < s:
            n = int(torch.randint(1, 11, (1,), generator=g))
            ids[i:i + n] = d
            i, d = i + n, d + 1
        rows.append(torch.randint(0, TINY["vocab_size"], (s,), generator=g))
        docs.append(ids)
    tokens, doc_ids = torch.stack(rows), torch.stack(docs)
    return [Batch(tokens[k * MICRO:(k + 1) * MICRO], doc_ids[k * MICRO:(k + 1) * MICRO]) for k in range(GA)]


def _dense(seed):
    """The dense model's initial per-document logits check and its trained losses."""
    from engine.models import GPT, ModelConfig

    ref = GPT(ModelConfig(**TINY), seed=seed)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    losses = []
    for s in range(STEPS):
        loss = torch.stack([ref(mb.inputs, mb.targets, doc_ids=mb.input_doc_ids) for mb in _microbatches(s)]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return GPT(ModelConfig(**TINY), seed=seed), losses


def _max_doc_error(dense, mb, logits):
    """Max |packed logits - logits of each document alone| over the rows of one micro-batch."""
    err = 0.0
    with torch.no_grad():
        for r in range(len(mb)):
            ids, docs = mb.inputs[r], mb.input_doc_ids[r]
            for d in docs.unique():
                sel = (docs == d).nonzero().flatten()
                alone = dense(ids[sel][None])[0]                          # (n, V)
                err = max(err, (logits[r, sel] - alone).abs().max().item())
    return err


def _layouts(rank, world, layouts):
    import engine
    from engine.distributed.groups import NO_TP
    from engine.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    seed = 3
    dense, ref_losses = _dense(seed)
    out = []
    for extra in layouts:
        cfg = {"train_batch_size": GA * MICRO * (world // (extra.get("tp", 1) * extra.get("pp", 1))),
               "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "seed": seed,
               "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
               "tensor_parallel": {"autotp_size": extra.get("tp", 1), "sequence_parallel": extra.get("sp", False)},
               "pipeline": {"stages": extra.get("pp", 1), "partition": "uniform",
                            "schedule": extra.get("schedule", "1f1b"), "virtual_stages": extra.get("v", 1)},
               "model": TINY, "data": {"document_masking": True}}
        captured = []
        def capture(logits, targets, captured=captured):  # the last stage's full logits (TP = 1)
            captured.append(logits.detach().clone())
            return vocab_parallel_cross_entropy(logits, targets, NO_TP)

        eng, *_ = engine.initialize(config=cfg, loss_fn=capture if extra.get("tp", 1) == 1 else None)
        losses = [eng.train_batch(iter(_microbatches(s))).item() for s in range(STEPS)]
        doc_err = None
        if captured:
            doc_err = max(_max_doc_error(dense, mb, lg) for mb, lg in zip(_microbatches(0), captured[:GA]))
        out.append((extra, losses, doc_err))
        eng.destroy()
    return ref_losses, out


def _check(results):
    for ref_losses, per_layout in results:
        for extra, losses, doc_err in per_layout:
            assert losses[0] == pytest.approx(ref_losses[0], rel=2e-6), extra
            assert losses == pytest.approx(ref_losses, rel=RTOL_LOSS), extra
            if doc_err is not None:
                assert doc_err < ATOL_LOGITS, (extra, doc_err)
    assert any(doc_err is not None for _, per in results for _, _, doc_err in per)  # some rank checked logits


def test_packed_documents_through_the_pipeline():
    """PP = 3, 1F1B and interleaved 1F1B: per-document logits and training losses."""
    results = run_ranks(_layouts, 3, [{"pp": 3}, {"pp": 3, "schedule": "interleaved-1f1b", "v": 2}], timeout=180)
    _check(results)
    assert [doc_err is not None for _, per in results for _, _, doc_err in per] == [False] * 4 + [True] * 2
