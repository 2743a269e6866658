"""The reference GPT as a plain single-process nn.Module (tp_group=NO_TP): its maths
against an independent naive implementation, the stage-layer contract, seeding,
parameter/FLOP counts and input errors. No torch.distributed anywhere."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.distributed.groups import NO_TP
from engine.errors import ConfigError
from engine.models import GPT, ModelConfig, build_stage_layers, flops_per_token, num_stage_layers, param_count
from engine.placement import has_placement, placement_of
from engine.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=101, hidden_size=32, num_layers=2, num_heads=4, seq_len=16)
    base.update(kw)
    return ModelConfig(**base)


def _ids(cfg, seed=0, batch=2):
    return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- naive reference

def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope_complex(x, theta):
    """x (B, h, S, d): rotate pairs (i, i + d/2) as complex numbers by pos * theta^(-2i/d)."""
    d, s = x.shape[-1], x.shape[-2]
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double())
    ang = torch.arange(s).double()[:, None] * theta ** (-torch.arange(0, d, 2).double() / d)[None, :]
    z = z * torch.polar(torch.ones_like(ang), ang)
    return torch.cat([z.real, z.imag], -1).to(x.dtype)


def _naive_forward(model: GPT, ids):
    """The same maths written out independently: explicit masked softmax, complex RoPE,
    repeat_interleave for GQA, separate gate/up/q/k/v slices of the fused weights."""
    cfg = model.cfg
    h, d, nh, nkv, f = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.ffn_hidden_size
    emb, *blocks, head = model.layers
    x = emb.weight[ids]                                               # (B, S, H)
    b, s = ids.shape
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
    for blk in blocks:
        y = _rms(x, blk.attn_norm.weight, cfg.norm_eps)
        wq, wk, wv = blk.attn.qkv.weight.split([nh * d, nkv * d, nkv * d])
        q = (y @ wq.T).view(b, s, nh, d).transpose(1, 2)
        k = (y @ wk.T).view(b, s, nkv, d).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
        v = (y @ wv.T).view(b, s, nkv, d).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
        q, k = _rope_complex(q, cfg.rope_theta), _rope_complex(k, cfg.rope_theta)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        o = (att @ v).transpose(1, 2).reshape(b, s, h)
        x = x + o @ blk.attn.proj.weight.T
        y = _rms(x, blk.mlp_norm.weight, cfg.norm_eps)
        wg, wu = blk.mlp.gate_up.weight.split([f, f])
        x = x + (F.silu(y @ wg.T) * (y @ wu.T)) @ blk.mlp.down.weight.T
    return _rms(x, head.norm.weight, cfg.norm_eps) @ head.weight.T    # (B, S, V)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_matches_naive_reference(kv_heads):
    cfg = _cfg(num_kv_heads=kv_heads, init_std=0.2)  # larger init so attention is far from uniform
    model = GPT(cfg, seed=3)
    ids = _ids(cfg)
    with torch.no_grad():
        # 1e-5: fp32, different op order (complex RoPE in double, explicit softmax)
        torch.testing.assert_close(model(ids), _naive_forward(model, ids), rtol=1e-5, atol=1e-5)


def test_plain_module_without_torch_distributed():
    assert not dist.is_initialized()
    cfg = _cfg()
    model = GPT(cfg)
    ids, targets = _ids(cfg, 0), _ids(cfg, 1)
    targets[0, :3] = -100
    logits = model(ids)
    assert logits.shape == (2, cfg.seq_len, cfg.vocab_size)
    loss = model(ids, targets)
    ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_cross_entropy_tp1_matches_torch():
    logits = torch.randn(3, 5, 17, requires_grad=True)
    ref_logits = logits.detach().clone().requires_grad_(True)
    targets = torch.randint(0, 17, (3, 5))
    targets[1, 2] = -100
    for reduction in ("mean", "sum", "none"):
        ours = vocab_parallel_cross_entropy(logits, targets, NO_TP, reduction=reduction)
        ref = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten(), reduction=reduction)
        torch.testing.assert_close(ours.flatten(), ref.flatten(), rtol=1e-6, atol=1e-6)
        ours.sum().backward()
        ref.sum().backward()
        torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-6, atol=1e-7)
        logits.grad = ref_logits.grad = None
    half = logits.detach().bfloat16().requires_grad_(True)
    vocab_parallel_cross_entropy(half, targets, NO_TP).backward()
    assert half.grad.dtype == torch.bfloat16


def test_causal():
    cfg = _cfg()
    model = GPT(cfg)
    ids = _ids(cfg)
    changed = ids.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


# ---------------------------------------------------------------- stage layers and seeding

def test_gpt_is_the_stage_layer_list_and_slices_compose():
    cfg = _cfg()
    model = GPT(cfg, seed=7)
    assert len(model.layers) == num_stage_layers(cfg) == cfg.num_layers + 2
    assert model.layers[-1].weight is model.layers[0].weight        # tied, same process
    first = build_stage_layers(cfg, seed=7, start=0, stop=2)
    second = build_stage_layers(cfg, seed=7, start=2)
    head = second[-1]
    assert placement_of(head.weight).tied_copy and not placement_of(first[0].weight).tied_copy
    assert torch.equal(head.weight, first[0].weight)                 # the copy starts identical
    ids = _ids(cfg)
    h = ids
    for layer in first + second:
        h = layer(h)
    with torch.no_grad():
        assert torch.equal(h, model(ids))
    assert first[0](ids).shape == (2, cfg.seq_len, cfg.hidden_size)  # embedding: (B, S) -> (B, S, H)


def test_untied_head_is_its_own_weight():
    cfg = _cfg(tie_embeddings=False)
    layers = build_stage_layers(cfg)
    assert layers[-1].weight is not layers[0].weight
    assert not placement_of(layers[-1].weight).tied_copy
    assert not torch.equal(layers[-1].weight, layers[0].weight)


def test_seed_per_layer_not_per_construction_order():
    cfg = _cfg(num_layers=3)
    whole = build_stage_layers(cfg, seed=5)
    late_first = build_stage_layers(cfg, seed=5, start=3, stop=4)    # block 2 built alone, first
    early = build_stage_layers(cfg, seed=5, start=1, stop=2)         # block 0
    for a, b in ((whole[3], late_first[0]), (whole[1], early[0])):
        for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
            assert na == nb and torch.equal(pa, pb), na
    other = build_stage_layers(cfg, seed=6, start=1, stop=2)
    assert not torch.equal(other[0].attn.qkv.weight, early[0].attn.qkv.weight)
    assert not torch.equal(whole[1].attn.qkv.weight, whole[2].attn.qkv.weight)  # blocks differ


def test_parameters_tagged_and_buffers_not_parameters():
    model = GPT(_cfg(num_kv_heads=2))
    for name, p in model.named_parameters():
        assert has_placement(p), name
        if name.endswith("norm.weight"):
            assert not placement_of(p).tp_sharded, name
        else:
            assert placement_of(p).tp_sharded and placement_of(p).tp.dim in (0, 1), name
    names = set(model.state_dict())
    assert not any(n.endswith(("cos", "sin", "inv_freq")) for n in names), names
    assert any(n.endswith("cos") for n, _ in model.named_buffers())


def test_longer_sequence_rebuilds_rotary_tables():
    cfg = _cfg()
    model = GPT(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 2 * cfg.seq_len))
    with torch.no_grad():
        long = model(ids)
        short = model(ids[:, : cfg.seq_len])
    torch.testing.assert_close(long[:, : cfg.seq_len], short, rtol=0, atol=1e-6)


def test_bf16_model_runs():
    cfg = _cfg()
    model = GPT(cfg, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    loss = model(_ids(cfg), _ids(cfg, 1))
    loss.backward()
    assert torch.isfinite(loss) and abs(loss.item() - math.log(cfg.vocab_size)) < 0.5


# ---------------------------------------------------------------- counts

@pytest.mark.parametrize("kw", [dict(), dict(tie_embeddings=False), dict(num_kv_heads=2, ffn_hidden_size=48)])
def test_param_count_is_exact(kw):
    cfg = _cfg(**kw)
    model = GPT(cfg)
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())  # shared weight once


def test_flops_per_token():
    # GPT-2 small shapes, untied, worked by hand: per block 4*768^2 (q, k, v, proj)
    # + 3*768*3072 (gate, up, down) = 9,437,184; x12 blocks + LM head 50257*768 = 151,843,584
    # matmul weights; 6 * that + 12 * 12 layers * 768 * 1024 (attention) = 1,024,307,712.
    cfg = ModelConfig(vocab_size=50257, hidden_size=768, num_layers=12, num_heads=12, seq_len=1024,
                      ffn_hidden_size=3072, tie_embeddings=False)
    assert flops_per_token(cfg) == 1_024_307_712
    # tying does not change the FLOPs (the head matmul still runs); GQA shrinks k/v
    assert flops_per_token(ModelConfig(**{**cfg.to_dict(), "tie_embeddings": True})) == 1_024_307_712
    gqa = ModelConfig(**{**cfg.to_dict(), "num_kv_heads": 4})
    assert flops_per_token(cfg) - flops_per_token(gqa) == 6 * 12 * 2 * 768 * (768 - 4 * 64)
    assert flops_per_token(cfg, seq_len=2048) - flops_per_token(cfg) == 12 * 12 * 768 * 1024
    # and against the model: 2-D block weights + the head, counted from the parameters
    small = _cfg(num_kv_heads=2)
    blocks = sum(p.numel() for layer in GPT(small).layers[1:-1] for p in layer.parameters() if p.dim() == 2)
    n_matmul = blocks + small.vocab_size * small.hidden_size
    assert flops_per_token(small) == 6 * n_matmul + 12 * small.num_layers * small.hidden_size * small.seq_len


# ---------------------------------------------------------------- errors

def test_bad_inputs_are_named():
    cfg = _cfg()
    model = GPT(cfg)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 101\)"):
        model(torch.full((1, 4), cfg.vocab_size))
    with pytest.raises(ValueError, match="batch, seq"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(TypeError, match="integer token ids"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="targets"):
        model(_ids(cfg), _ids(cfg)[:, :-1])
    with pytest.raises(ValueError, match="stage layer range"):
        build_stage_layers(cfg, start=2, stop=2)
    with pytest.raises(ValueError, match="stage layer range"):
        build_stage_layers(cfg, start=0, stop=num_stage_layers(cfg) + 1)
    with pytest.raises(ConfigError, match="tie_embeddings"):
        from engine.models.gpt import FinalNormAndHead
        FinalNormAndHead(_cfg(tie_embeddings=False), tied_weight=GPT(cfg).layers[0].weight)
