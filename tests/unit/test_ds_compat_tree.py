"""The pure pieces of engine.compat.deepspeed's module tree, against DeepSpeed 0.19.8's answers:
the CPU accelerator (no CUDA call), ProcessTopology and DeepSpeed's two layouts (rank for
rank equal to DeepSpeed's and to the engine's Topology), RepeatingLoader, log_dist's rank
rule, set_random_seed / move_to_device, DeepSpeedConfig, the config keys
``data_parallel_size`` / ``torch_autocast`` (enabled: tests/unit/test_low_precision_config.py), and the launcher entry's argument handling."""

from __future__ import annotations

import logging
import random

import numpy
import pytest
import torch

import engine.compat.deepspeed as deepspeed
from engine.compat.deepspeed.__main__ import split_launcher_args
from engine.compat.deepspeed.accelerator.real_accelerator import CPU_Accelerator
from engine.compat.deepspeed.runtime.pipe.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)
from engine.config import ConfigError, load_config
from engine.topology import Topology


def test_cpu_accelerator_answers_as_deepspeeds_and_never_touches_cuda(monkeypatch):
    def no_cuda(*a, **k):  # (torch.manual_seed queues torch.cuda.manual_seed_all lazily itself: not patched)
        raise AssertionError("a CUDA call on the CPU accelerator")

    for name in ("synchronize", "set_device", "current_device", "device_count", "empty_cache", "memory_allocated",
                 "max_memory_allocated", "is_bf16_supported", "Stream", "Event"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    acc = CPU_Accelerator()
    assert (acc.device_name(), acc.device_name(3), acc.current_device_name()) == ("cpu", "cpu:3", "cpu")
    assert acc.communication_backend_name() == "gloo" and acc.is_available() and acc.is_bf16_supported()
    assert acc.current_device() == 1 and acc.device_count() == 2  # the launcher's local rank / local world
    assert acc.Stream is None and acc.Event is None and acc.device() is None
    acc.synchronize(), acc.set_device(1), acc.empty_cache()
    with acc.stream(None):
        pass
    assert acc.memory_allocated() > 0 and acc.max_memory_allocated() >= acc.memory_allocated()
    t = torch.ones(2)
    assert acc.on_accelerator(t) and acc.pin_memory(t) is t and not acc.is_pinned(t)
    acc.manual_seed_all(3)
    a = torch.rand(2)
    acc.manual_seed(3)
    assert torch.equal(a, torch.rand(2))
    assert torch.float in acc.supported_dtypes() and torch.bfloat16 in acc.supported_dtypes()
    with pytest.raises(deepspeed.UnsupportedFeatureError, match="op builders"):
        acc.create_op_builder("CPUAdamBuilder")


def test_get_accelerator_is_the_engines_device_and_set_accelerator_checks():
    acc = deepspeed.get_accelerator()
    assert acc is deepspeed.accelerator.get_accelerator()  # one per process
    assert acc.device_name() == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(deepspeed.UnsupportedFeatureError, match="CPU or CUDA only"):
        deepspeed.accelerator.set_accelerator(object())


def test_process_topology_equals_deepspeeds_and_the_engines_layout():
    # values from DeepSpeed's own docstrings
    x = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    assert x.get_rank(x=0, y=1) == 1 and x.get_dim("y") == 3 and x.get_dim("z") == 0
    assert (x.get_coord(rank=1).x, x.get_coord(rank=1).y) == (0, 1)
    assert x.get_axis_list(axis="x", idx=0) == [0, 1, 2] and x.get_axis_list(axis="y", idx=0) == [0, 3]
    t = ProcessTopology(axes=["pipe", "data", "model"], dims=[2, 2, 2])
    assert t.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.filter_match(pipe=0, data=1) == [2, 3]
    assert ProcessTopology(axes=["a", "b"], dims=[2, 2]).get_rank_repr(rank=3) == "a_01-b_01"
    assert t.get_rank_repr(rank=3) == "model_01" and t.world_size() == 8
    with pytest.raises(ValueError, match="one coordinate per axis"):
        t.get_rank(pipe=0)
    # DeepSpeed's 3D layout is the engine's (TP innermost, PP outermost), rank for rank
    pp, tp, dp = 2, 2, 3
    ds = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    ours = Topology(dp=dp, tp=tp, pp=pp)
    for r in range(ds.world_size()):
        c = ds.get_coord(r)
        assert ours.rank(dp=c.data, tp=c.model, pp=c.pipe) == r
    assert PipeDataParallelTopology(num_pp=2, num_dp=2).get_axis_names() == ["pipe", "data"]


def test_repeating_loader_restarts():
    loader = deepspeed.utils.RepeatingLoader([1, 2, 3])
    assert [next(loader) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    assert iter(loader) is loader


def test_log_dist_rank_rule(caplog):
    # before torch.distributed is initialised every process writes, as DeepSpeed. The handler
    # goes on the logger itself: real DeepSpeed, once imported by another test in this process,
    # sets propagate=False on the "DeepSpeed" logger, so the root's capture would see nothing
    ds_logger = logging.getLogger("DeepSpeed")
    ds_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="DeepSpeed"):
            deepspeed.log_dist("hello", ranks=[0])
    finally:
        ds_logger.removeHandler(caplog.handler)
    assert "[Rank -1] hello" in caplog.text
    assert deepspeed.utils.logger is logging.getLogger("DeepSpeed")


def _draw():
    return random.random(), float(numpy.random.rand()), float(torch.rand(()))


def test_set_random_seed_seeds_python_numpy_torch():
    from engine.compat.deepspeed.runtime.utils import set_random_seed

    seed = 2**40 + 7  # numpy takes it mod 2**32, as DeepSpeed reduces it
    random.seed(seed)
    numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    expected = _draw()
    set_random_seed(seed)
    assert _draw() == expected


def test_move_to_device_nested_and_in_place():
    from engine.compat.deepspeed.runtime.utils import move_to_device

    t = torch.ones(2, dtype=torch.float64)
    out = move_to_device({"a": [t, (t,)]}, torch.device("cpu"))
    assert isinstance(out["a"][1], tuple) and torch.equal(out["a"][0], t)
    same = move_to_device(t, "cpu", criterion_func=lambda x: isinstance(x, torch.Tensor))
    assert same is t


def test_deepspeed_config_reads_the_config():
    c = deepspeed.DeepSpeedConfig({"train_batch_size": 8, "gradient_accumulation_steps": 2,
                                   "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (8, 4, 2)
    assert c.zero_optimization_stage == 2 and c.zero_enabled and c.bfloat16_enabled and not c.fp16_enabled
    assert c.world_size == 1
    with pytest.raises(deepspeed.DeepSpeedConfigError, match="unknown key"):
        deepspeed.DeepSpeedConfig({"train_batch_size": 8, "zero_optimisation": {}})


def test_data_parallel_size_and_disabled_torch_autocast_load():
    cfg = load_config({"train_batch_size": 8, "data_parallel_size": 2, "tensor_parallel": {"autotp_size": 2},
                       "torch_autocast": {"enabled": False, "dtype": "bfloat16",
                                          "lower_precision_safe_modules": ["torch.nn.Linear"]}}, world_size=4)
    assert cfg.dp == 2
    with pytest.raises(ConfigError, match=r"data_parallel_size = 4 but the data-parallel size is 2"):
        load_config({"train_batch_size": 8, "data_parallel_size": 4}, world_size=2)
    with pytest.raises(ConfigError, match=r"torch_autocast.dtype is not set: .* set it to \"bfloat16\""):
        load_config({"train_batch_size": 8, "torch_autocast": {"enabled": True}}, world_size=2)
    with pytest.raises(ConfigError, match="unknown key torch_autocast.enable "):
        load_config({"train_batch_size": 8, "torch_autocast": {"enable": False}}, world_size=2)


def test_launcher_entry_moves_the_deepspeed_launchers_local_rank_behind_the_script():
    assert split_launcher_args(["--local_rank=1", "train.py", "--x", "2"]) == (["--local_rank=1"],
                                                                              ["train.py", "--x", "2"])
    assert split_launcher_args(["--local_rank", "0", "-m", "pkg.mod"]) == (["--local_rank", "0"], ["-m", "pkg.mod"])
    assert split_launcher_args(["train.py", "--local_rank=1"]) == ([], ["train.py", "--local_rank=1"])


def test_cuda_accelerator_calls_torch_cuda(monkeypatch):
    """No GPU here: each torch.cuda function the CUDA accelerator uses is replaced by a recorder
    (monkeypatch fails on a name torch.cuda does not have), and each method must reach its own."""
    from engine.compat.deepspeed.accelerator.real_accelerator import CUDA_Accelerator

    calls: list[str] = []
    names = ["set_device", "current_device", "device_count", "synchronize", "is_available", "is_bf16_supported",
             "get_device_capability", "manual_seed_all", "get_rng_state", "set_rng_state", "current_stream",
             "default_stream", "stream", "empty_cache", "memory_allocated", "max_memory_allocated",
             "reset_peak_memory_stats", "memory_reserved", "max_memory_reserved", "memory_stats",
             "mem_get_info", "_lazy_call"]
    def recorder(name):
        def record(*args, **kwargs):
            calls.append(name)
            return (8, 0) if name in ("get_device_capability", "mem_get_info") else 0
        return record

    for name in names:
        monkeypatch.setattr(torch.cuda, name, recorder(name))
    acc = CUDA_Accelerator()
    assert acc.device_name() == "cuda" and acc.device_name(1) == "cuda:1" and acc.current_device_name() == "cuda:0"
    assert acc.communication_backend_name() == "nccl" and acc.Stream is torch.cuda.Stream
    assert acc.Event is torch.cuda.Event and acc.device(1) == torch.device("cuda", 1)
    assert acc.on_accelerator(torch.empty(0, device="meta")) is False and acc.is_fp16_supported()
    for method in ("set_device", "synchronize", "manual_seed_all", "get_rng_state", "current_stream",
                   "default_stream", "stream", "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats",
                   "memory_reserved", "max_memory_reserved", "memory_stats", "lazy_call"):
        getattr(acc, method)(*([0] if method in ("set_device", "manual_seed_all", "stream", "lazy_call") else []))
    acc.set_rng_state(torch.zeros(1))
    acc.empty_cache(), acc.device_count(), acc.is_available(), acc.is_bf16_supported(), acc.available_memory()
    assert set(names) - {"_lazy_call"} <= set(calls) and "_lazy_call" in calls
