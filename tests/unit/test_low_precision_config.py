"""DeepSpeed 0.19.8's low-precision options: ``bf16.bf16_master_weights_and_grads`` /
``bf16.bf16_optimizer_states`` (its runtime/config.py asserts and
``ZeROOptimizer._configure_master_weights``) and ``torch_autocast``, as one-line config
errors naming the key and the fix; and the bf16-parameter Adam update against DeepSpeed's own
CPU kernel (within a few bf16 steps on a few elements, not bit for bit: the two fp32 kernels
differ in their last bit now and then, see the test)."""

from __future__ import annotations

import pytest
import torch

from engine.config.loader import load_config
from engine.errors import ConfigError

MASTER = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def _cfg(bf16=None, stage=3, **extra):
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "bf16": MASTER if bf16 is None else bf16, "zero_optimization": {"stage": stage}}
    cfg.update(extra)
    return cfg


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_master_state_loads_at_zero_1_to_3_and_round_trips(stage):
    cfg = load_config(_cfg(stage=stage, torch_autocast={"enabled": True, "dtype": "bfloat16"}), world_size=2)
    assert cfg.bf16.bf16_master_weights_and_grads and cfg.bf16.bf16_optimizer_states
    assert cfg.torch_autocast.enabled and cfg.torch_autocast.dtype == "bf16"
    assert load_config(cfg.to_dict(), world_size=2) == cfg


@pytest.mark.parametrize("cfg,match", [
    (_cfg(stage=0), r"bf16.bf16_master_weights_and_grads = true needs ZeRO stage 1, 2 or 3 .*set the stage"),
    (_cfg({"enabled": True, "bf16_optimizer_states": True}, stage=0), r"bf16.bf16_optimizer_states = true needs ZeRO"),
    (_cfg({"enabled": True, "bf16_optimizer_states": True}),
     r"bf16.bf16_optimizer_states = true needs bf16.bf16_master_weights_and_grads = true"),
    (_cfg({"enabled": False, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}),
     r"needs bf16.enabled = true"),
    (_cfg({"enabled": True, "bf16_master_weights_and_grads": True}),
     r"bf16_optimizer_states = false keeps fp32 Adam moments, which DeepSpeed allows only with ZeRO-Offload"),
    (_cfg(zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu"}},
          optimizer={"type": "Lion", "params": {"lr": 1e-3}}),
     r"with zero_optimization.offload_optimizer needs DeepSpeed's CPU Adam .* optimizer.type is \"Lion\""),
    (_cfg(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}},
          optimizer={"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}), r"\"AdamW\" with torch_adam"),
    (_cfg(optimizer={"type": "Muon", "params": {"lr": 1e-3}}), r"optimizer.type \"Muon\" is not implemented"),
    # without offload only FusedAdamW updates bf16 masters in fp32 per element
    (_cfg(optimizer={"type": "Lion", "params": {"lr": 1e-3}}),
     r"optimizer.type \"Lion\" is not implemented .* not in fp32 per element .*: use \"AdamW\""),
    (_cfg(optimizer={"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False}}),
     r"\"Adam\" with adam_w_mode false is not implemented .*or fp32 masters"),
    (_cfg(stage=1, optimizer={"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}),
     r"\"AdamW\" with torch_adam is not implemented"),
    (_cfg({"enabled": False}, torch_autocast={"enabled": True}), r"torch_autocast.dtype is not set"),
    (_cfg({"enabled": False}, torch_autocast={"enabled": True, "dtype": "float16"}), r"torch_autocast.dtype \"float16\""),
    (_cfg({"enabled": False}, torch_autocast={"enabled": True, "dtype": "int8"}), r"torch_autocast.dtype"),
    (_cfg({"enabled": False}, torch_autocast={"enabled": True, "dtype": "bf16", "lower_precision_safe_modules": ["Linear"]}),
     r"lower_precision_safe_modules: 'Linear' is not a dotted class name"),
])
def test_invalid_combinations_are_one_line_errors(cfg, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(cfg, world_size=2)
    assert "\n" not in str(e.value)


def test_offload_modes_load_and_client_rules():
    """DeepSpeed's two offload modes load (fp32 moments: bf16_optimizer_states false; bf16
    moments); a client optimizer must be DeepSpeedCPUAdam, with fp32_optimizer_states=False for
    bf16 moments (DeepSpeed's asserts)."""
    from engine.optim.build import check_bf16_master_client
    from engine.optim.ds_adam import DeepSpeedCPUAdam

    off = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    for states in (False, True):
        bf16 = dict(MASTER, bf16_optimizer_states=states)
        cfg = load_config(_cfg(bf16, zero_optimization=off), world_size=2)
        client_cfg = load_config({k: v for k, v in _cfg(bf16, zero_optimization=off).items() if k != "optimizer"},
                                 world_size=2)
        p = [torch.nn.Parameter(torch.zeros(4))]
        check_bf16_master_client(DeepSpeedCPUAdam(p, fp32_optimizer_states=not states), client_cfg)
        with pytest.raises(ConfigError, match="needs the client optimizer to be DeepSpeedCPUAdam .* got AdamW"):
            check_bf16_master_client(torch.optim.AdamW(p), client_cfg)
        assert cfg.zero.offload_optimizer.enabled
    with pytest.raises(ConfigError, match="requires DeepSpeedCPUAdam constructed with fp32_optimizer_states=False"):
        check_bf16_master_client(DeepSpeedCPUAdam(p), client_cfg)


def test_safe_module_names_must_import():
    from engine.config.schema import TorchAutocastConfig
    from engine.precision.autocast import DEFAULT_SAFE_MODULES, lower_precision_safe_classes

    assert lower_precision_safe_classes(TorchAutocastConfig(enabled=True, dtype="bf16")) == DEFAULT_SAFE_MODULES
    named = TorchAutocastConfig(enabled=True, dtype="bf16", lower_precision_safe_modules=("torch.nn.LayerNorm",))
    assert lower_precision_safe_classes(named) == (torch.nn.LayerNorm,)
    with pytest.raises(ValueError, match="failed to import 'torch.nn.NoSuchLayer'"):
        lower_precision_safe_classes(TorchAutocastConfig(True, "bf16", ("torch.nn.NoSuchLayer",)))


@pytest.mark.slow
def test_bf16_adam_update_equals_deepspeeds_cpu_kernel():
    """bf16 parameters and bf16 moments (DeepSpeed's bf16 master weights + optimizer states):
    the engine's FusedAdamW update against DeepSpeed's FusedAdam on CPU (its cpu_adam kernel:
    fp32 arithmetic, stored rounded to nearest even) over 3 steps. Not bit for bit: the two
    fp32 kernels differ in the last fp32 bit now and then (DeepSpeed's AVX-512 fused
    multiply-adds), which the bf16 store turns into one bf16 step on a few elements (measured
    after 3 steps: 2 of 4099 parameters, 116 and 28 moments). Held: every element within four bf16
    steps (of itself, or of the tensor's mean magnitude where a moment cancels), at most 5% different."""
    ds_adam = pytest.importorskip("deepspeed.ops.adam")
    from engine.optim import FusedAdamW

    torch.manual_seed(0)
    init = torch.randn(4099) * 0.1  # not a multiple of the SIMD width: the tail path too
    grads = [torch.randn(4099).bfloat16() * 0.01 for _ in range(3)]
    ours, theirs = torch.nn.Parameter(init.bfloat16()), torch.nn.Parameter(init.bfloat16())
    opt_ours = FusedAdamW([ours], lr=1e-3, weight_decay=0.01)
    try:
        opt_theirs = ds_adam.FusedAdam([theirs], lr=1e-3, weight_decay=0.01)
    except Exception as e:  # noqa: BLE001 (its op may not build here)
        pytest.skip(f"DeepSpeed's FusedAdam op is not available: {e}")
    for g in grads:
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt_ours.step()
        opt_theirs.step()
    assert opt_ours.state[ours]["exp_avg"].dtype == torch.bfloat16
    pairs = [(ours.detach(), theirs.detach())] + [(opt_ours.state[ours][k], opt_theirs.state[theirs][k])
                                                  for k in ("exp_avg", "exp_avg_sq")]
    for a, b in pairs:
        a, b = a.float(), b.float()
        # four bf16 steps (2^-5 relative) of the element, or of the tensor's mean magnitude where
        # a moment nearly cancels (0.9 m + 0.1 g ~ 0 turns a one-step difference in m into a
        # large relative one): one-step differences compound over the steps (measured worst
        # 1.16 steps of the bound's scale, in exp_avg); a wrong rounding (truncation) or fp32
        # state would differ on most elements
        assert ((a - b).abs() <= 2.0 ** -5 * torch.maximum(b.abs(), b.abs().mean())).all()
        assert (a != b).float().mean() < 0.05


def test_fp32_moments_of_bf16_parameters_survive_load_state_dict():
    """bf16 master weights with fp32 Adam moments (DeepSpeedCPUAdam's default
    fp32_optimizer_states=True, bf16_optimizer_states false under offload): torch's
    load_state_dict casts floating state to the parameter's dtype; the moments must come back
    fp32 and bit for bit, and the next update equal the uninterrupted one."""
    import copy

    from engine.optim.ds_adam import DeepSpeedCPUAdam

    torch.manual_seed(0)
    grads = [torch.randn(37).bfloat16() for _ in range(3)]
    p = torch.nn.Parameter((torch.randn(37) * 0.1).bfloat16())
    opt = DeepSpeedCPUAdam([p], lr=1e-2, weight_decay=0.1)
    for g in grads[:2]:
        p.grad = g.clone()
        opt.step()
    q = torch.nn.Parameter(p.detach().clone())
    resumed = DeepSpeedCPUAdam([q], lr=1e-2, weight_decay=0.1)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))  # as read from a checkpoint: no shared tensors
    for k in ("exp_avg", "exp_avg_sq"):
        assert resumed.state[q][k].dtype == torch.float32
        assert torch.equal(resumed.state[q][k], opt.state[p][k])
    p.grad, q.grad = grads[2].clone(), grads[2].clone()
    opt.step()
    resumed.step()
    assert torch.equal(p, q)
    # bf16 moments (fp32_optimizer_states=False) still load as bf16
    low = DeepSpeedCPUAdam([torch.nn.Parameter(q.detach().clone())], lr=1e-2, fp32_optimizer_states=False)
    low.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert {v.dtype for st in low.state.values() for k, v in st.items() if k != "step"} == {torch.bfloat16}


def test_an_outer_autocast_is_switched_off_with_a_warning(caplog):
    """The section disabled (the default): a script's own torch.autocast around engine(...) no
    longer applies inside the forward (DeepSpeed's autocast_if_enabled), which is said once."""
    from engine.config.schema import TorchAutocastConfig
    from engine.precision import autocast as ac

    ac._WARNED.discard("cpu")
    with caplog.at_level("WARNING", logger="engine.precision.autocast"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with ac.autocast_forward(TorchAutocastConfig(), "cpu"):
                inside = torch.is_autocast_enabled("cpu")
            with ac.autocast_forward(TorchAutocastConfig(), "cpu"):
                pass
    assert not inside
    assert sum("torch_autocast section is not" in r.getMessage() for r in caplog.records) == 1
