"""AutoTP checkpoints and Hugging Face weights, on gloo (4 ranks, one spawn for all phases):

1. train a Llama (GQA: 2 KV heads) at TP 2 x DP 2 (ZeRO-1) for 2 steps, save with
   ``engine.save_checkpoint`` and export with ``export_hf``;
2. load the checkpoint at TP 4 (KV projections now replicated) and at TP 1 x DP 4;
3. ``from_pretrained`` the export (rank 0);
4. build the model on the meta device at TP 2 x DP 2 and ``load_hf_weights`` the export.

Every phase's logits must equal phase 1's. Tolerance 1e-5 absolute on logits of ~1: the
weights are the same fp32 values, only the TP reduction order differs (measured ~1e-7);
a misplaced slice or a wrong fused/replicated layout is off by >1e-2.

The peak-memory test loads a larger Llama (8 layers, 15 MB of weights per layer, small
vocabulary) from safetensors at TP 2 with the model built on the meta device, and reads
the process's resident high-water mark (VmHWM, reset just before): the growth must stay
within this rank's shard plus the largest full weight plus 12 MiB of allocator/IO slack,
which is far below the full model.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

pytest.importorskip("transformers")

ATOL = 1e-5


def _cfg(tp, stage=1, micro=2, dp=None):
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "train_batch_size": micro * dp, "gradient_clipping": 1.0, "seed": 0,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "tensor_parallel": {"autotp_size": tp}}


def _logits(eng, ids):
    eng.module.eval()
    with torch.no_grad():
        out = eng(input_ids=ids).logits.float()
    eng.module.train()
    return out


def _ckpt_worker(rank, world, tmp):
    import transformers as tf
    from _autotp_models import batch, build

    import engine
    from engine.checkpoint.hf import export_hf, load_hf_weights

    tmp = os.path.join(tmp, "ckpt")
    hf_dir = os.path.join(tmp, "hf")
    probe = batch(7)
    errs = {}
    eng, *_ = engine.initialize(model=build("llama", seed=0), model_parameters=None, config=_cfg(2, dp=2))
    for s in range(2):
        ids = batch(s)[eng.groups.dp_rank:eng.groups.dp_rank + 1].repeat(2, 1)
        out = eng(input_ids=ids, labels=ids)
        eng.backward(out.loss)
        eng.step()
    want = _logits(eng, probe)
    eng.save_checkpoint(tmp, tag="t2")
    export_hf(eng, hf_dir)
    eng.destroy()

    for name, tp, stage in (("tp4", 4, 2), ("tp1", 1, 1)):
        e2, *_ = engine.initialize(model=build("llama", seed=1), config=_cfg(tp, stage, dp=world // tp))
        e2.load_checkpoint(tmp, tag="t2")
        errs[name] = (_logits(e2, probe) - want).abs().max().item()
        e2.destroy()

    if rank == 0:
        hf = tf.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
        with torch.no_grad():
            errs["from_pretrained"] = (hf(probe).logits - want).abs().max().item()
    dist.barrier()

    meta = build("llama", meta=True)
    e3, *_ = engine.initialize(model=meta, config=_cfg(2, dp=2))
    report = load_hf_weights(e3, hf_dir)
    errs["meta_load"] = (_logits(e3, probe) - want).abs().max().item()
    errs["meta_loaded"] = len(report.loaded)
    e3.destroy()
    return errs


def test_autotp_checkpoint_reshape_and_hf_export(tmp_path):
    results = run_ranks(_ckpt_worker, 4, str(tmp_path), timeout=300)
    for r in results:
        for k in ("tp4", "tp1", "meta_load"):
            assert r[k] <= ATOL, (k, r)
        assert r["meta_loaded"] > 10
    assert results[0]["from_pretrained"] <= ATOL, results[0]


# ---------------------------------------------------------------- peak memory of sharded loading
def _vm(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _mem_worker(rank, world, path):
    from _autotp_models import build

    from engine.distributed.groups import AxisGroup
    from engine.tensor_parallel.auto import autotp
    from engine.tensor_parallel.auto_rules import specs_for
    from engine.tensor_parallel.hf_load import full_shape_of, load_sharded_weights

    model = build("llama", meta=True, layers=8, hidden=512, heads=8, kv=4, inter=2048, vocab=512)
    autotp(model, AxisGroup.world(), specs_for("llama", None, (), True))
    shard = sum(p.numel() * 4 for p in model.parameters())
    largest = max(torch.Size(full_shape_of(p, world)).numel() * 4 for p in model.parameters())
    with open("/proc/self/clear_refs", "w") as f:   # reset VmHWM to the current RSS
        f.write("5")
    before = _vm("VmRSS")
    model.to_empty(device="cpu")
    report = load_sharded_weights(model, path, rank, world)
    peak = _vm("VmHWM") - before
    return peak, shard, largest, len(report.loaded)


def test_sharded_loading_peak_memory(tmp_path):
    from _autotp_models import build
    from safetensors.torch import save_file

    full = build("llama", layers=8, hidden=512, heads=8, kv=4, inter=2048, vocab=512)
    full_bytes = sum(p.numel() * 4 for p in full.parameters())
    path = str(tmp_path / "model.safetensors")
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, path)
    del full
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("cannot reset the resident high-water mark here (/proc/self/clear_refs)")
    for peak, shard, largest, n in run_ranks(_mem_worker, 2, path, timeout=240):
        assert n > 50
        bound = shard + largest + (12 << 20)
        assert peak <= bound, (peak, shard, largest)
        assert bound < full_bytes, (bound, full_bytes)   # the bound is meaningful
