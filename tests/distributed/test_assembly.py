"""Explicit assembly: every builder (reference GPT, a given GPT, a layer list, a
PipelineModule, a plain module, AutoTP) hands the engine a ModelParts, and the engine carries
no attribute its class does not declare (nothing is monkey-patched onto it), before and
after a step. The micro-batch conversion at the data boundary: the same data given as an
engine.data.Batch, an (inputs, targets) pair and an {input_ids, labels} dict gives the same
loss bit for bit, with and without a pipeline.

Two ranks (gloo): tp 2 for the reference GPT and AutoTP, pp 2 for the stage builders, dp 2
for the plain module; one spawn for all six.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from harness import run_ranks

MODEL = {"vocab_size": 64, "hidden_size": 16, "num_layers": 2, "num_heads": 2, "seq_len": 8}


def _cfg(**extra):
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "seed": 3,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    cfg.update(extra)
    return cfg


def undeclared(eng) -> set[str]:
    """Instance attributes neither the Engine class nor nn.Module declares."""
    from engine.engine import Engine

    declared = set()
    for klass in type(eng).__mro__:
        if klass is Engine or (isinstance(klass, type) and issubclass(klass, Engine)):
            declared |= set(getattr(klass, "__annotations__", {}))
    return set(vars(eng)) - declared - set(vars(nn.Module()))


def _tokens(step, rows=2):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randint(0, MODEL["vocab_size"], (rows, MODEL["seq_len"] + 1), generator=g)


def _formats(eng, step, with_dict=True):
    """eval_batch losses of one micro-batch as a Batch, a pair and (with a pipeline or a
    loss_fn, which take the pair out of it) an {input_ids, labels} dict."""
    from engine.data import Batch

    b = Batch(_tokens(step))
    forms = [b, (b.inputs, b.targets)] + ([{"input_ids": b.inputs, "labels": b.targets}] if with_dict else [])
    return [eng.eval_batch(iter([f]), num_micro_batches=1).item() for f in forms]


def _check(name, eng, out, kind):
    from engine.parts import ModelParts

    assert isinstance(eng.parts, ModelParts) and eng.module is eng.parts.module
    out[name] = {"kind": kind(eng.parts), "undeclared_at_build": sorted(undeclared(eng))}


def _builders(rank, world):
    import _autotp_models as hf

    import engine
    from engine.data import Batch
    from engine.models import GPT, ModelConfig
    from engine.pipe import PipelineModule

    out = {}
    # 1. the reference GPT (model=None), tp 2
    eng, *_ = engine.initialize(config=_cfg(model=MODEL, tensor_parallel={"autotp_size": 2}))
    _check("reference", eng, out, lambda p: (p.reference, len(p.chunks), type(p.module).__name__))
    out["reference"]["formats"] = _formats(eng, 0, with_dict=False)  # ReferenceModel(ids, targets)
    eng.train_batch(iter([Batch(_tokens(1)), Batch(_tokens(2))]))
    out["reference"]["undeclared_after_step"] = sorted(undeclared(eng))
    eng.reference_extra = 1  # what the assembly used to do: the check must see it
    out["reference"]["caught"] = sorted(undeclared(eng))
    eng.destroy()
    # 2. a given GPT over pp 2 (tied embedding across the stages)
    gpt = GPT(ModelConfig(**MODEL), seed=3)
    eng, *_ = engine.initialize(model=gpt, config=_cfg(model=MODEL, pipeline={"stages": 2}))
    _check("given_gpt", eng, out, lambda p: (p.reference, len(p.chunks), len(p.tied)))
    out["given_gpt"]["formats"] = _formats(eng, 0)
    eng.train_batch(iter([Batch(_tokens(1)), Batch(_tokens(2))]))
    out["given_gpt"]["undeclared_after_step"] = sorted(undeclared(eng))
    eng.destroy()
    # 3. a layer list over pp 2
    layers = list(GPT(ModelConfig(**MODEL), seed=3).layers)
    eng, *_ = engine.initialize(model=layers, config=_cfg(model=MODEL, pipeline={"stages": 2}))
    _check("layers", eng, out, lambda p: (p.reference, len(p.chunks), len(p.tied)))
    eng.train_batch(iter([Batch(_tokens(1)), Batch(_tokens(2))]))
    out["layers"]["undeclared_after_step"] = sorted(undeclared(eng))
    eng.destroy()
    # 4. DeepSpeed's PipelineModule over pp 2 (boundary shape measured on the first micro-batch)
    torch.manual_seed(0)
    net = PipelineModule([nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3)], num_stages=2,
                         loss_fn=nn.functional.mse_loss)
    eng, *_ = engine.initialize(model=net, config=_cfg())
    _check("pipeline_module", eng, out, lambda p: (p.measure_boundary, len(p.chunks)))
    g = torch.Generator().manual_seed(1)
    eng.train_batch(iter([(torch.randn(2, 6, generator=g), torch.randn(2, 3, generator=g)) for _ in range(2)]))
    out["pipeline_module"]["undeclared_after_step"] = sorted(undeclared(eng))
    eng.destroy()
    # 5. a plain module for the DeepSpeed loop, dp 2
    torch.manual_seed(0)
    eng, *_ = engine.initialize(model=nn.Linear(6, 3), config=_cfg(),
                                loss_fn=lambda out_, y: nn.functional.mse_loss(out_, y))
    _check("module", eng, out, lambda p: (p.reference, len(p.chunks), p.loss_fn is not None))
    x, y = torch.randn(2, 6, generator=g), torch.randn(2, 3, generator=g)
    out["module"]["formats"] = [eng.eval_batch(iter([f]), num_micro_batches=1).item()
                                for f in ((x, y), {"input_ids": x, "labels": y})]
    eng.backward(eng.loss_fn(eng(x), y))
    eng.step()
    out["module"]["undeclared_after_step"] = sorted(undeclared(eng))
    eng.destroy()
    # 6. AutoTP: a Hugging Face decoder, tp 2
    eng, *_ = engine.initialize(model=hf.build("llama"), config=_cfg(tensor_parallel={"autotp_size": 2}))
    _check("autotp", eng, out, lambda p: (p.reference, len(p.chunks), p.loss_fn is not None))
    ids = torch.randint(0, hf.VOCAB, (2, hf.SEQ), generator=torch.Generator().manual_seed(0))
    eng.train_batch(iter([{"input_ids": ids, "labels": ids}] * 2))
    out["autotp"]["undeclared_after_step"] = sorted(undeclared(eng))
    eng.destroy()
    return out


def test_every_builder_gives_model_parts_and_nothing_is_patched_onto_the_engine():
    results = run_ranks(_builders, 2, timeout=300)
    for r in results:
        assert r["reference"]["kind"] == (True, 1, "ReferenceModel")
        assert r["given_gpt"]["kind"] == (True, 1, 1)  # one chunk per stage, its half of the tied weight
        assert r["layers"]["kind"] == (False, 1, 1)
        assert r["pipeline_module"]["kind"] == (True, 1)
        assert r["module"]["kind"] == (False, 0, True)
        assert r["autotp"]["kind"] == (False, 0, True)  # the model's own causal-LM loss
        for name, info in r.items():
            assert info["undeclared_at_build"] == [], (name, info)
            assert info["undeclared_after_step"] == [], (name, info)
        assert r["reference"]["caught"] == ["reference_extra"]  # the check can fail
        # one conversion at the data boundary: three formats, one loss (bit for bit)
        for name in ("reference", "given_gpt", "module"):
            losses = r[name]["formats"]
            assert all(v == losses[0] for v in losses), (name, losses)

