"""DeepSpeed's bf16 master state (``bf16.bf16_master_weights_and_grads`` +
``bf16_optimizer_states``) on the tiny reference GPT, ZeRO-3, 2 gloo ranks:

1. Memory: the optimizer's flat master shards, their gradient shards and the Adam moments
   are bf16 tensors, counted in bytes: the optimizer state is exactly half the fp32-master
   run's (2 + 2 + 2 bytes per element against 4 + 4 + 4, plus one fp32 step counter per
   group); the engine answers DeepSpeed's queries.
2. Checkpoints: save after 2 steps, load into a fresh engine, 2 more steps: losses and
   master shards equal the uninterrupted run's bit for bit (the bf16 masters and moments are
   saved as they are, not rounded through another dtype).
3. ZeRO-Offload (DeepSpeed's other valid mode): at ZeRO-1, offloaded bf16 masters with bf16
   moments train bit for bit as on the device (the same update, on the host); at ZeRO-2 with
   ``bf16_optimizer_states`` false the host masters are bf16 and the moments fp32 (DeepSpeed's
   DeepSpeedCPUAdam with fp32_optimizer_states=True), and a checkpoint of it resumes with the
   fp32 moments as saved.
4. zero_to_fp32 on the checkpoint of 2.: ``convert_zero_checkpoint_to_fp32_state_dict`` writes
   fp32 weights, the bf16 masters upcast exactly (DeepSpeed's converter's default dtype,
   float32); ``get_fp32_state_dict_from_zero_checkpoint`` gives them in bf16, as they are
   saved. Both as DeepSpeed 0.19.8 does (run on 2 CPU ranks with bf16_full.json less
   torch_autocast: its get_fp32_state_dict gives bfloat16 tensors, its converter float32 ones
   equal to them upcast).
"""

from __future__ import annotations

import os

import _ckpt_common as C
import pytest
from harness import run_ranks

BF16 = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}  # FusedAdamW: DeepSpeed's CPU Adam arithmetic


def _cfg(bf16: dict) -> dict:
    return C.config(dp=2, zero=3, layers=2, bf16=bf16, optimizer=ADAMW)


def _run(rank, world, root):
    import torch

    from engine.checkpoint import load_checkpoint, save_checkpoint
    from engine.compat.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
    )

    eng = C.build(_cfg(BF16))
    zero = eng.optimizer
    out = {"queries": (eng.bfloat16_enabled(), eng.bf16_master_weights_and_gradients(), eng.bf16_optimizer_states())}
    full = C.train(eng, 2)
    save_checkpoint(eng, root)
    masters_at_save = [g.master.detach().clone() for g in zero.groups]
    full += C.train(eng, 2)
    dtypes = {str(t.dtype) for g in zero.groups for t in (g.master, g.master.grad)}
    dtypes |= {str(v.dtype) for st in zero.optimizer.state.values() for k, v in st.items() if k != "step"}
    numel = sum(g.master.numel() for g in zero.groups)
    out.update(full=full, dtypes=dtypes, numel=numel, groups=len(zero.groups), bytes=zero.memory_bytes())
    ref = C.build(_cfg({"enabled": True}))
    C.train(ref, 1)
    out["fp32_bytes"] = ref.optimizer.memory_bytes()
    resumed = C.build(_cfg(BF16))
    load_checkpoint(resumed, root)
    out["loaded_equal"] = all(torch.equal(g.master, m) for g, m in zip(resumed.optimizer.groups, masters_at_save))
    out["resumed"] = C.train(resumed, 2)
    out["end_equal"] = all(torch.equal(a.master, b.master) for a, b in zip(resumed.optimizer.groups, zero.groups))
    if rank == 0:
        sd = get_fp32_state_dict_from_zero_checkpoint(root)
        convert_zero_checkpoint_to_fp32_state_dict(root, os.path.join(root, "fp32"))
        written = torch.load(os.path.join(root, "fp32", "pytorch_model.bin"), map_location="cpu")
        out["sd_dtypes"] = {str(v.dtype) for v in sd.values()}
        out["file_dtypes"] = {str(v.dtype) for v in written.values()}
        out["upcast_exact"] = all(torch.equal(v, v.bfloat16().float()) for v in written.values())
        out["same_values"] = all(torch.equal(written[k], sd[k].float()) for k in sd)
    return out


def test_bf16_master_state_bytes_checkpoint_and_zero_to_fp32(tmp_path):
    r0, r1 = run_ranks(_run, 2, str(tmp_path), timeout=240)
    assert r0["queries"] == (True, True, True)
    assert r0["dtypes"] == {"torch.bfloat16"}, r0["dtypes"]
    n, groups = r0["numel"], r0["groups"]
    # master + exp_avg + exp_avg_sq in bf16, one fp32 step counter per group
    assert r0["bytes"]["optimizer_state"] == 3 * 2 * n + 4 * groups, (r0["bytes"], n)
    assert r0["fp32_bytes"]["optimizer_state"] == 3 * 4 * n + 4 * groups, (r0["fp32_bytes"], n)
    for r in (r0, r1):
        assert r["loaded_equal"] and r["end_equal"]
        assert r["resumed"] == r["full"][2:]  # bit for bit
    assert r0["full"] == r1["full"]
    assert r0["sd_dtypes"] == {"torch.bfloat16"} and r0["file_dtypes"] == {"torch.float32"}
    assert r0["upcast_exact"] and r0["same_values"]


def _offload(rank, world, root):
    import torch

    from engine.checkpoint import load_checkpoint, save_checkpoint

    def cfg(stage, offload, states):
        bf16 = dict(BF16, bf16_optimizer_states=states)
        zero = {"stage": stage, "reduce_bucket_size": 3000}
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        return C.config(dp=2, zero=stage, layers=2, bf16=bf16, optimizer=ADAMW, zero_optimization=zero)

    on_device = C.train(C.build(cfg(1, False, True)), 3)
    host = C.build(cfg(1, True, True))
    offloaded = C.train(host, 3)
    fp32_moments = C.build(cfg(2, True, False))
    losses = C.train(fp32_moments, 2)
    z = fp32_moments.optimizer
    save_checkpoint(fp32_moments, root)
    resumed = C.build(cfg(2, True, False))
    load_checkpoint(resumed, root)

    def moments(opt):
        return [v for st in opt.optimizer.state.values() for k, v in sorted(st.items()) if k != "step"]

    # the fp32 moments come back fp32 and bit for bit (not rounded through the bf16 masters' dtype)
    resumed_equal = all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(moments(resumed.optimizer),
                                                                                      moments(z)))
    return dict(on_device=on_device, offloaded=offloaded, losses=losses, resumed_equal=resumed_equal,
                host_dtypes={str(t.dtype) for g in host.optimizer.groups for t in (g.master, g.master.grad)},
                masters={str(g.master.dtype) for g in z.groups},
                moments={str(v.dtype) for st in z.optimizer.state.values() for k, v in st.items() if k != "step"},
                finite=all(torch.isfinite(torch.tensor(losses))))


@pytest.mark.slow
@pytest.mark.extended
def test_bf16_master_state_with_zero_offload(tmp_path):
    for r in run_ranks(_offload, 2, str(tmp_path), timeout=240):
        assert r["offloaded"] == r["on_device"]  # bit for bit
        assert r["host_dtypes"] == {"torch.bfloat16"}
        assert r["masters"] == {"torch.bfloat16"} and r["moments"] == {"torch.float32"}
        assert r["finite"] and r["losses"][1] < r["losses"][0] + 0.5
        assert r["resumed_equal"]
