"""Hugging Face Mixtral and Qwen2-MoE under expert parallelism (engine.moe.hf), against the
unsharded HF model, and through engine.initialize against one process.

Tiny random models: 2 layers, hidden 32, 4 query / 2 KV heads, vocab 64, 4 experts, top-2,
``output_router_logits`` on (the loss is HF's language-model loss plus
``router_aux_loss_coef`` times HF's load-balancing loss), ``initializer_range`` 0.1 so that the
routing margins are far above rounding. Qwen2-MoE has its shared expert (sigmoid-gated) and
``norm_topk_prob`` False (True in the Mixtral-like router is exercised by Mixtral).

1. **Logits and gradients at EP 2** (:func:`test_ep2_logits_and_grads_equal_unsharded_hf`,
   the adapter over a hand-made EP group): each of 2 ranks runs its own batch through the
   expert-parallel model; its logits, aux loss and loss equal the unsharded HF model's on the
   same batch, its dense gradients the HF gradients of its own batch, and its experts'
   gradients the HF gradients of the SUM of both ranks' losses (the all-to-all's backward
   returns every token's contribution to the rank holding its expert), sliced to its global
   experts. Tolerance 1e-6 (fp32): the model differs from HF only in the order of
   floating-point sums (each expert's matmul over a different set of rows: the BLAS may
   block differently; the routed rows' sum is added in HF's ascending-expert order).
   Measured: logits, aux loss, loss and dense gradients bitwise equal; expert gradients
   within 3e-8 (the two ranks' contributions summed in another order).
2. **Training through engine.initialize** (:func:`test_hf_moe_trains_equal_to_one_process`):
   3 AdamW steps with clipping at (world 2, EP 2, ZeRO 1) and (world 2, EP 1, ZeRO 3), and
   more layouts under ``ENGINE_EXTENDED_TESTS=1``, each rank given its own micro-batch; the
   reference is one process, the unsharded HF model and torch's AdamW, stepping on the mean
   of the per-micro-batch losses of the same micro-batches (HF's loss and aux loss are
   micro-batch means, so a data-parallel run is one process averaging the micro-batches'
   losses, not one process on their union), clipped by the same rule.
   Losses and the global gradient norm (before clipping: every parameter counted once)
   equal one process's within 1e-5 relative (measured: losses 1e-7, norms 7.5e-7 at EP 2
   ZeRO 1): only the order of the gradient sums differs. The final weights within 5e-5
   absolute (WEIGHT_ATOL; measured 1.3e-5 on 2 of 12288 elements of one expert weight, 0
   elsewhere above 1e-6): AdamW's update is about lr times the SIGN of a gradient's running
   mean, so an element whose gradient is near zero turns summation-order noise into a
   fraction of lr (3e-3); a wrong expert reduction (summed, or over the wrong ranks) moves
   whole expert weights by ~lr and the losses and norms at once.
3. **Refusals** (:func:`test_bad_inputs_refused_on_every_rank`): experts not divisible by
   EP, a model type without the adapter (Llama), an experts module of an unknown class: a
   ConfigError naming ``expert_parallel.size`` on every rank, before any collective.
"""

from __future__ import annotations

import pytest
from harness import run_ranks

pytest.importorskip("transformers")

B, S, V = 2, 16, 64
STEPS = 3
RTOL = 1e-5
ATOL_EXACT = 1e-6
WEIGHT_ATOL = 5e-5


def tiny_model(kind: str, seed: int = 0, experts: int = 4):
    import torch

    common = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=S, num_experts_per_tok=2, output_router_logits=True,
                  router_aux_loss_coef=0.05, initializer_range=0.1, attn_implementation="eager",
                  tie_word_embeddings=False)
    torch.manual_seed(seed)
    if kind == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM(MixtralConfig(intermediate_size=48, num_local_experts=experts, **common))
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=24,
                                              shared_expert_intermediate_size=48, num_experts=experts,
                                              norm_topk_prob=False, decoder_sparse_step=1, **common))


def batch(step: int, index: int):
    """Micro-batch ``index`` of step ``step``: (input_ids, labels) (B, S)."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + index)
    ids = torch.randint(0, V, (B, S), generator=g)
    return ids, ids.clone()


# ---------------------------------------------------------------- 1. the adapter at EP 2

def _hf_grads(model, ids, labels):
    model.zero_grad()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _logits_and_grads(rank, world, kind):
    import copy

    import torch.distributed as dist

    from engine.distributed.groups import AxisGroup
    from engine.moe.hf import ExpertParallelExperts, hf_moe_problem, prepare_hf_moe_model

    ref = tiny_model(kind)
    model = copy.deepcopy(ref)
    ep = AxisGroup("ep", tuple(range(world)), rank, dist.new_group(list(range(world))))
    assert hf_moe_problem(model, world) is None
    assert prepare_hf_moe_model(model, ep) == 2
    local = {n for n, m in model.named_modules() if isinstance(m, ExpertParallelExperts)}
    assert len(local) == 2
    # every rank's own batch, and the HF gradients of each
    ref_out, ref_grads = zip(*[_hf_grads(ref, *batch(0, r)) for r in range(world)])
    out, grads = _hf_grads(model, *batch(0, rank))
    errs = {"logits": (out.logits - ref_out[rank].logits).abs().max().item(),
            "aux": abs(out.aux_loss.item() - ref_out[rank].aux_loss.item()),
            "loss": abs(out.loss.item() - ref_out[rank].loss.item())}
    count = 4 // world
    lo = rank * count
    for n, g in grads.items():
        if n.rsplit(".", 1)[0] in local:   # an expert weight: every rank's tokens, this rank's experts
            want = sum(rg[n] for rg in ref_grads)[lo:lo + count]
        else:
            want = ref_grads[rank][n]
        assert g.shape == want.shape, n
        errs[n] = (g - want).abs().max().item()
    routed = [m.gate_up_proj.grad.abs().sum().item() for n, m in model.named_modules() if n in local]
    del model
    dist.destroy_process_group(ep.handle)   # the group this test made (its threads end with it)
    return errs, ref_out[rank].aux_loss.item(), min(routed)


def _both_logits_and_grads(rank, world):
    return [_logits_and_grads(rank, world, kind) for kind in ("mixtral", "qwen2_moe")]


@pytest.mark.timeout(300)
def test_ep2_logits_and_grads_equal_unsharded_hf():
    for per_kind in run_ranks(_both_logits_and_grads, 2, timeout=240):
        for errs, aux, routed in per_kind:
            bad = {k: v for k, v in errs.items() if not v <= ATOL_EXACT}
            assert not bad, bad
            assert aux > 0.5 and routed > 0   # the aux loss is on; this rank's experts got tokens


# ---------------------------------------------------- 2. training through engine.initialize

LR, WD = 3e-3, 0.1


def engine_config(world: int, ep: int, zero: int) -> dict:
    return {"train_batch_size": B * world, "train_micro_batch_size_per_gpu": B, "gradient_clipping": 0.5,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}},
            "zero_optimization": {"stage": zero, "reduce_bucket_size": 3000,
                                  "stage3_param_persistence_threshold": 100,
                                  "stage3_gather_16bit_weights_on_model_save": True},
            "expert_parallel": {"size": ep}}


def _full_weights(eng, model, world):
    """Every parameter, whole (experts gathered over EP by global index), on the host."""
    import torch
    import torch.distributed as dist

    from engine.placement import placement_of
    from engine.zero.init import GatheredParameters

    out = {}
    for n, p in model.named_parameters():
        with GatheredParameters([p]):
            t = p.detach().clone()
        shard = placement_of(p).expert
        if shard is not None:
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t)    # EP = the world here: rank r holds experts [r E/ep, ...)
            t = torch.cat(parts, 0)
        out[n] = t
    return out


def reference_run(kind: str, world: int):
    """One process, the unsharded HF model, torch's AdamW: each step the mean of the losses of
    micro-batches (step, 0 .. world-1), clipped as the engine (coef = min(1, clip / (norm + 1e-6)))."""
    import torch

    model = tiny_model(kind)
    clip = engine_config(1, 1, 0)["gradient_clipping"]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses, norms = [], []
    for step in range(STEPS):
        parts = [model(input_ids=ids, labels=labels).loss for ids, labels in (batch(step, r) for r in range(world))]
        torch.stack(parts).mean().backward()
        norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
        for p in model.parameters():
            p.grad.mul_(torch.clamp(clip / (norm + 1e-6), max=1.0))
        opt.step()
        opt.zero_grad()
        losses.append([x.item() for x in parts])
        norms.append(norm.item())
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(rank, world, kind, ep, zero):
    import engine

    model = tiny_model(kind)
    eng, *_ = engine.initialize(model=model, config=engine_config(world, ep, zero))
    losses, norms = [], []
    for step in range(STEPS):
        ids, labels = batch(step, rank)
        loss = eng(input_ids=ids, labels=labels).loss
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
        norms.append(eng.get_global_grad_norm())
    weights = _full_weights(eng, model, world)
    eng.destroy()
    return losses, norms, weights, reference_run(kind, world) if rank == 0 else None


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind,ep,zero", [
    ("mixtral", 2, 1),
    ("qwen2_moe", 1, 3),
    pytest.param("mixtral", 2, 3, marks=pytest.mark.extended),
    pytest.param("mixtral", 1, 2, marks=pytest.mark.extended),
    pytest.param("qwen2_moe", 2, 0, marks=pytest.mark.extended),
    pytest.param("qwen2_moe", 2, 2, marks=pytest.mark.extended),
], ids=lambda v: str(v))
def test_hf_moe_trains_equal_to_one_process(kind, ep, zero):
    import torch

    results = run_ranks(_train, 2, kind, ep, zero, timeout=300)
    ref_losses, ref_norms, ref_w = results[0][3]
    for rank, (losses, norms, weights, _) in enumerate(results):
        assert losses == pytest.approx([ref_losses[s][rank] for s in range(STEPS)], rel=RTOL)
        assert norms == pytest.approx(ref_norms, rel=RTOL)
        for n, w in ref_w.items():
            torch.testing.assert_close(weights[n], w, rtol=0, atol=WEIGHT_ATOL, msg=n)
    assert abs(ref_losses[0][0] - ref_losses[2][0]) > 1e-3 and ref_norms[0] > 0.5  # it trains; clipping is active


# ------------------------------------------------------- save_16bit_model / load_hf_weights

def _save_and_load(rank, world, out_dir, zero):
    import os

    import torch

    import engine
    from engine.checkpoint.hf import export_hf, load_hf_weights

    model = tiny_model("mixtral")
    eng, *_ = engine.initialize(model=model, config=engine_config(world, 2, zero))
    ids, labels = batch(0, rank)
    eng.backward(eng(input_ids=ids, labels=labels).loss)
    eng.step()
    trained = _full_weights(eng, model, world)
    assert eng.save_16bit_model(out_dir)
    saved = torch.load(os.path.join(out_dir, "pytorch_model.bin"))
    try:
        export_hf(eng, out_dir)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    eng.destroy()
    # a fresh model (other weights) at EP 2 reads the saved file: each rank its own experts
    fresh = tiny_model("mixtral", seed=5)
    eng2, *_ = engine.initialize(model=fresh, config=engine_config(world, 2, zero))
    report = load_hf_weights(eng2, saved)
    loaded = _full_weights(eng2, fresh, world)
    ids, labels = batch(1, rank)
    loss = eng2(input_ids=ids, labels=labels).loss.item()
    eng2.destroy()
    # one process reads the same file into the unsharded HF model
    hf = tiny_model("mixtral", seed=7)
    hf.load_state_dict(saved)
    hf_loss = hf(input_ids=ids, labels=labels).loss.item()
    return trained, saved, loaded, refused, report.max_read_bytes, loss, hf_loss


@pytest.mark.timeout(600)
@pytest.mark.parametrize("zero", [1, pytest.param(3, marks=pytest.mark.extended)])
def test_save_16bit_model_gathers_experts_and_load_reads_own(tmp_path, zero):
    import torch

    results = run_ranks(_save_and_load, 2, str(tmp_path), zero, timeout=300)
    expert_bytes = 4 * 2 * 2 * 48 * 32          # this rank's 2 of 4 experts of gate_up_proj (2F, H) in fp32
    for trained, saved, loaded, refused, max_read, loss, hf_loss in results:
        assert set(saved) == set(trained)
        for n, w in trained.items():             # HF layout: every expert at its global index
            assert torch.equal(saved[n], w), n
            assert torch.equal(loaded[n], w), n
        assert saved["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 96, 32)
        assert max_read <= max(expert_bytes, 4 * V * 32)   # never a whole expert tensor (4 x 96 x 32)
        assert refused is not None and ("save_16bit_model" if zero < 3 else "ZeRO stage 3") in refused
        assert loss == pytest.approx(hf_loss, rel=1e-6)


# --------------------------------------------------------------------------- 3. refusals

def _refusals(rank, world):
    import copy

    import torch.nn as nn

    import engine
    from engine.errors import ConfigError

    class OtherExperts(nn.Module):   # a user's experts module in a Mixtral block
        num_experts = 4

    odd = tiny_model("mixtral", experts=3)
    custom = tiny_model("mixtral")
    custom.model.layers[1].mlp.experts = OtherExperts()
    from transformers import LlamaConfig, LlamaForCausalLM
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    messages = []
    for model in (odd, custom, llama):
        before = copy.deepcopy(model.state_dict())
        try:
            engine.initialize(model=model, config=engine_config(world, 2, 1))
            messages.append(None)
        except ConfigError as exc:
            messages.append(str(exc))
        assert all((before[k] == v).all() for k, v in model.state_dict().items())   # left as it was
    return messages


@pytest.mark.timeout(300)
def test_bad_inputs_refused_on_every_rank():
    for odd, custom, llama in run_ranks(_refusals, 2, timeout=240):
        assert odd is not None and "expert_parallel.size = 2 does not divide" in odd and "= 3" in odd
        assert custom is not None and "OtherExperts" in custom and "unsupported MoE class" in custom
        assert llama is not None and "'llama'" in llama and "mixtral, qwen2_moe" in llama


def test_tp_or_pp_with_ep_refused():
    from engine.moe.hf import hf_moe_problem

    model = tiny_model("qwen2_moe")
    assert hf_moe_problem(model, 2) is None
    assert "tensor_parallel.autotp_size (2)" in hf_moe_problem(model, 2, tp=2)
    assert "pipeline.stages (2)" in hf_moe_problem(model, 2, pp=2)
