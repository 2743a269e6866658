"""Parsers for the non-optimizer sections: precision, ZeRO, parallelism, checkpoint, data, model.

Each ``parse_*`` takes the parent :class:`Section` and returns a frozen dataclass from
:mod:`engine.config.schema`. Cross-section rules (batch sizes, fp16 vs bf16, pipeline vs
model depth) live in :mod:`engine.config.loader`.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any, Optional

from engine.config.limits import check_model_limits, check_parameter_count
from engine.config.reader import Section
from engine.config.schema import (
    ActivationCheckpointingConfig,
    AutoTPLayerSpecConfig,
    AutoTPPartitionConfig,
    BF16Config,
    CheckpointConfig,
    DataConfig,
    DataTypesConfig,
    FP8Config,
    FP16Config,
    OffloadConfig,
    PipelineConfig,
    TensorParallelConfig,
    ZeroConfig,
)
from engine.errors import ConfigError
from engine.models.config import RECOMPUTE_MODULES, ModelConfig

__all__ = [
    "parse_fp16", "parse_bf16", "parse_fp8", "parse_data_types", "parse_zero", "parse_activation_checkpointing",
    "parse_pipeline", "parse_tensor_parallel", "parse_checkpoint", "parse_data", "parse_model",
    "PIPELINE_SCHEDULES", "DTYPE_NAMES",
    "PARTITION_METHODS",
]

_NO_NVME = ("NVMe offload (DeepSpeed's ZeRO-Infinity, through its async-I/O op) is not implemented; "
            "offload to \"cpu\" instead")


def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


# ---------------------------------------------------------------- precision
def parse_fp16(top: Section) -> FP16Config:
    s = top.sub("fp16", _names(FP16Config), fixed={
        "fp16_master_weights_and_grads": (False, "master weights and gradients are always kept in fp32"),
    })
    d = FP16Config()
    return FP16Config(
        enabled=s.bool("enabled", d.enabled, auto_hint=_PRECISION_AUTO),
        auto_cast=s.bool("auto_cast", d.auto_cast),
        loss_scale=s.number("loss_scale", d.loss_scale, min=0.0),
        initial_scale_power=s.int("initial_scale_power", d.initial_scale_power, min=0, max=126),
        loss_scale_window=s.int("loss_scale_window", d.loss_scale_window, min=1),
        hysteresis=s.int("hysteresis", d.hysteresis, min=1),
        consecutive_hysteresis=s.bool("consecutive_hysteresis", d.consecutive_hysteresis),
        min_loss_scale=s.number("min_loss_scale", d.min_loss_scale, min=0.0, min_exclusive=True),
    )


_PRECISION_AUTO = (" (it depends on the device, and loading a config is device-independent; bf16 suits "
                   "A100/H100, fp16 older GPUs, both off means fp32)")


def parse_bf16(top: Section) -> BF16Config:
    s = top.sub("bf16", _names(BF16Config), fixed={
        "immediate_grad_update": (False, "gradients are applied once per optimizer step"),
    })
    # bf16_master_weights_and_grads / bf16_optimizer_states: their rules (ZeRO stage, offload)
    # are cross-section, engine.config.low_precision.check_low_precision_master
    return BF16Config(enabled=s.bool("enabled", False, auto_hint=_PRECISION_AUTO),
                      check_grad_overflow=s.bool("check_grad_overflow", True),
                      bf16_master_weights_and_grads=s.bool("bf16_master_weights_and_grads", False),
                      bf16_optimizer_states=s.bool("bf16_optimizer_states", False))


# DeepSpeed's DtypeEnum spellings of the floating dtypes -> this engine's names (the dtypes a
# gradient may accumulate in; engine.config.low_precision's autocast dtypes are the 16-bit ones)
DTYPE_NAMES = {
    "fp32": "fp32", "float32": "fp32", "torch.float32": "fp32", "float": "fp32",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "torch.float16": "fp16", "half": "fp16",
}


def parse_data_types(top: Section) -> DataTypesConfig:
    s = top.sub("data_types", _names(DataTypesConfig))
    if s.raw("grad_accum_dtype") is None:
        return DataTypesConfig()
    name = s.choice("grad_accum_dtype", tuple(DTYPE_NAMES), case_insensitive=True)
    return DataTypesConfig(grad_accum_dtype=DTYPE_NAMES[name])


def parse_fp8(top: Section) -> FP8Config:
    s = top.sub("fp8", _names(FP8Config))
    d = FP8Config()
    return FP8Config(
        enabled=s.bool("enabled", d.enabled),
        recipe=s.choice("recipe", ("delayed", "current"), d.recipe),
        format=s.choice("format", ("hybrid", "e4m3"), d.format, case_insensitive=True),
        amax_history_len=s.int("amax_history_len", d.amax_history_len, min=1),
        amax_compute_algo=s.choice("amax_compute_algo", ("max", "most_recent"), d.amax_compute_algo),
        margin=s.int("margin", d.margin, min=0),
    )


# --------------------------------------------------------------------- ZeRO
# DeepSpeed accepts both spellings of these ZeRO-3 keys (pydantic alias + field name).
_ZERO_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",  # deprecated name
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
}
_ZERO_FIXED = {
    "legacy_stage1": (False, "there is one ZeRO-1 implementation"),
    "zero_hpz_partition_size": (1, "ZeRO++ hierarchical partitioning (hpZ) is not implemented"),
    "zero_quantized_weights": (False, "ZeRO++ quantized weight communication is not implemented"),
    "zero_quantized_nontrainable_weights": (False, "ZeRO++ weight quantization is not implemented"),
    "zero_quantized_gradients": (False, "ZeRO++ quantized gradient communication is not implemented"),
    "zenflow": (None, "ZenFlow (stale-gradient offloaded updates) is not implemented; use offload_optimizer"),
}
_ZERO_REJECTED = {
    "mics_shard_size": "MiCS sharding is not implemented (DeepSpeed removed it as well): use stage 3",
    "mics_hierarchical_params_gather": "MiCS sharding is not implemented: use stage 3",
}
# DeepSpeed's offload sections: DeepSpeedZeroOffloadOptimizerConfig / DeepSpeedZeroOffloadParamConfig
_OFFLOAD_OPTIMIZER_KEYS = ("device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
                           "fast_init", "ratio", "super_offload", "cpuadam_cores_perc")
_OFFLOAD_PARAM_KEYS = ("device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory")
_LEGACY_OFFLOAD = ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory")
_LEAF_MODULE_KEYS = ("classes", "names", "name_suffixes")


def parse_zero(top: Section, hidden_size: Optional[int]) -> ZeroConfig:
    accepted = _names(ZeroConfig) + ("leaf_module",) + _LEGACY_OFFLOAD
    s = top.sub("zero_optimization", accepted, aliases=_ZERO_ALIASES, fixed=_ZERO_FIXED, rejected=_ZERO_REJECTED)
    _check_leaf_module(s)
    d = ZeroConfig()
    stage = s.int("stage", d.stage, min=0, max=3)
    offload_optimizer, offload_param = _parse_offload(s, stage)
    # "auto" bucket sizes are resolved from the model width, as the Hugging Face integration does.
    h = hidden_size or 0
    auto_sizes = {
        "reduce_bucket_size": h * h,
        "stage3_prefetch_bucket_size": int(0.9 * h * h),
        "stage3_param_persistence_threshold": 10 * h,
    }
    values: dict[str, Any] = {"stage": stage, "offload_optimizer": offload_optimizer, "offload_param": offload_param}
    for f in fields(ZeroConfig):
        name = f.name
        if name in values:
            continue
        if name == "overlap_comm":
            values[name] = s.bool(name, stage == 3)  # DeepSpeed: on by default for stage 3 only
        elif name in auto_sizes and s.is_auto(name):
            if hidden_size is None:
                raise ConfigError(f"{s.full(name)} = \"auto\" is resolved from model.hidden_size, but the config "
                                  f"has no model section: set a number (DeepSpeed's default is 500000000) or "
                                  f"add the model section")
            values[name] = auto_sizes[name]
        elif isinstance(f.default, bool):
            values[name] = s.bool(name, f.default)
        else:
            lo = 1 if name in ("reduce_bucket_size", "allgather_bucket_size") else 0
            values[name] = s.int(name, f.default, min=lo)
    return ZeroConfig(**values)


def _parse_offload(s: Section, stage: int) -> tuple[OffloadConfig, OffloadConfig]:
    """``offload_optimizer`` (stages 1-3) and ``offload_param`` (stage 3), DeepSpeed's
    semantics: device "none" (the default) is off; DeepSpeed's deprecated ``cpu_offload`` /
    ``cpu_offload_param`` / ``cpu_offload_use_pin_memory`` switches mean device "cpu" (and
    ``pin_memory``) as they do there."""
    opt = _offload_section(s, "offload_optimizer", _OFFLOAD_OPTIMIZER_KEYS)
    par = _offload_section(s, "offload_param", _OFFLOAD_PARAM_KEYS)
    legacy = {k: s.bool(k, False) for k in _LEGACY_OFFLOAD}
    pin = legacy["cpu_offload_use_pin_memory"]
    names = {"offload_optimizer": s.full("offload_optimizer") + ".device",
             "offload_param": s.full("offload_param") + ".device"}
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if legacy[old]:
            names[new] = f"{s.full(old)} = true (DeepSpeed's older spelling of {new}.device \"cpu\"), i.e. {names[new]}"
            if s.has(new) and s.raw(new) is not None:
                raise ConfigError(f"{s.full(old)} and {s.full(new)} both configure {new}: keep only {s.full(new)} "
                                  f"(DeepSpeed's newer spelling)")
            cfg = OffloadConfig(device="cpu", pin_memory=pin)
            opt, par = (cfg, par) if new == "offload_optimizer" else (opt, cfg)
    if opt.enabled and stage == 0:
        raise ConfigError(f"{names['offload_optimizer']} = \"{opt.device}\" needs ZeRO stage 1, 2 or 3 "
                          f"(the offloaded state is the rank's optimizer shard): set zero_optimization.stage, or "
                          f"set the device to \"none\"")
    if par.enabled and stage != 3:
        raise ConfigError(f"{names['offload_param']} = \"{par.device}\" needs ZeRO stage 3 (only stage 3 "
                          f"partitions the parameters; DeepSpeed's rule too): set zero_optimization.stage to 3, or "
                          f"set the device to \"none\"")
    return opt, par


def _offload_section(s: Section, key: str, accepted: tuple[str, ...]) -> OffloadConfig:
    """One offload section; the NVMe-only keys are type-checked and have no effect with "cpu"."""
    if not s.has(key) or s.raw(key) is None:
        return OffloadConfig()
    o = s.sub(key, accepted)
    device = o.choice("device", ("none", "cpu", "nvme"), "none", case_insensitive=True)
    if device == "nvme":
        raise ConfigError(f"{o.full('device')} = \"nvme\": {_NO_NVME}, or set it to \"none\"")
    pin = o.bool("pin_memory", False)
    o.optional_str("nvme_path")
    for k in ("buffer_count", "buffer_size", "max_in_cpu"):
        if o.has(k):
            o.int(k, 0, min=0)
    for k in ("pipeline_read", "pipeline_write", "fast_init"):
        if o.has(k):
            o.bool(k, False)
    if o.has("ratio") and o.number("ratio", 1.0, min=0.0, max=1.0) != 1.0:
        raise ConfigError(f"{o.full('ratio')} = {o.raw('ratio')}: offloading part of the optimizer state (DeepSpeed's "
                          f"ZeRO-3 twin-flow) is not implemented; remove the key or set it to 1.0 (all of it)")
    if o.has("super_offload") and o.bool("super_offload", False):
        raise ConfigError(f"{o.full('super_offload')} = true: DeepSpeed's SuperOffload (Grace-Hopper superchips) is "
                          f"not implemented; remove the key or set it to false")
    if o.has("cpuadam_cores_perc"):
        o.number("cpuadam_cores_perc", 0.8, min=0.0, max=1.0, min_exclusive=True)
    return OffloadConfig(device=device, pin_memory=pin)


def _check_leaf_module(s: Section) -> None:
    # ZeRO-3 leaf modules tell DeepSpeed's per-module hooks where to stop; this engine gathers
    # parameters per transformer block, so the setting is validated and then has no effect.
    if s.has("leaf_module") and s.raw("leaf_module") is not None:
        leaf = s.sub("leaf_module", _LEAF_MODULE_KEYS)
        for k in _LEAF_MODULE_KEYS:
            if leaf.has(k) and not isinstance(leaf.raw(k), str):
                leaf.str_list(k, nullable=False)


# ------------------------------------------------------------ parallelism
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")


def parse_activation_checkpointing(top: Section) -> ActivationCheckpointingConfig:
    s = top.sub("activation_checkpointing", _names(ActivationCheckpointingConfig))
    d = ActivationCheckpointingConfig()
    granularity = s.choice("granularity", RECOMPUTE_GRANULARITIES, d.granularity)
    modules = s.str_list("modules")
    for m in modules or ():
        if m not in RECOMPUTE_MODULES:
            raise ConfigError(f"activation_checkpointing.modules: {m!r} is not a part of the block; choose from "
                              f"{sorted(RECOMPUTE_MODULES)}")
    if modules is not None and granularity != "selective":
        raise ConfigError(f"activation_checkpointing.modules names the parts \"selective\" recomputes, but "
                          f"granularity is \"{granularity}\": set granularity to \"selective\" or remove modules")
    method = s.choice("method", RECOMPUTE_METHODS, d.method)
    num_layers = s.int("num_layers", d.num_layers, min=1)
    for key, value, default in (("method", method, d.method), ("num_layers", num_layers, d.num_layers)):
        if value != default and granularity != "full":  # (the defaults round-trip through to_dict)
            raise ConfigError(f"activation_checkpointing.{key} applies to granularity \"full\" only (got "
                              f"\"{granularity}\"): set granularity to \"full\" or remove {key}")
    return ActivationCheckpointingConfig(
        granularity=granularity,
        modules=modules,
        method=method,
        num_layers=num_layers,
        cpu_checkpointing=s.bool("cpu_checkpointing", d.cpu_checkpointing),
        partition_activations=s.bool("partition_activations", d.partition_activations),
        contiguous_memory_optimization=s.bool("contiguous_memory_optimization", d.contiguous_memory_optimization),
        number_checkpoints=s.int("number_checkpoints", None, min=1, nullable=True),
        synchronize_checkpoint_boundary=s.bool("synchronize_checkpoint_boundary", d.synchronize_checkpoint_boundary),
        profile=s.bool("profile", d.profile),
    )


PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v")
# Schedules that take two model chunks per rank in V placement (engine.pipeline.schedule.V_SCHEDULES).
V_PIPELINE_SCHEDULES = ("zb-v", "dualpipe-v")

# Layers to pipeline stages: the one table of the names ``pipeline.partition`` and
# PipelineModule's ``partition_method`` take, one meaning each (the config layer holds it so
# the loader can check the key; engine.pipeline.partition implements each). "uniform" is
# DeepSpeed's (equal layer counts); Megatron's even split of the blocks is "blocks".
PARTITION_METHODS: dict[str, str] = {
    "parameters": "balance the trainable parameter counts (the config's: the largest piece as small as possible; "
                  "a PipelineModule's: DeepSpeed's partition_balanced, the least spread)",
    "uniform": "equal numbers of layers, the first pieces one more (DeepSpeed's partition_uniform)",
    "blocks": "the blocks between the embedding and the head split evenly, the embedding joining the first "
              "piece and the head the last (Megatron's)",
    "type:<regex>": "balance the layers whose class name matches the regex, case-insensitive (DeepSpeed's; "
                    "a PipelineModule's partition_method only: the config's model has no layer classes to match)",
}
CONFIG_PARTITION_METHODS = tuple(m for m in PARTITION_METHODS if not m.startswith("type:"))


def parse_pipeline(top: Section) -> PipelineConfig:
    s = top.sub("pipeline", _names(PipelineConfig))
    d = PipelineConfig()
    cfg = PipelineConfig(
        stages=s.int("stages", d.stages, min=1,
                     auto_hint=" (DeepSpeed takes it from the model object)"),
        partition=s.choice("partition", CONFIG_PARTITION_METHODS, d.partition),
        activation_checkpoint_interval=s.int("activation_checkpoint_interval", d.activation_checkpoint_interval, min=0),
        schedule=s.choice("schedule", PIPELINE_SCHEDULES, d.schedule, case_insensitive=True),
        virtual_stages=s.int("virtual_stages", d.virtual_stages, min=1),
        seed_layers=s.bool("seed_layers", d.seed_layers),
        pipe_partitioned=s.bool("pipe_partitioned", d.pipe_partitioned),
        grad_partitioned=s.bool("grad_partitioned", d.grad_partitioned),
    )
    if cfg.schedule == "interleaved-1f1b" and cfg.virtual_stages < 2:
        raise ConfigError("pipeline.virtual_stages must be >= 2 with pipeline.schedule \"interleaved-1f1b\" "
                          "(with one chunk per rank it is plain 1F1B): set virtual_stages, or schedule \"1f1b\"")
    if cfg.schedule in V_PIPELINE_SCHEDULES and cfg.stages < 2:
        raise ConfigError(f"pipeline.schedule \"{cfg.schedule}\" needs pipeline.stages >= 2 (got {cfg.stages}): "
                          "set more stages, or use \"1f1b\" without a pipeline")
    if cfg.schedule in V_PIPELINE_SCHEDULES and cfg.virtual_stages != 2:
        raise ConfigError(f"pipeline.schedule \"{cfg.schedule}\" runs exactly two model chunks per rank in V "
                          f"placement (rank r holds stages r and 2p-1-r): set pipeline.virtual_stages to 2 "
                          f"(got {cfg.virtual_stages})")
    if cfg.schedule not in ("interleaved-1f1b", *V_PIPELINE_SCHEDULES) and cfg.virtual_stages != 1:
        raise ConfigError(f"pipeline.virtual_stages = {cfg.virtual_stages} needs pipeline.schedule "
                          f"\"interleaved-1f1b\" (or 2 with \"zb-v\" / \"dualpipe-v\"; got \"{cfg.schedule}\"): change the "
                          "schedule or set virtual_stages 1")
    return cfg


_AUTOTP_REJECTED = {
    k: "it configures DeepSpeed's AutoTP injection into Hugging Face models; this engine's model is "
       "built tensor-parallel, so only autotp_size and sequence_parallel apply"
    for k in ("tp", "tensor_parallel", "dtype", "injection_policy_tuple",
              "keep_module_on_host", "replace_with_kernel_inject", "kernel_inject", "vocab_parallel_ce_backend")
}


def parse_tensor_parallel(top: Section) -> TensorParallelConfig:
    s = top.sub("tensor_parallel", _names(TensorParallelConfig), rejected=_AUTOTP_REJECTED, fixed={
        "tp_overlap_comm": (False, "overlapping TP all-reduces with compute is not implemented"),
        "vocab_parallel_lm_head": (False, "AutoTP keeps the embedding and LM head replicated (docs/autotp.md)"),
    })
    size = s.int("autotp_size", 1, min=0, auto_hint=" (the TP degree is a choice, not derivable)")
    # DeepSpeed: autotp_size 0 means "AutoTP disabled", i.e. TP degree 1.
    return TensorParallelConfig(autotp_size=max(size, 1),
                                sequence_parallel=s.bool("sequence_parallel", False),
                                partition_config=_parse_partition_config(s),
                                preset_model=s.optional_str("preset_model"))


def _parse_partition_config(tp: Section) -> AutoTPPartitionConfig:
    """``tensor_parallel.partition_config`` (DeepSpeed's AutoTP rules), validated here so a
    bad regex or partition type is a ConfigError at load time."""
    from engine.tensor_parallel.auto_rules import parse_layer_specs

    s = tp.sub("partition_config", _names(AutoTPPartitionConfig))
    raw = s.raw("layer_specs", [])
    if not isinstance(raw, list):
        raise s.error("layer_specs", "must be a list of {patterns, partition_type[, shape]} objects")
    try:
        parsed = parse_layer_specs(raw)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None

    def _tup(x: Any) -> Any:
        return tuple(_tup(v) for v in x) if isinstance(x, list) else x

    specs = tuple(AutoTPLayerSpecConfig(p.patterns, p.partition_type, _tup(r.get("shape")))
                  for p, r in zip(parsed, raw))
    return AutoTPPartitionConfig(use_default_specs=s.bool("use_default_specs", True), layer_specs=specs)


# ----------------------------------------------------------- checkpoint/data
def parse_checkpoint(top: Section) -> CheckpointConfig:
    s = top.sub("checkpoint", _names(CheckpointConfig) + ("parallel_write",), fixed={
        "load_universal": (False, "DeepSpeed's universal checkpoint format is not implemented; our "
                                  "checkpoints are keyed by topology coordinates and reshaped on load"),
        "use_node_local_storage": (False, "every rank writes its own shard to the checkpoint directory"),
    })
    if s.has("parallel_write") and s.raw("parallel_write") is not None:
        # DeepSpeed: write per pipeline stage in parallel. Here every rank writes its own shard
        # already, so it is validated and has no effect.
        s.sub("parallel_write", ("pipeline_stage",)).bool("pipeline_stage", False)
    d = CheckpointConfig()
    return CheckpointConfig(
        tag_validation=s.choice("tag_validation", ("Ignore", "Warn", "Fail"), d.tag_validation,
                                case_insensitive=True),
        save_interval=s.int("save_interval", d.save_interval, min=0),
        keep_last=s.int("keep_last", None, min=1, nullable=True),
        async_save=s.bool("async_save", d.async_save),
    )


def parse_data(top: Section) -> DataConfig:
    s = top.sub("data", _names(DataConfig))
    return DataConfig(
        train_files=s.str_list("train_files"),
        tokenizer_model=s.optional_str("tokenizer_model"),
        cache_dir=s.optional_str("cache_dir"),
        document_masking=s.bool("document_masking", False),
    )


def parse_model(top: Section) -> Optional[ModelConfig]:
    """The reference GPT's shape, or None without a ``model`` section (a DeepSpeed config for
    a caller's own module has none; what needs it says so when it is missing)."""
    if not top.has("model") or top.raw("model") is None:
        return None
    raw = top.raw("model")
    if isinstance(raw, dict):
        check_model_limits(raw)
    known = [f.name for f in fields(ModelConfig)]
    # Section checks unknown keys with a suggestion (ModelConfig.from_dict lists them without one).
    s = Section(raw, "model", known)
    required = [f.name for f in fields(ModelConfig) if f.default is MISSING and f.default_factory is MISSING]
    for name in required:
        if not s.has(name):
            raise ConfigError(f"model.{name} is required: add it to the model section")
    for name in known:
        if s.is_auto(name):
            raise ConfigError(f"model.{name} = \"auto\" cannot be resolved: set an explicit value")
    model = ModelConfig.from_dict(dict(raw))
    check_parameter_count(_parameters(model))
    return model


def _parameters(m: ModelConfig) -> int:
    """About the reference GPT's parameter count: embeddings, attention (q, k, v, o), MLP."""
    head = m.hidden_size // m.num_heads
    kv = (m.num_kv_heads or m.num_heads) * head
    attn = m.hidden_size * (2 * m.hidden_size + 2 * kv)
    mlp = 3 * m.hidden_size * (m.ffn_hidden_size or 4 * m.hidden_size)
    return m.num_layers * (attn + mlp) + m.vocab_size * m.hidden_size * (1 if m.tie_embeddings else 2)
