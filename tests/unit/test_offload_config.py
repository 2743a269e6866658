"""ZeRO-Offload's config keys (engine/config/sections.py): DeepSpeed's semantics and defaults,
the refusals with their reasons, and DeepSpeed's older spellings."""

import pytest

from engine.config import load_config
from engine.config.schema import OffloadConfig
from engine.errors import ConfigError


def _zero(**z) -> dict:
    return {"train_batch_size": 2, "zero_optimization": z}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_optimizer_at_stages_1_to_3(stage):
    cfg = load_config(_zero(stage=stage, offload_optimizer={"device": "cpu", "pin_memory": True}), world_size=1)
    assert cfg.zero.offload_optimizer == OffloadConfig("cpu", True) and not cfg.zero.offload_param.enabled
    assert load_config(cfg.to_dict(), world_size=1) == cfg


def test_defaults_and_none_are_off():
    assert load_config(_zero(stage=2), world_size=1).zero.offload_optimizer == OffloadConfig("none", False)
    for off in (None, {"device": "none", "pin_memory": True}, {}):
        cfg = load_config(_zero(stage=3, offload_optimizer=off, offload_param=off), world_size=1)
        assert not cfg.zero.offload_optimizer.enabled and not cfg.zero.offload_param.enabled


def test_deepspeeds_other_keys_are_accepted_for_cpu():
    opt = {"device": "cpu", "nvme_path": "/local_nvme", "buffer_count": 4, "pin_memory": False, "pipeline_read": False,
           "pipeline_write": False, "fast_init": False, "ratio": 1.0, "super_offload": False, "cpuadam_cores_perc": 0.8}
    par = {"device": "cpu", "nvme_path": None, "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9,
           "pin_memory": True}
    cfg = load_config(_zero(stage=3, offload_optimizer=opt, offload_param=par), world_size=1)
    assert cfg.zero.offload_optimizer == OffloadConfig("cpu", False) and cfg.zero.offload_param == OffloadConfig("cpu", True)


@pytest.mark.parametrize("z,needles", [
    (dict(stage=2, offload_optimizer={"device": "nvme"}), ["offload_optimizer.device", "NVMe", "\"cpu\""]),
    (dict(stage=3, offload_param={"device": "nvme", "nvme_path": "/x"}), ["offload_param.device", "NVMe"]),
    (dict(stage=0, offload_optimizer={"device": "cpu"}), ["offload_optimizer.device", "stage 1, 2 or 3"]),
    (dict(stage=2, offload_param={"device": "cpu"}), ["offload_param.device", "stage 3"]),
    (dict(stage=3, offload_optimizer={"device": "cpu", "ratio": 0.3}), ["ratio", "twin-flow"]),
    (dict(stage=3, offload_optimizer={"device": "cpu", "super_offload": True}), ["super_offload", "SuperOffload"]),
    (dict(stage=2, offload_optimizer={"device": "gpu"}), ["offload_optimizer.device", "\"cpu\""]),
    (dict(stage=2, offload_optimizer={"device": "cpu", "pin_memry": True}), ["pin_memry", "pin_memory"]),
    (dict(stage=2, offload_optimizer={"device": "cpu", "buffer_size": 5}), ["buffer_size"]),
    (dict(stage=2, cpu_offload=True, offload_optimizer={"device": "cpu"}), ["cpu_offload", "offload_optimizer"]),
    (dict(stage=2, cpu_offload_param=True), ["cpu_offload_param", "stage 3"]),
])
def test_refusals_name_the_key_and_the_reason(z, needles):
    with pytest.raises(ConfigError) as info:
        load_config(_zero(**z), world_size=1)
    for n in needles:
        assert n in str(info.value), (n, str(info.value))


def test_legacy_cpu_offload_switches_mean_what_they_mean_in_deepspeed():
    cfg = load_config(_zero(stage=3, cpu_offload=True, cpu_offload_param=True, cpu_offload_use_pin_memory=True),
                      world_size=1)
    assert cfg.zero.offload_optimizer == OffloadConfig("cpu", True) == cfg.zero.offload_param


def test_zero_force_ds_cpu_optimizer_is_read_with_deepspeeds_default():
    assert load_config({"train_batch_size": 2}, world_size=1).zero_force_ds_cpu_optimizer is True
    cfg = load_config({"train_batch_size": 2, "zero_force_ds_cpu_optimizer": False}, world_size=1)
    assert cfg.zero_force_ds_cpu_optimizer is False and "zero_force_ds_cpu_optimizer" not in cfg.ignored_keys
    with pytest.raises(ConfigError, match="zero_force_ds_cpu_optimizer"):
        load_config({"train_batch_size": 2, "zero_force_ds_cpu_optimizer": "yes"}, world_size=1)
