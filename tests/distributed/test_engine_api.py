"""engine.initialize + the DeepSpeed loop (loss = engine(batch); engine.backward(loss);
engine.step()) on a plain nn.Module at DP = 2, ZeRO stages 0-3, against single-process
torch.optim.AdamW on the full batch with the same clipping and LR schedule.

Tolerance (fp32): atol 2e-5 on parameters of O(0.1-1) after 3 steps. The DP run sums
gradients over ranks and micro-batches in another order than one backward over the full
batch (~1e-7 relative); AdamW turns that into parameter differences of ~1e-6 at most.
A missing 1/gradient_accumulation_steps, a dropped reduction, clipping on the wrong norm
or an LR schedule stepped at every micro-batch gives errors of the order of lr = 1e-2.
"""

import gc
import math
import types
import weakref

import pytest
import torch
import torch.nn as nn
from harness import dense_adamw_run, run_ranks

import engine
from engine.distributed.groups import NO_TP
from engine.optim.lr_schedules import build_lr_scheduler

STEPS, BATCH, LR, WD, CLIP = 3, 16, 1e-2, 0.1, 0.5
ATOL = 2e-5


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 5))


class _Wrapped(nn.Module):
    """A user model whose forward returns the loss, as DeepSpeed examples do."""

    def __init__(self):
        super().__init__()
        self.net = _model()

    def forward(self, x, y):
        return nn.functional.mse_loss(self.net(x), y)


def _data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 7, generator=g), torch.randn(BATCH, 5, generator=g)


def _config(stage, ga=2, world=2, **extra):
    cfg = {
        "train_batch_size": BATCH, "gradient_accumulation_steps": ga,
        "gradient_clipping": CLIP, "seed": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                      "warmup_num_steps": 4, "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 40,
                              "stage3_param_persistence_threshold": 12},
    }  # no "model" section: a DeepSpeed config for the caller's own module
    cfg.update(extra)
    return cfg


def _reference():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    sched = build_lr_scheduler(opt, "WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                 "warmup_num_steps": 4, "warmup_type": "linear"})
    lrs = []
    for s in range(STEPS):
        x, y = _data(s)
        nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], lrs


def _params(eng):
    if eng.config.zero.stage == 3:
        with eng.optimizer.gathered_params():
            return [p.detach().clone() for p in eng.module.parameters()]
    return [p.detach().clone() for p in eng.module.parameters()]


def _deepspeed_loop(rank, world, stages, ga):
    out = {}
    for stage in stages:
        model = _Wrapped()
        eng, opt, loader, sched = engine.initialize(model=model, model_parameters=model.parameters(),
                                                    config=_config(stage, ga))
        assert opt is eng.optimizer and sched is eng.lr_scheduler and loader is None
        per_rank = BATCH // world
        micro = per_rank // ga
        lrs, unchanged_mid_step = [], True
        for s in range(STEPS):
            x, y = _data(s)
            x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
            for m in range(ga):
                before = _params(eng) if m == 0 else None
                loss = eng(x[m * micro:(m + 1) * micro], y[m * micro:(m + 1) * micro])
                eng.backward(loss)
                if m < ga - 1:
                    lr_before = eng.get_lr()
                    eng.step()  # not a boundary: nothing may change
                    unchanged_mid_step &= all(torch.equal(a, b) for a, b in zip(before, _params(eng)))
                    unchanged_mid_step &= eng.global_steps == s and eng.get_lr() == lr_before
                else:
                    lrs.append(eng.get_lr()[0])
                    eng.step()
            assert not eng.was_step_skipped()
        out[stage] = dict(params=_params(eng), lrs=lrs, global_steps=eng.global_steps,
                          micro_steps=eng.micro_steps, unchanged=unchanged_mid_step,
                          grad_norm=eng.get_global_grad_norm())
    return out


@pytest.mark.timeout(240)
def test_deepspeed_loop_matches_single_process_adamw_zero_0_to_3():
    ref, ref_lrs = _reference()
    results = run_ranks(_deepspeed_loop, 2, [0, 1, 2, 3], 2, timeout=200)
    for stage in range(4):
        for rank, res in enumerate(results):
            r = res[stage]
            assert r["global_steps"] == STEPS and r["micro_steps"] == STEPS * 2
            assert r["unchanged"], f"ZeRO-{stage}: a non-boundary engine.step() changed the model or counters"
            assert r["lrs"] == pytest.approx(ref_lrs, rel=1e-12), f"ZeRO-{stage} LR schedule"
            assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
            for i, (a, b) in enumerate(zip(r["params"], ref)):
                torch.testing.assert_close(a, b, atol=ATOL, rtol=0,
                                           msg=lambda m, stage=stage, rank=rank, i=i: f"ZeRO-{stage} rank {rank} param {i}: {m}")
        # replicas agree exactly (same reduced gradients, same update)
        for a, b in zip(results[0][stage]["params"], results[1][stage]["params"]):
            assert torch.equal(a, b)


# ---------------------------------------------------------------- fp16 overflow and counters
def _fp16_skip(rank, world):
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": LR,
                                            "warmup_num_steps": 4, "warmup_type": "linear"}}
    cfg = _config(0, ga=1, fp16={"enabled": True, "initial_scale_power": 4, "hysteresis": 1},
                  gradient_clipping=0.0, scheduler=sched)
    model = _Wrapped()
    eng, *_ = engine.initialize(model=model, config=cfg)
    assert next(eng.module.parameters()).dtype == torch.float16
    x, y = _data(0)
    x, y = x[rank * 8:(rank + 1) * 8].half(), y[rank * 8:(rank + 1) * 8].half()
    events = []
    for s in range(3):
        before = [p.detach().clone() for p in eng.module.parameters()]
        lr_before, scale_before = eng.get_lr(), eng.get_loss_scale()
        loss = eng(x, y)
        if s == 1 and rank == 1:
            loss = loss * float("inf")  # overflow on one rank only: every rank must skip
        eng.backward(loss)
        eng.step()
        changed = any(not torch.equal(a, b) for a, b in zip(before, eng.module.parameters()))
        events.append(dict(skipped=eng.was_step_skipped(), changed=changed, steps=eng.global_steps,
                           lr_moved=eng.get_lr() != lr_before, it=eng.lr_scheduler.last_batch_iteration,
                           scale=(scale_before, eng.get_loss_scale())))
    return events, eng.skipped_steps


def _dataloader(rank, world):
    """training_data -> DeepSpeed's dataloader: micro-batches of each DP rank's shard."""
    data = torch.utils.data.TensorDataset(torch.arange(40).float().view(20, 2), torch.zeros(20, 1))
    args = types.SimpleNamespace(deepspeed_config=_config(0, ga=2), local_rank=rank)  # DeepSpeed-style args
    eng, opt, loader, _ = engine.initialize(args=args, model=nn.Linear(2, 1), training_data=data)
    rows = [x[:, 0].long().tolist() for x, _ in loader]
    # destroy() breaks the optimizer <-> parameter-hook cycle, so the groups can be freed
    ref = weakref.ref(opt)
    eng.destroy()
    del eng, opt, loader
    gc.collect()
    assert ref() is None, "the optimizer (and its process groups) outlived engine.destroy()"
    return rows


def _fp16_and_bad_args(rank, world):
    return _fp16_skip(rank, world), _bad_args(rank, world), _dataloader(rank, world)


@pytest.fixture(scope="module")
def fp16_and_bad_args():
    """One 2-rank launch for both tests below (spawning ranks is the slow part)."""
    return run_ranks(_fp16_and_bad_args, 2, timeout=120)


def test_fp16_overflow_skips_the_step_on_every_rank_and_counts_it(fp16_and_bad_args):
    for (events, skipped), _, _ in fp16_and_bad_args:
        assert [e["skipped"] for e in events] == [False, True, False]
        assert [e["changed"] for e in events] == [True, False, True]
        assert [e["steps"] for e in events] == [1, 2, 3]          # skipped steps count (DeepSpeed)
        assert [e["it"] for e in events] == [0, 0, 1]  # no LR step on a skip (DeepSpeed's iteration, from -1)
        # DeepSpeed's WarmupLR has its min lr at iterations -1 and 0: the first step leaves it
        assert [e["lr_moved"] for e in events] == [False, False, True]
        assert events[1]["scale"] == (16.0, 8.0)                  # hysteresis 1: halved at once
        assert skipped == 1


# ---------------------------------------------------------------- bad arguments
def _bad_args(rank, world):
    model = _Wrapped()
    errors = {}
    for name, kwargs in {
        "no_config": dict(model=model),
        "two_configs": dict(model=model, config=_config(0), config_params=_config(0)),
        "mpu": dict(model=model, config=_config(0), mpu=object()),
        "world": dict(model=model, config=_config(0, train_batch_size=BATCH, ga=1,
                                                  tensor_parallel={"autotp_size": 4})),
    }.items():
        try:
            engine.initialize(**kwargs)
        except (ValueError, TypeError) as exc:
            errors[name] = str(exc)
    return errors


def test_initialize_rejects_bad_arguments_with_a_message(fp16_and_bad_args):
    errors = fp16_and_bad_args[0][1]
    assert "no config" in errors["no_config"]
    assert "more than once" in errors["two_configs"]
    assert "mpu" in errors["mpu"]
    assert "world" in errors["world"] or "divisible" in errors["world"]


def test_training_data_becomes_a_dataloader_over_the_dp_shards(fp16_and_bad_args):
    rows = [r[2] for r in fp16_and_bad_args]
    micro = BATCH // (2 * 2)
    for batches in rows:  # 10 rows a rank: DeepSpeed keeps the short last micro-batch
        assert [len(b) for b in batches] == [micro, micro, 10 - 2 * micro]
    seen = sorted(i for batches in rows for b in batches for i in b)
    assert seen == list(range(0, 40, 2))  # disjoint rows (row i reads 2i), every row read (order: tests/unit/test_ds_loader.py)


# ---------------------------------------------------------------- a list of layers over 2 stages
# Losses of the tiny GPT over 3 AdamW steps at lr 1e-2 on random tokens: reduction-order
# differences (~1 ulp in the first loss) grow to ~3e-6 relative by step 3 (measured), since
# Adam's normalised update turns tiny gradient differences on near-zero elements into
# lr-sized ones. 2e-5 leaves room; a wrong gradient is off by > 1e-3 at step 2.
RTOL_ADAM = 2e-5
_TINY = {"vocab_size": 64, "hidden_size": 16, "num_layers": 2, "num_heads": 2, "seq_len": 8}


def _tiny_batches(step, n=2, micro=2):
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, _TINY["vocab_size"], (n * micro, _TINY["seq_len"] + 1), generator=g)
    return [(ids[i * micro:(i + 1) * micro, :-1], ids[i * micro:(i + 1) * micro, 1:]) for i in range(n)]


def _layer_list(rank, world):
    from engine.models import GPT, ModelConfig, build_stage_layers

    mcfg = ModelConfig(**_TINY)
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "seed": 3,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
           "pipeline": {"stages": 2, "partition": "uniform"}, "model": _TINY}
    layers = build_stage_layers(mcfg, NO_TP, seed=3)  # unsharded; the head shares the embedding weight
    eng, *_ = engine.initialize(model=layers, config=cfg)
    losses = [eng.train_batch(iter(_tiny_batches(s))).item() for s in range(3)]
    eval_loss = eng.eval_batch(iter(_tiny_batches(9))).item()
    # the dense single-process reference on every rank
    ref = GPT(mcfg, seed=3)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for s in range(3):
        mb_losses = [ref(x, y) for x, y in _tiny_batches(s)]
        loss = torch.stack(mb_losses).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    with torch.no_grad():
        ref_eval = torch.stack([ref(x, y) for x, y in _tiny_batches(9)]).mean().item()
    return losses + [eval_loss], ref_losses + [ref_eval]


def _dense_reference(mcfg, seed, steps, lr=1e-2):
    from engine.models import GPT

    return dense_adamw_run(GPT(mcfg, seed=seed), _tiny_batches, steps, lr)


def _gpt_and_fp16(rank, world):
    from engine.models import GPT, ModelConfig

    mcfg = ModelConfig(**_TINY)
    base = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "seed": 3,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}, "model": _TINY}
    # an unsharded GPT (seed 11, not the config's 3) sharded onto TP = 2
    eng, *_ = engine.initialize(model=GPT(mcfg, seed=11), config=dict(base, tensor_parallel={"autotp_size": 2}))
    tp_losses = [eng.train_batch(iter(_tiny_batches(s))).item() for s in range(3)]
    # fp16 through the pipeline executor: the loss scale must reach the backward
    fp16 = dict(base, pipeline={"stages": 2, "partition": "uniform"}, fp16={"enabled": True, "loss_scale": 1024})
    eng, *_ = engine.initialize(config=fp16)
    fp16_loss = eng.train_batch(iter(_tiny_batches(0))).item()
    return tp_losses, (fp16_loss, eng.get_global_grad_norm(), eng.was_step_skipped())


def test_a_list_of_layers_trains_over_two_pipeline_stages_like_the_dense_model():
    """pp = 2 with the tied embedding/head split into a copy on the last stage: losses (and an
    eval_batch after training) equal the dense model's within fp32 reduction-order noise."""
    for losses, ref in run_ranks(_layer_list, 2, timeout=120):
        assert losses[0] == pytest.approx(ref[0], rel=2e-6)
        assert losses == pytest.approx(ref, rel=RTOL_ADAM)


def test_an_unsharded_gpt_is_sharded_and_fp16_pipeline_gradients_are_unscaled():
    """TP = 2 from a given GPT equals that GPT trained densely (fp32); an fp16
    pipeline step reports the unscaled loss and gradient norm of the dense fp32 model within
    fp16 rounding (rtol 2e-2; a loss scale missing from the pipeline's backward or applied
    twice is off by a factor 1024)."""
    from engine.models import ModelConfig

    mcfg = ModelConfig(**_TINY)
    ref11, _ = _dense_reference(mcfg, 11, 3)
    ref3, norms3 = _dense_reference(mcfg, 3, 1)
    for tp_losses, (loss16, norm16, skipped) in run_ranks(_gpt_and_fp16, 2, timeout=120):
        assert tp_losses[0] == pytest.approx(ref11[0], rel=2e-6)  # before any update: the weights were loaded
        assert tp_losses == pytest.approx(ref11, rel=RTOL_ADAM)
        assert not skipped
        assert loss16 == pytest.approx(ref3[0], rel=2e-2)
        assert norm16 == pytest.approx(norms3[0], rel=2e-2)


# ---------------------------------------------------------------- wall_clock_breakdown
def _timed_steps(rank, world, enabled):
    import logging
    import time

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("engine.engine").addHandler(Keep())
    logging.getLogger("engine.engine").setLevel(logging.INFO)
    model = _Wrapped()
    eng, *_ = engine.initialize(model=model, config=_config(1, ga=2, wall_clock_breakdown=enabled,
                                                            steps_per_print=2))
    per_rank, micro = BATCH // world, BATCH // world // 2
    out = []
    for s in range(2):
        x, y = _data(s)
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        t0 = time.perf_counter()
        for m in range(2):
            eng.backward(eng(x[m * micro:(m + 1) * micro], y[m * micro:(m + 1) * micro]))
            eng.step()
        out.append((dict(eng.timers.last), (time.perf_counter() - t0) * 1e3))
    eng.destroy()
    return out, records


@pytest.mark.parametrize("enabled", [True, False])
def test_wall_clock_breakdown_times_each_phase_of_the_step(enabled):
    for rank, (steps, logged) in enumerate(run_ranks(_timed_steps, 2, enabled, timeout=120)):
        for phases, wall_ms in steps:
            if not enabled:
                assert phases == {}
                continue
            assert set(phases) == {"forward", "backward", "reduce", "step"}, phases
            assert all(v > 0 for v in phases.values()) and sum(phases.values()) <= wall_ms
        timing_lines = [m for m in logged if "time (ms)" in m]
        if enabled and rank == 0:  # steps_per_print = 2: logged once, by rank 0
            assert len(timing_lines) == 1 and "step 2 time (ms): forward" in timing_lines[0], logged
        else:
            assert timing_lines == []
