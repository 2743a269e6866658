"""``fp8.enabled`` is validated on the whole model, on every rank, before any collective.

The check used to run on each rank's pipeline chunk: with pp = 3, three blocks and a large
vocabulary cut by parameters, the first and last stages hold only the embedding / the
head (no FP8 layer), raised a ConfigError
alone and left the other stages in a collective until the timeout. Now such a run trains
(stages without FP8 layers simply have no scaling state), and a model with no FP8 layer
at all is refused by every rank with the same message.
"""

import pytest
import torch
import torch.nn as nn
from harness import run_ranks

BASE = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bf16": {"enabled": True},
        "fp8": {"enabled": True}, "pipeline": {"stages": 3, "partition": "parameters"},
        "model": {"vocab_size": 4096, "hidden_size": 16, "num_layers": 3, "num_heads": 2, "seq_len": 16}}


def _three_stages(rank, world):
    import engine
    from engine.errors import ConfigError
    from engine.precision.fp8 import fp8_states

    eng, *_ = engine.initialize(model=None, config=BASE)
    has_fp8 = bool(fp8_states(eng.module))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 4096, (4, 1, 17), generator=g)
    loss = float(eng.train_batch(iter([(t[:, :-1], t[:, 1:]) for t in tokens])))
    eng.destroy()
    # a layer list with no FP8 layer anywhere: refused on every rank, before any collective
    layers = [nn.Linear(16, 16) for _ in range(3)]
    try:
        engine.initialize(model=layers, config=dict(BASE, model=dict(BASE["model"], vocab_size=16)))
        err = ""
    except ConfigError as e:
        err = str(e)
    return (has_fp8, loss, err) + _zb_h1_vs_1f1b()


def _zb_h1_vs_1f1b():
    """ZB-H1 splits each backward into an input and a weight half: over FP8 blocks (the
    middle stage) it must quantize each output gradient once, as 1F1B's one backward does
    (it used to run the FP8 backward twice), and train to the same losses."""
    import engine
    import engine.precision.fp8 as fp8

    bwd_casts = []
    real = fp8.fp8_cast

    def counted(t, scale, dtype, **kw):
        bwd_casts.append(dtype == torch.float8_e5m2)  # hybrid: e5m2 = gradients
        return real(t, scale, dtype, **kw)
    fp8.fp8_cast = counted
    out = []
    try:
        for schedule in ("1f1b", "zb-h1"):
            bwd_casts.clear()
            eng, *_ = engine.initialize(model=None, config=dict(BASE, pipeline=dict(BASE["pipeline"],
                                                                                   schedule=schedule)))
            g = torch.Generator().manual_seed(1)
            losses = []
            for _ in range(2):
                tokens = torch.randint(0, 4096, (4, 1, 17), generator=g)
                losses.append(float(eng.train_batch(iter([(t[:, :-1], t[:, 1:]) for t in tokens]))))
            eng.destroy()
            out.append((losses, sum(bwd_casts)))
    finally:
        fp8.fp8_cast = real
    return tuple(out)


def test_fp8_pipeline_with_stages_without_fp8_layers_trains_and_bad_models_fail_everywhere():
    out = run_ranks(_three_stages, 3, timeout=240)
    assert [o[0] for o in out] == [False, True, False]  # embedding | 3 blocks | head
    assert len({o[1] for o in out}) == 1 and out[0][1] == out[0][1]  # same finite loss on every stage
    assert all("fp8.enabled but the model has no FP8 layer" in o[2] for o in out)
    # ZB-H1 vs 1F1B over FP8 blocks: the same output-gradient quantizations (2 steps x 4
    # micro-batches x 3 blocks x 4 FP8 layers on the middle stage), the same losses
    (losses_1f1b, casts_1f1b), (losses_zb, casts_zb) = out[1][3], out[1][4]
    assert casts_zb == casts_1f1b == 2 * 4 * 3 * 4
    assert losses_zb == pytest.approx(losses_1f1b, rel=1e-6, abs=0)
