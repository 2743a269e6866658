"""The resolved training configuration: nested frozen dataclasses.

Field names are the DeepSpeed JSON keys, so ``to_dict()`` writes the same schema back
(``Config.zero`` is the ``zero_optimization`` section). Every value here is resolved:
batch sizes filled in, ``"auto"`` replaced, defaults applied. Build one with
:func:`engine.config.load_config`; the constructors do no validation of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

from engine.models.config import ModelConfig
from engine.topology import Topology

__all__ = [
    "AdamParams", "LionParams", "MuonParams", "OptimizerConfig",
    "WarmupLRParams", "WarmupDecayLRParams", "WarmupCosineLRParams", "CosineParams", "WSDParams",
    "SchedulerParams", "SchedulerConfig",
    "FP16Config", "BF16Config", "TorchAutocastConfig", "FP8Config", "DataTypesConfig", "OffloadConfig", "ZeroConfig", "ActivationCheckpointingConfig",
    "PipelineConfig", "AutoTPLayerSpecConfig", "AutoTPPartitionConfig",
    "TensorParallelConfig", "ContextParallelConfig", "ExpertParallelConfig", "CheckpointConfig", "DataConfig", "Config",
]


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    if hasattr(v, "to_dict"):
        return v.to_dict()
    return v


class _Section:
    """``to_dict`` for a flat section: its fields, tuples written as JSON lists."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in fields(self)}  # type: ignore[arg-type]


# ---------------------------------------------------------------- optimizer
@dataclass(frozen=True)
class AdamParams(_Section):
    """``Adam`` / ``AdamW``. ``adam_w_mode``: decoupled weight decay (AdamW) when true,
    L2 regularisation added to the gradient (classic Adam) when false."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adam_w_mode: bool = True
    torch_adam: bool = False  # force the PyTorch reference implementation over the fused op


@dataclass(frozen=True)
class LionParams(_Section):
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0


@dataclass(frozen=True)
class MuonParams(_Section):
    """``Muon``: torch.optim.Muon for the 2-D hidden matrices, AdamW for the rest
    (:mod:`engine.optim.muon`). DeepSpeed's keys (``lr``, ``muon_lr``, ``adam_lr``,
    ``momentum``, ``weight_decay``, ``betas``, ``eps`` for the AdamW part) with its defaults;
    torch's Newton-Schulz keys (``nesterov``, ``ns_coefficients``, ``ns_steps``, ``ns_eps``
    = torch's ``eps``, ``adjust_lr_fn``) with torch's; ours: ``ns_dtype``,
    ``adam_weight_decay`` (default: ``weight_decay``), and name patterns that override the
    assignment rule (``muon_params`` / ``adam_params``)."""

    lr: float = 1e-3           # both parts, unless muon_lr / adam_lr
    muon_lr: Optional[float] = None
    adam_lr: Optional[float] = None
    momentum: float = 0.95
    weight_decay: float = 0.0
    adam_weight_decay: Optional[float] = None
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    nesterov: bool = True
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    ns_steps: int = 5
    ns_eps: float = 1e-7
    adjust_lr_fn: str = "original"
    ns_dtype: str = "bfloat16"
    muon_params: Optional[tuple[str, ...]] = None
    adam_params: Optional[tuple[str, ...]] = None


@dataclass(frozen=True)
class OptimizerConfig(_Section):
    type: str  # "Adam" | "AdamW" | "Lion" | "Muon"
    params: Union[AdamParams, LionParams, MuonParams]


# ---------------------------------------------------------------- scheduler
@dataclass(frozen=True)
class WarmupLRParams(_Section):
    """DeepSpeed ``WarmupLR``: warm up from ``warmup_min_lr`` to ``warmup_max_lr`` (absolute
    learning rates), then hold."""

    warmup_min_lr: float
    warmup_max_lr: float
    warmup_num_steps: int
    warmup_type: str  # "log" | "linear"


@dataclass(frozen=True)
class WarmupDecayLRParams(_Section):
    """DeepSpeed ``WarmupDecayLR``: ``WarmupLR`` then linear decay to 0 at ``total_num_steps``."""

    total_num_steps: int
    warmup_min_lr: float
    warmup_max_lr: float
    warmup_num_steps: int
    warmup_type: str


@dataclass(frozen=True)
class WarmupCosineLRParams(_Section):
    """DeepSpeed ``WarmupCosineLR``: ratios of the optimizer's lr; warm up from
    ``warmup_min_ratio`` to 1, cosine down to ``cos_min_ratio`` at ``total_num_steps``."""

    total_num_steps: int
    warmup_min_ratio: float
    warmup_num_steps: int
    cos_min_ratio: float
    warmup_type: str


@dataclass(frozen=True)
class CosineParams(_Section):
    """Ours, ``cosine``: linear warmup from 0 to the optimizer's lr, cosine down to
    ``min_lr_ratio * lr`` at ``total_num_steps``, then constant."""

    warmup_num_steps: int
    total_num_steps: int
    min_lr_ratio: float = 0.1
    warmup_type: str = "linear"


@dataclass(frozen=True)
class WSDParams(_Section):
    """Ours, ``WSD`` (warmup-stable-decay): linear warmup, constant lr, then decay over the
    last ``decay_num_steps`` of ``total_num_steps`` to ``min_lr_ratio * lr``."""

    warmup_num_steps: int
    total_num_steps: int
    decay_num_steps: int
    min_lr_ratio: float = 0.0
    decay_type: str = "linear"  # "linear" | "cosine" | "sqrt"


SchedulerParams = Union[WarmupLRParams, WarmupDecayLRParams, WarmupCosineLRParams, CosineParams, WSDParams]


@dataclass(frozen=True)
class SchedulerConfig(_Section):
    type: str  # "WarmupLR" | "WarmupDecayLR" | "WarmupCosineLR" | "cosine" | "WSD"
    params: SchedulerParams


# ---------------------------------------------------------------- precision
@dataclass(frozen=True)
class FP16Config(_Section):
    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = 0.0  # 0: dynamic loss scaling; > 0: this static scale
    initial_scale_power: int = 16  # dynamic scaling starts at 2**initial_scale_power
    loss_scale_window: int = 1000  # overflow-free steps before the scale is doubled
    hysteresis: int = 2  # overflows tolerated before the scale is halved
    consecutive_hysteresis: bool = False  # refill hysteresis after an overflow-free step
    min_loss_scale: float = 1.0


@dataclass(frozen=True)
class BF16Config(_Section):
    enabled: bool = False
    check_grad_overflow: bool = True  # skip (and count) steps whose gradients hold inf/NaN
    # DeepSpeed's low-precision master state (ZeRO 1-3, engine.config.low_precision): the
    # optimizer's flat master shard and its gradient shard in bf16; the Adam moments too
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False


@dataclass(frozen=True)
class TorchAutocastConfig(_Section):
    """DeepSpeed's ``torch_autocast``: the engine's forward runs under ``torch.autocast`` in
    ``dtype`` ("bf16" / "fp16"; DeepSpeed's DtypeEnum spellings are accepted);
    ``lower_precision_safe_modules``: dotted class names whose parameters DeepSpeed reduces
    in ``dtype`` (None: its default, Linear and Conv1d/2d/3d)."""

    enabled: bool = False
    dtype: Optional[str] = None
    lower_precision_safe_modules: Optional[tuple[str, ...]] = None


@dataclass(frozen=True)
class FP8Config(_Section):
    enabled: bool = False
    recipe: str = "delayed"  # "delayed" (scale from the amax history) | "current" (this step's amax)
    format: str = "hybrid"  # "hybrid": E4M3 forward, E5M2 gradients | "e4m3": E4M3 everywhere
    amax_history_len: int = 16
    amax_compute_algo: str = "max"  # "max" of the history | "most_recent"
    margin: int = 0  # scale = 2**-margin * fp8_max / amax


@dataclass(frozen=True)
class DataTypesConfig(_Section):
    """``data_types`` (DeepSpeed's section). ``grad_accum_dtype``: ``"fp32"`` | ``"bf16"`` |
    ``"fp16"``, the dtype of ZeRO-1's full gradient accumulated over micro-batches; None (the
    default): the compute dtype, as DeepSpeed (:class:`engine.precision.mixed.PrecisionPolicy`)."""

    grad_accum_dtype: Optional[str] = None


# --------------------------------------------------------------------- ZeRO
@dataclass(frozen=True)
class OffloadConfig(_Section):
    """``zero_optimization.offload_optimizer`` / ``offload_param`` (DeepSpeed's names and
    defaults). ``device``: "none" (off) or "cpu"; ``pin_memory``: page-locked host buffers
    (when CUDA is present; a no-op on a CPU-only run). DeepSpeed's NVMe-only keys are
    validated by the loader and not stored (docs/config.md)."""

    device: str = "none"  # "none" | "cpu"
    pin_memory: bool = False

    @property
    def enabled(self) -> bool:
        return self.device != "none"


@dataclass(frozen=True)
class ZeroConfig(_Section):
    """``zero_optimization``. Sizes are element counts, as in DeepSpeed. docs/config.md says
    which keys change behaviour here and which are accepted no-ops."""

    stage: int = 0
    overlap_comm: bool = False  # DeepSpeed's default: true for stage 3, false otherwise
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_partitions: bool = True
    allgather_bucket_size: int = 500_000_000
    use_multi_rank_bucket_allreduce: bool = True
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_model_persistence_threshold: int = 9223372036854775807  # sys.maxsize, as DeepSpeed
    stage3_max_live_parameters: int = 1_000_000_000
    # ours: 0 (release after every use); DeepSpeed's 1e9 keeps a model of fewer elements
    # gathered from its forward to its backward (docs/config.md)
    stage3_max_reuse_distance: int = 0
    stage3_gather_16bit_weights_on_model_save: bool = False
    stage3_module_granularity_threshold: int = 0
    stage3_use_all_reduce_for_fetch_params: bool = False
    stage3_allgather_sequential: bool = False
    sub_group_size: int = 1_000_000_000
    round_robin_gradients: bool = False
    elastic_checkpoint: bool = False
    load_from_fp32_weights: bool = True
    ignore_unused_parameters: bool = True
    compute_grad_norm: bool = True
    parameter_alignment: bool = False
    memory_efficient_linear: bool = True
    override_module_apply: bool = True
    pipeline_loading_checkpoint: bool = False
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    offload_optimizer: OffloadConfig = OffloadConfig()  # stages 1-3: master shard and moments on the host
    offload_param: OffloadConfig = OffloadConfig()  # stage 3: parameter shards on the host

    def to_dict(self) -> dict[str, Any]:
        """The section as DeepSpeed writes it: an offload section that is off is null (its
        default), not ``{"device": "none", ...}``."""
        d = super().to_dict()
        for key in ("offload_optimizer", "offload_param"):
            if not getattr(self, key).enabled:
                d[key] = None
        return d


# ------------------------------------------------------------ parallelism
@dataclass(frozen=True)
class ActivationCheckpointingConfig(_Section):
    granularity: str = "none"  # "none" | "selective" | "full" (engine.models.recompute)
    modules: Optional[tuple[str, ...]] = None  # selective: parts recomputed; None = DEFAULT_SELECTIVE
    method: str = "uniform"  # full: "uniform" (runs of num_layers) | "block" (first num_layers per stage)
    num_layers: int = 1
    cpu_checkpointing: bool = False
    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: Optional[int] = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


@dataclass(frozen=True)
class PipelineConfig(_Section):
    stages: int = 1
    partition: str = "parameters"  # "parameters" | "uniform" | "blocks": sections.PARTITION_METHODS
    activation_checkpoint_interval: int = 0  # checkpoint every N layers; 0 = off
    schedule: str = "1f1b"  # "1f1b" | "gpipe" | "interleaved-1f1b" | "zb-h1" | "zb-v" | "dualpipe-v"
    virtual_stages: int = 1  # model chunks per rank (interleaved-1f1b; exactly 2 with zb-v, dualpipe-v)
    seed_layers: bool = False
    pipe_partitioned: bool = True
    grad_partitioned: bool = True


@dataclass(frozen=True)
class AutoTPLayerSpecConfig(_Section):
    """One entry of ``tensor_parallel.partition_config.layer_specs`` (DeepSpeed's names)."""

    patterns: tuple[str, ...]
    partition_type: str = "column"  # "column" | "row" | "skip" (alias "replicate")
    shape: Optional[tuple[Any, ...]] = None  # fused parts along the output dim: [k, -1] or [[a, b, c], -1]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"patterns": list(self.patterns), "partition_type": self.partition_type}
        if self.shape is not None:
            d["shape"] = _jsonable(self.shape)
        return d


@dataclass(frozen=True)
class AutoTPPartitionConfig(_Section):
    """``tensor_parallel.partition_config``: AutoTP layer rules for Hugging Face models
    (docs/autotp.md). User specs are matched before the family's built-in ones."""

    use_default_specs: bool = True
    layer_specs: tuple[AutoTPLayerSpecConfig, ...] = ()


@dataclass(frozen=True)
class TensorParallelConfig(_Section):
    autotp_size: int = 1  # the TP degree
    sequence_parallel: bool = False
    partition_config: AutoTPPartitionConfig = AutoTPPartitionConfig()
    preset_model: Optional[str] = None  # AutoTP rule family; None: from the model's config.model_type


@dataclass(frozen=True)
class ContextParallelConfig(_Section):
    """``context_parallel`` (docs/context_parallel.md): the sequence of every micro-batch split
    over ``size`` ranks. ``mode``: ``"ring"`` (K/V blocks passed around), ``"ulysses"``
    (all-to-all to heads) or ``"hybrid"`` (Ulysses within groups of ``ulysses_size``, ring
    across them). ``ulysses_size``: 1 for ring, ``size`` for Ulysses."""

    size: int = 1
    mode: str = "ring"
    ulysses_size: int = 1


@dataclass(frozen=True)
class ExpertParallelConfig(_Section):
    """``expert_parallel`` (docs/expert_parallel.md): the experts of every mixture-of-experts
    layer split over ``size`` ranks carved out of the data x context ranks
    (:meth:`engine.topology.Topology.expert_mesh`); 1: every rank holds every expert."""

    size: int = 1


@dataclass(frozen=True)
class CheckpointConfig(_Section):
    tag_validation: str = "Warn"  # "Ignore" | "Warn" | "Fail"
    save_interval: int = 0  # save every N optimizer steps; 0 = never
    keep_last: Optional[int] = None  # keep the newest N checkpoints; None = keep all
    async_save: bool = False  # snapshot at the call, write in a background thread (docs/checkpoints.md)


@dataclass(frozen=True)
class DataConfig(_Section):
    train_files: Optional[tuple[str, ...]] = None  # None: the embedded default corpus
    tokenizer_model: Optional[str] = None  # None: train a sentencepiece model on the data
    cache_dir: Optional[str] = None  # None: the data module's default cache location
    document_masking: bool = False  # attention does not cross document boundaries


# ---------------------------------------------------------------- monitors
@dataclass(frozen=True)
class TensorBoardConfig(_Section):
    """DeepSpeed's ``tensorboard``: events in ``output_path/job_name`` (relative to the
    working directory when ``output_path`` is empty, as DeepSpeed)."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


@dataclass(frozen=True)
class CSVMonitorConfig(_Section):
    """DeepSpeed's ``csv_monitor``: one ``<tag with / as _>.csv`` per scalar in ``output_path/job_name``."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


@dataclass(frozen=True)
class WandbConfig(_Section):
    """DeepSpeed's ``wandb``: ``wandb.init(project=, group=, entity=team)`` on rank 0."""

    enabled: bool = False
    group: Optional[str] = None
    team: Optional[str] = None
    project: str = "deepspeed"


@dataclass(frozen=True)
class MonitorConfig:
    tensorboard: TensorBoardConfig = TensorBoardConfig()
    csv_monitor: CSVMonitorConfig = CSVMonitorConfig()
    wandb: WandbConfig = WandbConfig()

    @property
    def enabled(self) -> bool:
        return self.tensorboard.enabled or self.csv_monitor.enabled or self.wandb.enabled

    def to_dict(self) -> dict[str, Any]:
        """Only the enabled sections (a disabled one is the same as none)."""
        return {k: getattr(self, k).to_dict() for k in ("tensorboard", "csv_monitor", "wandb")
                if getattr(self, k).enabled}


# ---------------------------------------------------------------------- all
@dataclass(frozen=True)
class Config:
    """A fully resolved run configuration. ``load_config(c.to_dict(), world_size=c.world_size) == c``."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    topology: Topology
    model: Optional[ModelConfig]  # None: no "model" section (the caller passes its own module)
    optimizer: Optional[OptimizerConfig]  # None: no "optimizer" section (a client optimizer)
    scheduler: Optional[SchedulerConfig]
    data: DataConfig = DataConfig()
    fp16: FP16Config = FP16Config()
    bf16: BF16Config = BF16Config()
    torch_autocast: TorchAutocastConfig = TorchAutocastConfig()
    fp8: FP8Config = FP8Config()
    data_types: DataTypesConfig = DataTypesConfig()
    zero: ZeroConfig = ZeroConfig()
    activation_checkpointing: ActivationCheckpointingConfig = ActivationCheckpointingConfig()
    pipeline: PipelineConfig = PipelineConfig()
    tensor_parallel: TensorParallelConfig = TensorParallelConfig()
    context_parallel: ContextParallelConfig = ContextParallelConfig()
    expert_parallel: ExpertParallelConfig = ExpertParallelConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    monitor: MonitorConfig = MonitorConfig()
    gradient_clipping: float = 1.0  # max global grad norm; 0 = no clipping
    steps_per_print: Optional[int] = 10  # None: never
    wall_clock_breakdown: bool = False
    # DeepSpeed's: initialize(training_data=)'s loader drops the last short micro-batch
    dataloader_drop_last: bool = False
    # DeepSpeed's meaning: with offload_optimizer, a client optimizer must be its CPU Adam
    # (engine.compat.deepspeed.ops.adam.DeepSpeedCPUAdam); false lets any optimizer step on the host
    zero_force_ds_cpu_optimizer: bool = True
    seed: int = 1234
    # DeepSpeed's communication_data_type: the dtype of the ZeRO gradient reductions (0-3).
    # "fp32" (default here; DeepSpeed's default is the compute dtype), "bf16" or "fp16"
    communication_data_type: str = "fp32"
    # launch/train.py stops (exit 1) after this many optimizer steps in a row whose loss or global
    # gradient norm is non-finite (each one skipped); 0: never stop (docs/config.md)
    max_consecutive_nonfinite_steps: int = 20
    # keys of engine.config.ignored.IGNORED_KEYS this config set: accepted, no effect; not
    # part of the config's value (not compared, not written by to_dict)
    ignored_keys: tuple[str, ...] = field(default=(), compare=False, repr=False)

    @property
    def dp(self) -> int:
        return self.topology.dp

    @property
    def cp(self) -> int:
        """The context-parallel degree (``context_parallel.size``)."""
        return self.topology.cp

    @property
    def ep(self) -> int:
        """The expert-parallel degree (``expert_parallel.size``)."""
        return self.expert_parallel.size

    @property
    def tp(self) -> int:
        return self.topology.tp

    @property
    def pp(self) -> int:
        return self.topology.pp

    @property
    def world_size(self) -> int:
        return self.topology.world_size  # type: ignore[return-value]

    @property
    def precision(self) -> str:
        """``"fp16"``, ``"bf16"`` or ``"fp32"``: the dtype of the model's compute and its gradients."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    def get(self, key: str, default: Any = None) -> Any:
        """``key`` of :meth:`to_dict` (DeepSpeed's JSON schema), or ``default``. DeepSpeed's
        ``engine.config`` is the user's config dict and libraries read it as one (HF Trainer's
        ``save_model``: ``engine.config.get("zero_optimization", {}).get("stage")``)."""
        return self.to_dict().get(key, default)

    def to_dict(self) -> dict[str, Any]:
        """The resolved config in DeepSpeed's JSON schema (JSON types only)."""
        d: dict[str, Any] = {
            "train_batch_size": self.train_batch_size,
            "train_micro_batch_size_per_gpu": self.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "steps_per_print": self.steps_per_print,
            "wall_clock_breakdown": self.wall_clock_breakdown,
            "dataloader_drop_last": self.dataloader_drop_last,
            "zero_force_ds_cpu_optimizer": self.zero_force_ds_cpu_optimizer,
            "seed": self.seed,
            "gradient_clipping": self.gradient_clipping,
            "communication_data_type": self.communication_data_type,
            "max_consecutive_nonfinite_steps": self.max_consecutive_nonfinite_steps,
        }
        if self.optimizer is not None:
            d["optimizer"] = self.optimizer.to_dict()
        if self.scheduler is not None:
            d["scheduler"] = self.scheduler.to_dict()
        d.update({
            "fp16": self.fp16.to_dict(),
            "bf16": self.bf16.to_dict(),
            "torch_autocast": self.torch_autocast.to_dict(),
            "fp8": self.fp8.to_dict(),
            "data_types": self.data_types.to_dict(),
            "zero_optimization": self.zero.to_dict(),
            "activation_checkpointing": self.activation_checkpointing.to_dict(),
            "pipeline": self.pipeline.to_dict(),
            "tensor_parallel": self.tensor_parallel.to_dict(),
            "context_parallel": self.context_parallel.to_dict(),
            "expert_parallel": self.expert_parallel.to_dict(),
            "checkpoint": self.checkpoint.to_dict(),
            "data": self.data.to_dict(),
        })
        d.update(self.monitor.to_dict())
        if self.model is not None:
            d["model"] = self.model.to_dict()
        return d
