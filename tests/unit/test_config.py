"""engine.config: malformed configs fail with the key named; valid ones resolve as documented."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest

from engine.config import ConfigError, load_config
from engine.errors import ConfigError as BaseConfigError

DELETE = object()


def base() -> dict[str, Any]:
    """A small valid config (world size 2: dp 2, tp 1, pp 1)."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "model": {"vocab_size": 256, "hidden_size": 64, "num_layers": 4, "num_heads": 4, "seq_len": 32},
    }


def edit(cfg: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """Set (or with DELETE remove) the dotted ``path`` in a copy of ``cfg``."""
    cfg = copy.deepcopy(cfg)
    *parents, last = path.split(".")
    node = cfg
    for p in parents:
        node = node.setdefault(p, {})
    if value is DELETE:
        node.pop(last, None)
    else:
        node[last] = value
    return cfg


def make(*edits: tuple[str, Any]) -> dict[str, Any]:
    cfg = base()
    for path, value in edits:
        cfg = edit(cfg, path, value)
    return cfg


PP2 = (("pipeline.stages", 2),)
INTERLEAVED = (("pipeline.stages", 2), ("pipeline.schedule", "interleaved-1f1b"), ("pipeline.virtual_stages", 2))

# (id, edits, world_size, substrings the message must contain: the offending key first)
MALFORMED = [
    ("unknown-top", [("zero_optimisation", {"stage": 1})], 2, ["zero_optimisation", "did you mean 'zero_optimization'"]),
    ("unknown-zero", [("zero_optimization.stagee", 1)], 2, ["zero_optimization.stagee", "did you mean 'stage'"]),
    ("unknown-opt-param", [("optimizer.params.lrr", 1e-3)], 2, ["optimizer.params.lrr", "did you mean 'lr'"]),
    ("unknown-model", [("model.hidden", 64)], 2, ["model.hidden", "did you mean"]),
    ("unknown-pipeline", [("pipeline.schedul", "1f1b")], 2, ["pipeline.schedul", "did you mean 'schedule'"]),
    ("unknown-fp16", [("fp16.loss_scale_windows", 10)], 2, ["fp16.loss_scale_windows", "did you mean"]),
    ("unknown-data", [("data.train_file", ["a.txt"])], 2, ["data.train_file", "did you mean 'train_files'"]),
    ("stage-4", [("zero_optimization.stage", 4)], 2, ["zero_optimization.stage", "from 0 to 3"]),
    ("stage-neg", [("zero_optimization.stage", -1)], 2, ["zero_optimization.stage"]),
    ("stage-bool", [("zero_optimization.stage", True)], 2, ["zero_optimization.stage", "integer"]),
    ("stage-str", [("zero_optimization.stage", "1")], 2, ["zero_optimization.stage", "integer"]),
    ("zero-not-object", [("zero_optimization", 1)], 2, ["zero_optimization", "object"]),
    ("micro-zero", [("train_micro_batch_size_per_gpu", 0)], 2, ["train_micro_batch_size_per_gpu"]),
    ("micro-neg", [("train_micro_batch_size_per_gpu", -2)], 2, ["train_micro_batch_size_per_gpu"]),
    ("batch-frac", [("train_batch_size", 2.5)], 2, ["train_batch_size"]),
    ("gas-bool", [("gradient_accumulation_steps", True)], 2, ["gradient_accumulation_steps"]),
    ("batch-mismatch", [("train_batch_size", 10)], 2,
     ["train_batch_size (10)", "train_micro_batch_size_per_gpu (2)", "gradient_accumulation_steps (2)",
      "data-parallel size 2", "world size 2"]),
    ("batch-indivisible", [("train_batch_size", 6), ("gradient_accumulation_steps", DELETE)], 2,
     ["train_batch_size", "data-parallel size 2"]),
    ("batch-gas-only", [("train_micro_batch_size_per_gpu", DELETE)], 2, ["train_micro_batch_size_per_gpu"]),
    ("world-not-divisible", [("pipeline.stages", 2), ("tensor_parallel.autotp_size", 2)], 6,
     ["tensor_parallel.autotp_size", "pipeline.stages", "world size 6"]),
    ("tp-not-dividing-hidden", [("tensor_parallel.autotp_size", 3)], 3, ["tensor_parallel.autotp_size", "model."]),
    ("pp-over-layers", [("pipeline.stages", 8)], 8, ["pipeline.stages", "model.num_layers"]),
    ("fp16-and-bf16", [("fp16.enabled", True), ("bf16.enabled", True)], 2, ["fp16.enabled", "bf16.enabled"]),
    ("fp16-auto", [("fp16.enabled", "auto")], 2, ["fp16.enabled", "auto"]),
    ("bf16-int", [("bf16.enabled", 1)], 2, ["bf16.enabled", "true or false"]),
    ("loss-scale-str", [("fp16.loss_scale", "dynamic")], 2, ["fp16.loss_scale", "number"]),
    ("scale-power-neg", [("fp16.initial_scale_power", -1)], 2, ["fp16.initial_scale_power"]),
    ("bf16-master", [("bf16.bf16_master_weights_and_grads", True)], 2, ["bf16.bf16_master_weights_and_grads"]),
    ("max-grad-norm", [("optimizer.params.max_grad_norm", 1.0)], 2, ["optimizer.params.max_grad_norm", "gradient_clipping"]),
    ("amsgrad", [("optimizer.params.amsgrad", True)], 2, ["optimizer.params.amsgrad"]),
    ("opt-type-sgd", [("optimizer.type", "SGD")], 2, ["optimizer.type", "AdamW"]),
    ("opt-type-typo", [("optimizer.type", "AdamX")], 2, ["optimizer.type", "did you mean"]),
    ("lr-auto", [("optimizer.params.lr", "auto")], 2, ["optimizer.params.lr", "auto"]),
    ("lr-neg", [("optimizer.params.lr", -1)], 2, ["optimizer.params.lr"]),
    ("betas-short", [("optimizer.params.betas", [0.9])], 2, ["optimizer.params.betas"]),
    ("betas-range", [("optimizer.params.betas", [0.9, 1.0])], 2, ["optimizer.params.betas[1]"]),
    ("adamw-l2", [("optimizer.params.adam_w_mode", False)], 2, ["optimizer.params.adam_w_mode"]),
    ("bias-correction", [("optimizer.type", "Adam"), ("optimizer.params.bias_correction", False)], 2,
     ["optimizer.params.bias_correction"]),
    ("lion-eps", [("optimizer.type", "Lion"), ("optimizer.params.eps", 1e-8)], 2, ["optimizer.params.eps"]),
    ("no-optimizer-auto-lr", [("optimizer", DELETE), ("scheduler", {"type": "WarmupLR", "params": {
        "warmup_max_lr": "auto"}})], 2, ["scheduler.params.warmup_max_lr", "no optimizer section"]),
    ("sched-onecycle", [("scheduler", {"type": "OneCycle", "params": {}})], 2, ["scheduler.type"]),
    ("sched-typo", [("scheduler", {"type": "Cosine", "params": {"total_num_steps": 9}})], 2,
     ["scheduler.type", "did you mean 'cosine'"]),
    ("warmup-type", [("scheduler", {"type": "WarmupLR", "params": {"warmup_type": "exp"}})], 2,
     ["scheduler.params.warmup_type"]),
    ("decay-no-total", [("scheduler", {"type": "WarmupDecayLR", "params": {}})], 2, ["scheduler.params.total_num_steps"]),
    ("decay-total-short", [("scheduler", {"type": "WarmupDecayLR",
                                          "params": {"total_num_steps": 10, "warmup_num_steps": 10}})], 2,
     ["scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps"]),
    ("warmup-zero", [("scheduler", {"type": "WarmupLR", "params": {"warmup_num_steps": 0}})], 2,
     ["scheduler.params.warmup_num_steps"]),
    ("warmup-lr-order", [("scheduler", {"type": "WarmupLR", "params": {"warmup_min_lr": 1.0, "warmup_max_lr": 0.1}})],
     2, ["scheduler.params.warmup_min_lr"]),
    ("last-batch-iteration", [("scheduler", {"type": "WarmupLR", "params": {"last_batch_iteration": 5}})], 2,
     ["scheduler.params.last_batch_iteration"]),
    ("cosine-log", [("scheduler", {"type": "cosine", "params": {"total_num_steps": 9, "warmup_type": "log"}})], 2,
     ["scheduler.params.warmup_type"]),
    ("cosine-ratio", [("scheduler", {"type": "cosine", "params": {"total_num_steps": 9, "min_lr_ratio": 1.5}})], 2,
     ["scheduler.params.min_lr_ratio"]),
    ("cosine-total-auto", [("scheduler", {"type": "cosine", "params": {"total_num_steps": "auto"}})], 2,
     ["scheduler.params.total_num_steps", "auto"]),
    ("wsd-overlong", [("scheduler", {"type": "WSD", "params": {"warmup_num_steps": 5, "total_num_steps": 10,
                                                               "decay_num_steps": 6}})], 2,
     ["decay_num_steps", "total_num_steps"]),
    ("wsd-decay-type", [("scheduler", {"type": "WSD", "params": {"total_num_steps": 10, "decay_num_steps": 2,
                                                                 "decay_type": "exp"}})], 2,
     ["scheduler.params.decay_type"]),
    ("offload-optimizer", [("zero_optimization.offload_optimizer", {"device": "cpu", "pin_memory": True})], 2,
     ["zero_optimization.offload_optimizer.device", "offload"]),
    ("offload-param", [("zero_optimization.stage", 3), ("zero_optimization.offload_param", {"device": "nvme"})], 2,
     ["zero_optimization.offload_param.device", "offload"]),
    ("cpu-offload-legacy", [("zero_optimization.cpu_offload", True)], 2, ["zero_optimization.cpu_offload", "offload"]),
    ("zeropp-weights", [("zero_optimization.zero_quantized_weights", True)], 2,
     ["zero_optimization.zero_quantized_weights"]),
    ("hpz", [("zero_optimization.zero_hpz_partition_size", 8)], 2, ["zero_optimization.zero_hpz_partition_size"]),
    ("bucket-zero", [("zero_optimization.reduce_bucket_size", 0)], 2, ["zero_optimization.reduce_bucket_size"]),
    ("bucket-str", [("zero_optimization.allgather_bucket_size", "big")], 2, ["zero_optimization.allgather_bucket_size"]),
    ("bucket-auto-unresolvable", [("zero_optimization.allgather_bucket_size", "auto")], 2,
     ["zero_optimization.allgather_bucket_size", "auto"]),
    ("zero-alias-twice", [("zero_optimization.prefetch_bucket_size", 10),
                          ("zero_optimization.stage3_prefetch_bucket_size", 10)], 2,
     ["zero_optimization.prefetch_bucket_size", "zero_optimization.stage3_prefetch_bucket_size"]),
    ("cpu-checkpointing-type", [("activation_checkpointing.cpu_checkpointing", "yes")], 2,
     ["activation_checkpointing.cpu_checkpointing"]),
    ("number-checkpoints", [("activation_checkpointing.number_checkpoints", 0)], 2,
     ["activation_checkpointing.number_checkpoints"]),
    ("pipe-schedule", [("pipeline.schedule", "1f1b-x")], 2, ["pipeline.schedule"]),
    ("pipe-partition-best", [("pipeline.partition", "best")], 2, ["pipeline.partition"]),
    ("pipe-stages-auto", [("pipeline.stages", "auto")], 2, ["pipeline.stages", "auto"]),
    ("virtual-without-interleaved", [("pipeline.virtual_stages", 2)], 2, ["pipeline.virtual_stages"]),
    ("interleaved-v1", [*INTERLEAVED[:2], ("pipeline.virtual_stages", 1)], 4, ["pipeline.virtual_stages"]),
    ("interleaved-layers", [*INTERLEAVED[:2], ("pipeline.virtual_stages", 4)], 4,
     ["model.num_layers", "pipeline.virtual_stages"]),
    ("interleaved-microbatches", [*INTERLEAVED, ("gradient_accumulation_steps", 3)], 4,
     ["gradient_accumulation_steps", "pipeline.stages"]),
    ("autotp-injection", [("tensor_parallel.tp", {"tp_size": 2})], 2, ["tensor_parallel.tp", "AutoTP"]),
    ("sp-str", [("tensor_parallel.sequence_parallel", "yes")], 2, ["tensor_parallel.sequence_parallel"]),
    ("sp-seq-len", [("tensor_parallel.autotp_size", 4), ("tensor_parallel.sequence_parallel", True),
                    ("model.seq_len", 30)], 4, ["tensor_parallel.sequence_parallel", "model.seq_len"]),
    ("fp8-no-bf16", [("fp8.enabled", True)], 2, ["fp8.enabled", "bf16.enabled"]),
    ("fp8-recipe", [("fp8.recipe", "tensorwise")], 2, ["fp8.recipe"]),
    ("fp8-history", [("fp8.amax_history_len", 0)], 2, ["fp8.amax_history_len"]),
    ("tag-validation", [("checkpoint.tag_validation", "Maybe")], 2, ["checkpoint.tag_validation"]),
    ("keep-last-zero", [("checkpoint.keep_last", 0)], 2, ["checkpoint.keep_last"]),
    ("async-save-str", [("checkpoint.async_save", "yes")], 2, ["checkpoint.async_save"]),
    ("save-interval-neg", [("checkpoint.save_interval", -1)], 2, ["checkpoint.save_interval"]),
    ("load-universal", [("checkpoint.load_universal", True)], 2, ["checkpoint.load_universal"]),
    ("train-files-str", [("data.train_files", "a.txt")], 2, ["data.train_files", "list"]),
    ("train-files-int", [("data.train_files", ["a.txt", 1])], 2, ["data.train_files[1]"]),
    ("doc-masking-str", [("data.document_masking", "no")], 2, ["data.document_masking"]),
    ("clip-auto", [("gradient_clipping", "auto")], 2, ["gradient_clipping", "auto"]),
    ("clip-neg", [("gradient_clipping", -1)], 2, ["gradient_clipping"]),
    ("clip-nan", [("gradient_clipping", float("nan"))], 2, ["gradient_clipping", "finite"]),
    ("seed-frac", [("seed", 1.5)], 2, ["seed"]),
    ("steps-per-print-zero", [("steps_per_print", 0)], 2, ["steps_per_print"]),
    ("wall-clock-str", [("wall_clock_breakdown", "false")], 2, ["wall_clock_breakdown"]),
    ("amp", [("amp", {"enabled": True})], 2, ["amp", "bf16"]),
    ("bfloat16-old-name", [("bfloat16", {"enabled": True})], 2, ["bfloat16", "bf16"]),
    ("prescale", [("prescale_gradients", True)], 2, ["prescale_gradients"]),
    ("ulysses-disagrees", [("sequence_parallel_size", 2), ("context_parallel", {"size": 1})], 2,
     ["sequence_parallel_size", "context_parallel"]),
    ("auto-bucket-without-model", [("model", DELETE), ("zero_optimization.reduce_bucket_size", "auto")], 2,
     ["zero_optimization.reduce_bucket_size", "model section"]),
    ("model-missing-heads", [("model.num_heads", DELETE)], 2, ["model.num_heads"]),
    ("model-auto", [("model.vocab_size", "auto")], 2, ["model.vocab_size", "auto"]),
    ("model-list", [("model", [1, 2])], 2, ["model", "object"]),
    ("model-heads-hidden", [("model.num_heads", 3)], 2, ["model.hidden_size", "model.num_heads"]),
]


@pytest.mark.parametrize("edits,world,needles", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_config_names_the_key(edits, world, needles):
    with pytest.raises(ConfigError) as info:
        load_config(make(*edits), world_size=world)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    assert isinstance(info.value, ValueError) and ConfigError is BaseConfigError


def test_enough_malformed_cases():
    assert len(MALFORMED) >= 40 and len({m[0] for m in MALFORMED}) == len(MALFORMED)


@pytest.mark.parametrize("bad", [[], [{"seed": 1}], 3, None])
def test_not_a_dict_or_path(bad):
    with pytest.raises(ConfigError, match="load_config takes a JSON file path or a dict"):
        load_config(bad, world_size=2)


@pytest.mark.parametrize("world", [0, -1, True, 2.0, "2"])
def test_bad_world_size(world):
    with pytest.raises(ConfigError, match="world_size"):
        load_config(base(), world_size=world)


# ------------------------------------------------------------------ valid
def test_defaults_filled():
    cfg = load_config(base(), world_size=2)
    assert (cfg.dp, cfg.tp, cfg.pp, cfg.world_size) == (2, 1, 1, 2)
    assert cfg.topology.dp == 2 and cfg.topology.world_size == 2
    assert cfg.train_batch_size == 8 and cfg.gradient_accumulation_steps == 2
    assert cfg.precision == "fp32" and not cfg.fp16.enabled and not cfg.bf16.enabled
    assert cfg.fp16.initial_scale_power == 16 and cfg.fp16.loss_scale_window == 1000 and cfg.fp16.hysteresis == 2
    assert cfg.zero.stage == 0 and cfg.zero.overlap_comm is False and cfg.zero.reduce_bucket_size == 500_000_000
    assert cfg.pipeline.schedule == "1f1b" and cfg.pipeline.virtual_stages == 1 and cfg.pipeline.stages == 1
    assert cfg.tensor_parallel.sequence_parallel is False
    assert cfg.seed == 1234 and cfg.gradient_clipping == 1.0 and cfg.steps_per_print == 10
    assert cfg.scheduler is None
    assert cfg.checkpoint.tag_validation == "Warn" and cfg.checkpoint.keep_last is None
    assert cfg.checkpoint.async_save is False
    assert cfg.data.train_files is None and cfg.data.document_masking is False
    assert cfg.fp8.amax_history_len == 16 and cfg.fp8.margin == 0 and cfg.fp8.recipe == "delayed"
    p = cfg.optimizer.params
    assert cfg.optimizer.type == "AdamW" and p.betas == (0.9, 0.999) and p.eps == 1e-8 and p.adam_w_mode


def test_frozen():
    cfg = load_config(base(), world_size=2)
    with pytest.raises(AttributeError):
        cfg.zero.stage = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cfg.seed = 1  # type: ignore[misc]


def test_precision_sections():
    cfg = load_config(make(("fp16.enabled", True), ("fp16.loss_scale", 128), ("fp16.min_loss_scale", 1e-4),
                           ("fp16.consecutive_hysteresis", True), ("fp16.fp16_master_weights_and_grads", False)),
                      world_size=2)
    assert cfg.precision == "fp16" and cfg.fp16.loss_scale == 128.0 and cfg.fp16.min_loss_scale == 1e-4
    assert cfg.fp16.consecutive_hysteresis
    cfg = load_config(make(("bf16.enabled", True), ("fp8.enabled", True), ("fp8.recipe", "current"),
                           ("fp8.format", "E4M3"), ("fp8.amax_compute_algo", "most_recent"), ("fp8.margin", 1),
                           ("bf16.check_grad_overflow", True)), world_size=2)
    assert cfg.precision == "bf16" and cfg.fp8.enabled and cfg.fp8.format == "e4m3" and cfg.fp8.recipe == "current"


@pytest.mark.parametrize("precision,given,resolved", [
    ("bf16", None, "bf16"), ("bf16", "fp32", "fp32"), ("bf16", "torch.bfloat16", "bf16"), ("bf16", "BF16", "bf16"),
    ("fp16", "half", "fp16"), ("fp16", None, "fp16"), ("fp32", "float32", "fp32"), ("fp32", None, "fp32")])
def test_data_types_grad_accum_dtype_follows_deepspeed(precision, given, resolved):
    """DeepSpeed's spellings; unset = the compute dtype; the policy ZeRO builds follows it;
    the resolved config round-trips."""
    from engine.optim.build import precision_policy
    from engine.precision.mixed import _DTYPES

    edits = [] if precision == "fp32" else [(f"{precision}.enabled", True)]
    if given is not None:
        edits.append(("data_types", {"grad_accum_dtype": given}))
    cfg = load_config(make(*edits), world_size=2)
    assert cfg.data_types.grad_accum_dtype == (None if given is None else resolved)
    assert precision_policy(cfg).accum_dtype == _DTYPES[resolved]
    assert load_config(json.loads(json.dumps(cfg.to_dict())), world_size=2) == cfg


@pytest.mark.parametrize("precision,given,needle", [
    ("fp32", "bf16", 'set it to "fp32", or remove it'), ("bf16", "fp16", 'set it to "fp32" or "bf16"'),
    ("bf16", "int8", "must be one of"), ("bf16", 16, "must be one of")])
def test_data_types_bad_grad_accum_dtype_is_an_error(precision, given, needle):
    edits = [] if precision == "fp32" else [(f"{precision}.enabled", True)]
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(make(*edits, ("data_types", {"grad_accum_dtype": given})), world_size=2)


def test_zero_section():
    cfg = load_config(make(("zero_optimization", {
        "stage": 3, "reduce_bucket_size": 5e8, "prefetch_bucket_size": 1000,
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 7,
        "stage3_gather_fp16_weights_on_model_save": True, "sub_group_size": 100,
        "offload_param": {"device": "none", "pin_memory": True}, "offload_optimizer": None,
        "zero_quantized_weights": False, "legacy_stage1": False, "leaf_module": {"classes": ["X"]},
        "elastic_checkpoint": False, "round_robin_gradients": True})), world_size=2)
    z = cfg.zero
    assert z.stage == 3 and z.overlap_comm is True  # DeepSpeed's dynamic default for stage 3
    assert z.reduce_bucket_size == 500_000_000 and isinstance(z.reduce_bucket_size, int)
    assert z.stage3_prefetch_bucket_size == 1000 and z.stage3_param_persistence_threshold == 10 * 64
    assert z.stage3_max_live_parameters == 7 and z.stage3_gather_16bit_weights_on_model_save
    assert z.sub_group_size == 100 and z.round_robin_gradients
    auto = load_config(make(("zero_optimization.reduce_bucket_size", "auto"),
                            ("zero_optimization.stage3_prefetch_bucket_size", "auto")), world_size=2).zero
    assert auto.reduce_bucket_size == 64 * 64 and auto.stage3_prefetch_bucket_size == int(0.9 * 64 * 64)


def test_parallel_sections():
    cfg = load_config(make(*INTERLEAVED, ("pipeline.partition", "uniform"), ("pipeline.activation_checkpoint_interval", 1),
                           ("tensor_parallel.autotp_size", 2), ("tensor_parallel.sequence_parallel", False),
                           ("gradient_accumulation_steps", 4), ("activation_checkpointing.partition_activations", True),
                           ("activation_checkpointing.number_checkpoints", 4)), world_size=8)
    assert (cfg.dp, cfg.tp, cfg.pp) == (2, 2, 2)
    assert cfg.pipeline.schedule == "interleaved-1f1b" and cfg.pipeline.virtual_stages == 2
    assert cfg.activation_checkpointing.partition_activations  # (with sequence_parallel: an error)
    for schedule in ("gpipe", "zb-h1", "1F1B"):
        assert load_config(make(*PP2, ("pipeline.schedule", schedule)), world_size=2).pipeline.schedule == schedule.lower()
    assert load_config(make(("tensor_parallel.autotp_size", 0)), world_size=2).tp == 1  # DeepSpeed: 0 = off


def test_optimizer_variants():
    adam = load_config(make(("optimizer", {"type": "adam", "params": {
        "lr": 2e-4, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.01, "adam_w_mode": False,
        "torch_adam": True, "amsgrad": False, "bias_correction": True}})), world_size=2).optimizer
    assert adam.type == "Adam" and not adam.params.adam_w_mode and adam.params.torch_adam
    assert adam.params.betas == (0.8, 0.9) and adam.params.lr == 2e-4
    lion = load_config(make(("optimizer", {"type": "Lion", "params": {"lr": 1e-4, "weight_decay": 1.0}})),
                       world_size=2).optimizer
    assert lion.type == "Lion" and lion.params.betas == (0.9, 0.999) and not hasattr(lion.params, "eps")


def test_schedulers():
    def sched(t, params, lr=1e-3):
        return load_config(make(("optimizer.params.lr", lr), ("scheduler", {"type": t, "params": params})),
                           world_size=2).scheduler.params
    # DeepSpeed: WarmupLR's warmup_max_lr defaults to the optimizer's lr; WarmupDecayLR's to 0.001.
    assert sched("WarmupLR", {}, lr=5e-4).warmup_max_lr == 5e-4
    assert sched("WarmupLR", {"warmup_max_lr": "auto"}, lr=5e-4).warmup_max_lr == 5e-4
    p = sched("WarmupDecayLR", {"total_num_steps": 2000}, lr=5e-4)
    assert (p.warmup_max_lr, p.warmup_num_steps, p.warmup_type, p.warmup_min_lr) == (0.001, 1000, "log", 0.0)
    p = sched("WarmupCosineLR", {"total_num_steps": 2000})
    assert (p.warmup_min_ratio, p.cos_min_ratio, p.warmup_num_steps, p.warmup_type) == (0.0, 0.0001, 1000, "log")
    p = sched("cosine", {"total_num_steps": 100, "warmup_num_steps": 10})
    assert (p.min_lr_ratio, p.warmup_type) == (0.1, "linear")
    p = sched("WSD", {"total_num_steps": 100, "warmup_num_steps": 10, "decay_num_steps": 90, "decay_type": "sqrt"})
    assert (p.min_lr_ratio, p.decay_type, p.decay_num_steps) == (0.0, "sqrt", 90)


def test_checkpoint_data_and_misc():
    cfg = load_config(make(("checkpoint", {"tag_validation": "fail", "save_interval": 50, "keep_last": 2, "async_save": True,
                                           "use_node_local_storage": False, "parallel_write": {"pipeline_stage": True}}),
                           ("data", {"train_files": ["a.txt", "b.txt"], "tokenizer_model": "t.model",
                                     "cache_dir": "/tmp/c", "document_masking": True}),
                           ("steps_per_print", None), ("seed", 0), ("gradient_clipping", 0),
                           ("zero_allow_untested_optimizer", True), ("prescale_gradients", False)), world_size=2)
    assert cfg.checkpoint.tag_validation == "Fail" and cfg.checkpoint.save_interval == 50
    assert cfg.checkpoint.async_save is True
    assert cfg.data.train_files == ("a.txt", "b.txt") and cfg.data.tokenizer_model == "t.model"
    assert cfg.steps_per_print is None and cfg.seed == 0 and cfg.gradient_clipping == 0.0
    # accelerate (Hugging Face's Trainer with deepspeed=) sets float("inf") to mean never
    assert load_config(make(("steps_per_print", float("inf"))), world_size=2).steps_per_print is None


def test_null_sections_mean_defaults():
    cfg = load_config(make(("fp16", None), ("zero_optimization", None), ("scheduler", None), ("data", None)),
                      world_size=2)
    assert cfg == load_config(base(), world_size=2)


# ---------------------------------------------------------- batch triple
@pytest.mark.parametrize("dp", [1, 2, 3, 4])
@pytest.mark.parametrize("given", ["tb,mb,gas", "tb,mb", "tb,gas", "mb,gas", "tb", "mb"])
@pytest.mark.parametrize("missing_as", ["absent", "auto", "null"])
def test_batch_triple_resolution(dp, given, missing_as):
    mb, gas = 3, 5
    keys = {"tb": "train_batch_size", "mb": "train_micro_batch_size_per_gpu", "gas": "gradient_accumulation_steps"}
    if given in ("tb", "mb"):
        gas = 1  # DeepSpeed: a lone batch key resolves with gradient_accumulation_steps = 1
    true = {"tb": mb * gas * dp, "mb": mb, "gas": gas}
    cfg = base()
    for short, key in keys.items():
        cfg.pop(key, None)
        if short in given.split(","):
            cfg[key] = true[short]
        elif missing_as != "absent":
            cfg[key] = "auto" if missing_as == "auto" else None
    cfg["tensor_parallel"] = {"autotp_size": 2}
    cfg["pipeline"] = {"stages": 2}
    out = load_config(cfg, world_size=4 * dp)  # the rule uses dp = world / (tp * pp), not the world size
    assert out.dp == dp
    assert (out.train_batch_size, out.train_micro_batch_size_per_gpu, out.gradient_accumulation_steps) == \
        (true["tb"], true["mb"], true["gas"])


def test_batch_tb_with_gas_alone_divides():
    cfg = make(("train_micro_batch_size_per_gpu", DELETE), ("train_batch_size", 24), ("gradient_accumulation_steps", 3))
    out = load_config(cfg, world_size=4)
    assert (out.train_micro_batch_size_per_gpu, out.dp) == (2, 4)
    with pytest.raises(ConfigError, match="train_batch_size"):
        load_config(cfg, world_size=3)  # 24 / (3 * 3) is not an integer


def test_batch_all_auto_is_an_error():
    cfg = make(("train_micro_batch_size_per_gpu", "auto"), ("gradient_accumulation_steps", "auto"),
               ("train_batch_size", "auto"))
    with pytest.raises(ConfigError, match="train_batch_size or train_micro_batch_size_per_gpu"):
        load_config(cfg, world_size=2)


# ------------------------------------------------------------- round trip
SYNTHETIC = [
    [],
    [("fp16.enabled", True), ("fp16.loss_scale", 64)],
    [("bf16.enabled", True), ("bf16.check_grad_overflow", False), ("fp8.enabled", True), ("zero_optimization.stage", 3)],
    [*INTERLEAVED, ("gradient_accumulation_steps", 4), ("tensor_parallel.autotp_size", 2)],
    [("optimizer", {"type": "Lion", "params": {"lr": 1e-4}}),
     ("scheduler", {"type": "WSD", "params": {"total_num_steps": 10, "decay_num_steps": 3}})],
    [("optimizer.type", "adam"), ("optimizer.params.adam_w_mode", False),
     ("scheduler", {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}})],
    [("scheduler", {"type": "WarmupCosineLR", "params": {"total_num_steps": 5000}}),
     ("data.train_files", ["x.txt"]), ("checkpoint.keep_last", 1), ("steps_per_print", None)],
    [("zero_optimization.reduce_bucket_size", "auto"), ("zero_optimization.stage", 2)],
    [("model", DELETE), ("zero_optimization.stage", 3)],  # a DeepSpeed config for the caller's own module
]


def test_a_config_without_a_model_section_loads_as_deepspeed_would():
    cfg = load_config(make(("model", DELETE)), world_size=2)
    assert cfg.model is None and "model" not in cfg.to_dict()


@pytest.mark.parametrize("edits", SYNTHETIC, ids=[str(i) for i in range(len(SYNTHETIC))])
def test_round_trip_synthetic(edits):
    world = 8 if any(k == "tensor_parallel.autotp_size" for k, _ in edits) else 4
    cfg = load_config(make(*edits), world_size=world)
    again = load_config(json.loads(json.dumps(cfg.to_dict())), world_size=world)
    assert again == cfg
    assert again.to_dict() == cfg.to_dict()


# ------------------------------------------------------------------- files
def test_duplicate_keys_in_file(tmp_path):
    p = tmp_path / "dup.json"
    p.write_text('{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1, "stage": 2}}')
    with pytest.raises(ConfigError, match=r"duplicate key 'stage'") as info:
        load_config(p, world_size=2)
    assert str(p) in str(info.value)
    p.write_text('{"seed": 1, "seed": 2}')
    with pytest.raises(ConfigError, match=r"duplicate key 'seed'"):
        load_config(str(p), world_size=2)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.json", world_size=2)
    bad = tmp_path / "bad.json"
    bad.write_text('{"seed": 1,}')
    with pytest.raises(ConfigError, match="line 1"):
        load_config(bad, world_size=2)
    bad.write_text('[{"seed": 1}]')
    with pytest.raises(ConfigError, match="top level of the config must be a JSON object"):
        load_config(bad, world_size=2)
    bad.write_text('{"gradient_clipping": NaN}')
    with pytest.raises(ConfigError, match="NaN"):
        load_config(bad, world_size=2)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(base()))
    assert load_config(good, world_size=2) == load_config(base(), world_size=2)


def test_docs_name_every_key():
    """docs/config.md lists every accepted, fixed-value and rejected key."""
    import dataclasses
    from pathlib import Path

    import engine.config.loader as loader
    import engine.config.optim as optim
    import engine.config.schema as schema
    import engine.config.sections as sections

    docs = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    keys: set[str] = set(loader._TOP_LEVEL) | set(loader._TOP_LEVEL_REJECTED) | set(loader._TOP_LEVEL_FIXED)
    keys |= set(loader._TOP_LEVEL_IGNORED) | set(sections._ZERO_ALIASES) | set(sections._ZERO_FIXED)
    keys |= set(sections._ZERO_REJECTED) | set(sections._AUTOTP_REJECTED) | set(optim.OPTIMIZER_TYPES)
    keys |= set(optim.SCHEDULER_TYPES)
    for name in schema.__all__:
        cls = getattr(schema, name)
        if dataclasses.is_dataclass(cls):
            keys |= {f.name for f in dataclasses.fields(cls)} - {"topology", "zero", "params", "type"}
    missing = sorted(k for k in keys if f"`{k}`" not in docs)
    assert not missing, f"docs/config.md does not mention {missing}"
