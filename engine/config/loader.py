"""``load_config``: DeepSpeed-format JSON (a path or a dict) -> a validated, resolved :class:`Config`.

Stricter than DeepSpeed: an unknown key anywhere is an error with a suggestion, types are
checked (``true`` is not ``1``, ``"8"`` is not ``8``), and inconsistent settings are errors
that name the key path and the fix. Pure: no device, environment or process-group access,
so every rank (and a CLI on a laptop) resolves the same config.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Union

from engine.config.context_parallel import check_context_parallel, parse_context_parallel
from engine.config.expert_parallel import check_expert_parallel, parse_expert_parallel
from engine.config.ignored import IGNORED_KEYS, ignored_keys_in
from engine.config.limits import check_batch_limits
from engine.config.low_precision import check_low_precision_master, parse_torch_autocast
from engine.config.monitor import parse_monitor
from engine.config.optim import parse_optimizer, parse_scheduler
from engine.config.reader import Section, read_json_file
from engine.config.schema import Config, PipelineConfig
from engine.config.sections import (
    parse_activation_checkpointing,
    parse_bf16,
    parse_checkpoint,
    parse_data,
    parse_data_types,
    parse_fp8,
    parse_fp16,
    parse_model,
    parse_pipeline,
    parse_tensor_parallel,
    parse_zero,
)
from engine.errors import ConfigError
from engine.models.config import ModelConfig
from engine.topology import Topology
from engine.validate import check_int

__all__ = ["load_config", "resolve_batch_sizes"]

_TOP_LEVEL = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "optimizer", "scheduler", "fp16", "bf16", "fp8", "data_types", "gradient_clipping", "zero_optimization",
    "steps_per_print", "wall_clock_breakdown", "activation_checkpointing", "pipeline", "tensor_parallel",
    "seed", "checkpoint", "model", "data", "tensorboard", "csv_monitor", "wandb", "communication_data_type",
    "zero_force_ds_cpu_optimizer", "max_consecutive_nonfinite_steps", "context_parallel", "sequence_parallel_size",
    "data_parallel_size", "torch_autocast", "dataloader_drop_last", "expert_parallel",
)
_NOT_IMPLEMENTED = "not implemented in this engine: remove the section"
_TOP_LEVEL_REJECTED = {
    "amp": "NVIDIA Apex AMP is replaced by the bf16 / fp16 sections: use those instead",
    "bfloat16": "DeepSpeed renamed this section: use \"bf16\"",
    "elasticity": "elastic training is " + _NOT_IMPLEMENTED,
    "autotuning": "the autotuner is " + _NOT_IMPLEMENTED,
    "flops_profiler": "the flops profiler is " + _NOT_IMPLEMENTED + " (the engine logs tokens/s and MFU)",
    "comet": "monitoring backends are " + _NOT_IMPLEMENTED + " (metrics go to the log)",
    "comms_logger": "the communication logger is " + _NOT_IMPLEMENTED,
    "compression_training": "compression is " + _NOT_IMPLEMENTED,
    "data_efficiency": "data-efficiency pipelines are " + _NOT_IMPLEMENTED,
    "curriculum_learning": "curriculum learning is " + _NOT_IMPLEMENTED,
    "sparse_attention": "sparse attention is " + _NOT_IMPLEMENTED,
    "aio": "asynchronous NVMe I/O (for offload) is " + _NOT_IMPLEMENTED,
    "nebula": "Nebula checkpointing is " + _NOT_IMPLEMENTED,
    "hybrid_engine": "the RLHF hybrid engine is " + _NOT_IMPLEMENTED,
    "compile": "torch.compile integration is " + _NOT_IMPLEMENTED,
    "weight_quantization": "weight quantization is " + _NOT_IMPLEMENTED,
}
_TOP_LEVEL_FIXED = {
    "prescale_gradients": (False, "gradients are averaged once, after the reduction"),
    "gradient_predivide_factor": (1.0, "gradients are averaged once, after the reduction"),
    "sparse_gradients": (False, "the model has no sparse (embedding-bag) gradients"),
    "disable_allgather": (False, "ZeRO always all-gathers updated parameters"),
    "memory_breakdown": (False, "memory is reported by the engine's metrics"),
    "dump_state": (False, "state dumping is not implemented"),
}
# Switches that only matter for DeepSpeed's client / CPU optimizers: accepted, no effect here.
_TOP_LEVEL_IGNORED = tuple(k for k in IGNORED_KEYS if "." not in k)

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _steps_per_print(top: Section) -> Optional[int]:
    """``steps_per_print``: a positive integer, or null / positive infinity for never. accelerate
    (and so Hugging Face's Trainer) sets ``float("inf")`` to keep DeepSpeed from printing."""
    if top.raw("steps_per_print") == float("inf"):
        return None
    return top.int("steps_per_print", 10, min=1, nullable=True)


def load_config(path_or_dict: Union[str, "os.PathLike[str]", Mapping[str, Any]], *, world_size: int) -> Config:
    """Load and validate a config for a run of ``world_size`` ranks.

    ``path_or_dict``: a JSON file path, or the already-parsed object. Raises
    :class:`~engine.errors.ConfigError` on every problem, naming the key and the fix.
    """
    check_int("world_size", world_size, minimum=1, fix="pass the number of launched ranks")
    if isinstance(path_or_dict, Mapping):
        raw: Any = dict(path_or_dict)
    elif isinstance(path_or_dict, (str, os.PathLike)):
        raw = read_json_file(path_or_dict)
    else:
        raise ConfigError(f"load_config takes a JSON file path or a dict, got {type(path_or_dict).__name__}")
    top = Section(raw, "", _TOP_LEVEL, rejected=_TOP_LEVEL_REJECTED, fixed=_TOP_LEVEL_FIXED,
                  ignored_bools=_TOP_LEVEL_IGNORED)

    check_batch_limits({k: top.raw(k) for k in _BATCH_KEYS})
    model = parse_model(top)
    tensor_parallel = parse_tensor_parallel(top)
    pipeline = parse_pipeline(top)
    context_parallel = parse_context_parallel(top)
    topology = _topology(world_size, tensor_parallel.autotp_size, pipeline.stages, context_parallel.size)
    _check_data_parallel_size(top, topology)
    if model is not None:
        model.check_parallel(topology.tp, topology.pp)
    check_context_parallel(context_parallel, model, topology.tp, tensor_parallel.sequence_parallel)
    expert_parallel = parse_expert_parallel(top)
    check_expert_parallel(expert_parallel, topology, model)
    micro, gas, total = resolve_batch_sizes(top.raw("train_batch_size"), top.raw("train_micro_batch_size_per_gpu"),
                                            top.raw("gradient_accumulation_steps"), topology)
    optimizer = parse_optimizer(top)
    cfg = Config(
        train_batch_size=total,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=gas,
        topology=topology,
        model=model,
        optimizer=optimizer,
        scheduler=parse_scheduler(top, None if optimizer is None else optimizer.params.lr),
        data=parse_data(top),
        fp16=parse_fp16(top),
        bf16=parse_bf16(top),
        torch_autocast=parse_torch_autocast(top),
        fp8=parse_fp8(top),
        data_types=parse_data_types(top),
        zero=parse_zero(top, None if model is None else model.hidden_size),
        activation_checkpointing=parse_activation_checkpointing(top),
        pipeline=pipeline,
        tensor_parallel=tensor_parallel,
        context_parallel=context_parallel,
        expert_parallel=expert_parallel,
        checkpoint=parse_checkpoint(top),
        monitor=parse_monitor(top),
        gradient_clipping=top.number("gradient_clipping", 1.0, min=0.0,
                                     auto_hint=" (the Hugging Face Trainer fills it from max_grad_norm)"),
        steps_per_print=_steps_per_print(top),
        wall_clock_breakdown=top.bool("wall_clock_breakdown", False),
        dataloader_drop_last=top.bool("dataloader_drop_last", False),
        zero_force_ds_cpu_optimizer=top.bool("zero_force_ds_cpu_optimizer", True),
        seed=top.int("seed", 1234, min=0, max=2**63 - 1),
        communication_data_type=_communication_data_type(top),
        max_consecutive_nonfinite_steps=top.int("max_consecutive_nonfinite_steps", 20, min=0, max=2**31 - 1),
        ignored_keys=ignored_keys_in(raw),
    )
    _check_cross_section(cfg)
    return cfg


COMMUNICATION_DATA_TYPES = ("fp32", "bf16", "fp16")


def _communication_data_type(top: Section) -> str:
    """DeepSpeed's ``communication_data_type`` (case-insensitive, null = unset): the dtype of
    the ZeRO gradient reductions. Unset means fp32 here (exact reductions), where DeepSpeed
    reduces in the compute dtype."""
    if top.raw("communication_data_type") is None:
        return "fp32"
    return top.choice("communication_data_type", COMMUNICATION_DATA_TYPES, case_insensitive=True)


def _topology(world_size: int, tp: int, pp: int, cp: int) -> Topology:
    if world_size % (tp * pp * cp):
        raise ConfigError(
            f"world size {world_size} is not divisible by tensor_parallel.autotp_size ({tp}) * pipeline.stages "
            f"({pp}) * context_parallel.size (or sequence_parallel_size) ({cp}) = {tp * pp * cp}: launch a "
            f"multiple of {tp * pp * cp} ranks, or change the degrees")
    return Topology(dp=world_size // (tp * pp * cp), tp=tp, pp=pp, cp=cp, world_size=world_size)


def _check_data_parallel_size(top: Section, topology: Topology) -> None:
    """DeepSpeed's ``data_parallel_size`` (the data-parallel axis of its (dp, sp) mesh): the
    engine derives that size from the world and the other degrees, so the key, when given,
    must agree with it."""
    dp = top.int("data_parallel_size", None, min=1, nullable=True)
    if dp is not None and dp != topology.dp:
        cp = f" / context_parallel.size (or sequence_parallel_size) {topology.cp}" if topology.cp > 1 else ""
        raise ConfigError(f"data_parallel_size = {dp} but the data-parallel size is {topology.dp} = world size "
                          f"{topology.world_size} / (tensor_parallel.autotp_size {topology.tp} * pipeline.stages "
                          f"{topology.pp}){cp}: set it to {topology.dp}, or remove it (it is derived)")


def _batch_value(name: str, v: Any) -> Optional[int]:
    """A batch key's value: ``None`` when absent, null or ``"auto"`` (resolved from the others)."""
    if v is None or v == "auto":
        return None
    return check_int(name, v, minimum=1, allow_float=True,
                     fix="set it, or \"auto\" to derive it from the other batch sizes")


def resolve_batch_sizes(train_batch: Any, micro: Any, gas: Any, topology: Topology) -> tuple[int, int, int]:
    """DeepSpeed's rule ``train_batch_size = micro * gas * dp`` with dp the DATA-parallel size.

    Any two determine the third; ``train_batch_size`` alone or the micro batch alone resolve
    with ``gradient_accumulation_steps = 1``; ``gradient_accumulation_steps`` alone is not
    enough. Returns ``(micro, gas, train_batch_size)``.
    """
    tb, mb, ga = (_batch_value(k, v) for k, v in zip(_BATCH_KEYS, (train_batch, micro, gas)))
    dp = topology.dp
    cp = f" * context_parallel.size {topology.cp}" if topology.cp > 1 else ""
    mesh = (f"data-parallel size {dp} = world size {topology.world_size} / (tensor_parallel.autotp_size "
            f"{topology.tp} * pipeline.stages {topology.pp}{cp})")

    def mismatch(what: str) -> ConfigError:
        return ConfigError(
            f"{what}: train_batch_size ({_or_unset(tb)}) must equal train_micro_batch_size_per_gpu ({_or_unset(mb)}) * "
            f"gradient_accumulation_steps ({_or_unset(ga)}) * {mesh}. Fix: set two of the three batch keys and "
            "let the third be derived, or make the product match")

    if tb is None and mb is None:
        raise ConfigError("train_batch_size or train_micro_batch_size_per_gpu must be set (DeepSpeed needs one of "
                          f"them; gradient_accumulation_steps alone does not fix the batch); {mesh}")
    if tb is not None and mb is not None and ga is not None:
        if tb != mb * ga * dp:
            raise mismatch(f"inconsistent batch sizes ({mb} * {ga} * {dp} = {mb * ga * dp} != {tb})")
    elif tb is not None and mb is not None:
        if tb % (mb * dp):
            raise mismatch(f"train_batch_size {tb} is not divisible by micro batch {mb} * data-parallel size {dp}")
        ga = tb // (mb * dp)
    elif tb is not None:
        ga = 1 if ga is None else ga
        if tb % (ga * dp):
            raise mismatch(f"train_batch_size {tb} is not divisible by gradient_accumulation_steps {ga} * "
                           f"data-parallel size {dp}")
        mb = tb // (ga * dp)
    else:
        assert mb is not None  # tb and mb both None raised above
        ga = 1 if ga is None else ga
        tb = mb * ga * dp
    return mb, ga, tb


def _or_unset(v: Optional[int]) -> str:
    return "unset" if v is None else str(v)


def _check_cross_section(cfg: Config) -> None:
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError("fp16.enabled and bf16.enabled are both true: choose one precision (bf16 on "
                          "A100/H100, fp16 on older GPUs) and set the other to false")
    if cfg.fp8.enabled and not cfg.bf16.enabled:
        raise ConfigError("fp8.enabled needs bf16.enabled true: the FP8 GEMMs take bf16 inputs and every "
                          "other op runs in bf16 (fp16 loss scaling is not combined with FP8 scaling)")
    if cfg.zero.offload_optimizer.enabled and cfg.optimizer is not None and cfg.optimizer.type == "Muon":
        raise ConfigError("zero_optimization.offload_optimizer with optimizer.type \"Muon\" is not implemented: Muon's "
                          "Newton-Schulz iterations run on whole matrices gathered across the DP shards on the "
                          "accelerator, not on the host; use AdamW or Lion with offload, or set the device to \"none\"")
    check_low_precision_master(cfg)
    accum = cfg.data_types.grad_accum_dtype
    if accum not in (None, "fp32", cfg.precision):
        allowed = "\"fp32\"" + ("" if cfg.precision == "fp32" else f" or \"{cfg.precision}\"")
        raise ConfigError(f"data_types.grad_accum_dtype is \"{accum}\" but the model computes in {cfg.precision}: "
                          f"gradients accumulate in fp32 or in the compute dtype; set it to {allowed}, or remove "
                          "it (the default follows the compute dtype, as DeepSpeed)")
    if cfg.model is None:
        return  # the checks below are about the reference GPT's shape
    _check_pipeline_schedule(cfg.pipeline, cfg.model, cfg.gradient_accumulation_steps)
    if cfg.model.moe is not None and cfg.fp16.enabled:
        raise ConfigError("model.moe with fp16.enabled: the MoE balancing loss is injected in backward scaled "
                          "like the loss without fp16's dynamic loss scale; train MoE models in bf16 or fp32")
    _check_recompute(cfg)
    if cfg.tensor_parallel.sequence_parallel and cfg.model.seq_len % cfg.tp:
        raise ConfigError(f"tensor_parallel.sequence_parallel splits the sequence over the {cfg.tp} TP ranks, "
                          f"but model.seq_len = {cfg.model.seq_len} is not divisible by {cfg.tp}: change seq_len "
                          "or turn sequence_parallel off")


def _check_recompute(cfg: Config) -> None:
    ac = cfg.activation_checkpointing
    if cfg.pipeline.activation_checkpoint_interval and ac.granularity != "none":
        raise ConfigError(f"pipeline.activation_checkpoint_interval ({cfg.pipeline.activation_checkpoint_interval}) "
                          f"and activation_checkpointing.granularity (\"{ac.granularity}\") both choose what to "
                          "recompute: keep one (the interval N equals granularity \"full\", method \"uniform\", "
                          "num_layers N)")
    full = ac.granularity == "full" or cfg.pipeline.activation_checkpoint_interval > 0
    if ac.partition_activations and not full:
        raise ConfigError("activation_checkpointing.partition_activations shards the inputs of fully recomputed "
                          "blocks over TP, but nothing is fully recomputed: set granularity \"full\" (or "
                          "pipeline.activation_checkpoint_interval), or partition_activations false")
    if ac.partition_activations and cfg.tensor_parallel.sequence_parallel and cfg.tp > 1:
        raise ConfigError("activation_checkpointing.partition_activations with tensor_parallel.sequence_parallel: "
                          "the block inputs are already split over the TP ranks (B, S/tp, H), each rank's "
                          "different; set partition_activations false (sequence parallelism saves the same bytes)")


def _check_pipeline_schedule(p: PipelineConfig, model: ModelConfig, microbatches: int) -> None:
    if p.schedule != "interleaved-1f1b":
        return
    chunks = p.stages * p.virtual_stages
    if model.num_layers % chunks:
        raise ConfigError(f"pipeline.schedule \"interleaved-1f1b\" splits the model into pipeline.stages * "
                          f"pipeline.virtual_stages = {p.stages} * {p.virtual_stages} = {chunks} chunks, but "
                          f"model.num_layers = {model.num_layers} is not divisible by {chunks}: change "
                          "virtual_stages or num_layers")
    if microbatches % p.stages:
        raise ConfigError(f"pipeline.schedule \"interleaved-1f1b\" needs gradient_accumulation_steps (the number "
                          f"of microbatches, {microbatches}) divisible by pipeline.stages ({p.stages}): change "
                          "the batch sizes or the schedule")
