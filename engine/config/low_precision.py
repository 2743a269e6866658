"""DeepSpeed's low-precision options: ``bf16.bf16_master_weights_and_grads`` /
``bf16.bf16_optimizer_states`` (the ZeRO optimizer's master shard, its gradient shard and the
Adam moments in bf16) and the ``torch_autocast`` section, with DeepSpeed 0.19.8's validity
rules (runtime/config.py's asserts, ``ZeROOptimizer._configure_master_weights``) as one-line
config errors naming the key and the fix.

DeepSpeed's rules, mirrored:
- both bf16 keys need ZeRO stage 1, 2 or 3; ``bf16_optimizer_states`` needs
  ``bf16_master_weights_and_grads``;
- bf16 master weights with fp32 optimizer states (``bf16_optimizer_states`` false) need
  ZeRO-Offload with DeepSpeedCPUAdam (the fp32 moments live on the host): DeepSpeed asserts
  this at ``initialize`` (checked here on CPU: ``bf16_master_wg.json`` of its example fails
  with "Master weights feature requires ZeRO-3 Offload with DeepSpeedCPUAdam").
  With offload, the optimizer must be DeepSpeed's CPU Adam: the config's Adam/AdamW (here its
  fused CPU Adam), or a client ``DeepSpeedCPUAdam``; with ``bf16_optimizer_states`` a client one
  must have ``fp32_optimizer_states=False`` (engine.optim.build.check_bf16_master_client).
Stricter here: ``bf16.enabled`` must be true (DeepSpeed would keep bf16 masters of an fp32
model); the config's Adam with ``adam_w_mode`` false or ``torch_adam`` under offload (torch's
update on the host, not the CPU Adam kernel) is refused; so are, without offload, those two and
Lion: the engine's bf16-master update is FusedAdamW's (each element loaded to fp32, updated,
rounded once to bf16), while torch's Adam/AdamW and Lion would compute on the bf16 tensors
themselves, rounding every intermediate (refused rather than routed through FusedAdamW's L2
mode, which has no equivalence test against torch.optim.Adam over bf16 masters yet).
"""

from __future__ import annotations

from typing import Optional

from engine.config.reader import Section
from engine.config.schema import Config, TorchAutocastConfig
from engine.config.sections import DTYPE_NAMES
from engine.errors import ConfigError

__all__ = ["parse_torch_autocast", "check_low_precision_master", "AUTOCAST_DTYPES"]

# DeepSpeed's DtypeEnum spellings of the autocast dtypes (the 16-bit ones) -> this engine's names
AUTOCAST_DTYPES = {k: v for k, v in DTYPE_NAMES.items() if v != "fp32"}
_MASTER = "bf16.bf16_master_weights_and_grads"
_STATES = "bf16.bf16_optimizer_states"


def parse_torch_autocast(top: Section) -> TorchAutocastConfig:
    """``torch_autocast``: ``enabled`` (default false), ``dtype`` (required when enabled: without
    one DeepSpeed passes None to torch.autocast, the device's default, fp16 on CUDA and bf16 on
    CPU), ``lower_precision_safe_modules`` (a list of dotted class names)."""
    s = top.sub("torch_autocast", ("enabled", "dtype", "lower_precision_safe_modules"))
    enabled = s.bool("enabled", False)
    dtype: Optional[str] = None
    if s.raw("dtype") is not None:
        dtype = AUTOCAST_DTYPES[s.choice("dtype", tuple(AUTOCAST_DTYPES), case_insensitive=True)]
    modules = s.str_list("lower_precision_safe_modules")
    if enabled and dtype is None:
        raise ConfigError("torch_autocast.dtype is not set: DeepSpeed then takes the device's autocast default "
                          "(fp16 on CUDA, bf16 on CPU); set it to \"bfloat16\" or \"float16\"")
    if modules is not None:
        bad = [m for m in modules if "." not in m]
        if bad:
            raise ConfigError(f"torch_autocast.lower_precision_safe_modules: {bad[0]!r} is not a dotted class name; "
                              "write the module path and class, e.g. \"torch.nn.modules.linear.Linear\"")
    return TorchAutocastConfig(enabled=enabled, dtype=dtype, lower_precision_safe_modules=modules)


def check_low_precision_master(cfg: Config) -> None:
    """DeepSpeed's rules for the bf16 master keys (module docstring), and torch_autocast's
    combinations that are not implemented here."""
    b = cfg.bf16
    _check_autocast(cfg)
    if not (b.bf16_master_weights_and_grads or b.bf16_optimizer_states):
        return
    for key, on in ((_MASTER, b.bf16_master_weights_and_grads), (_STATES, b.bf16_optimizer_states)):
        if on and cfg.zero.stage not in (1, 2, 3):
            raise ConfigError(f"{key} = true needs ZeRO stage 1, 2 or 3 (the master state is the ZeRO optimizer's "
                              f"flat shard), but zero_optimization.stage is {cfg.zero.stage}: set the stage, or "
                              "set the key to false")
    if b.bf16_optimizer_states and not b.bf16_master_weights_and_grads:
        raise ConfigError(f"{_STATES} = true needs {_MASTER} = true (bf16 moments of fp32 master weights are not a "
                          f"DeepSpeed mode): set {_MASTER} to true, or {_STATES} to false")
    if not b.enabled:
        raise ConfigError(f"{_MASTER} = true needs bf16.enabled = true (the model trains in bf16 and its master "
                          "copy is kept in bf16): enable bf16, or set the key to false")
    offload = cfg.zero.offload_optimizer.enabled
    if not b.bf16_optimizer_states and not offload:
        raise ConfigError(f"{_MASTER} = true with {_STATES} = false keeps fp32 Adam moments, which DeepSpeed allows "
                          "only with ZeRO-Offload and DeepSpeedCPUAdam (it asserts \"Master weights feature requires "
                          f"ZeRO Offload with DeepSpeedCPUAdam\"): set {_STATES} to true (bf16 moments on the device), "
                          "or zero_optimization.offload_optimizer.device to \"cpu\"")
    opt = cfg.optimizer
    if opt is not None and opt.type == "Muon":
        raise ConfigError(f"{_MASTER} = true with optimizer.type \"Muon\" is not implemented (its Newton-Schulz "
                          "iterations run on the fp32 master matrices): use AdamW or Lion, or fp32 masters")
    if not offload and opt is not None and not _is_cpu_adam(cfg):
        # FusedAdamW updates bf16 masters per element in fp32 (DeepSpeed's kernel arithmetic);
        # torch's Adam/AdamW (ChunkedAdam/ChunkedAdamW) and Lion would compute in bf16 itself
        raise ConfigError(f"{_MASTER} = true with optimizer.type \"{opt.type}\""
                          f"{' with torch_adam' if _torch_adam(cfg) else ''}"
                          f"{' with adam_w_mode false' if _l2_adam(cfg) else ''} is not implemented (that update "
                          "would run in bf16 on the bf16 master, not in fp32 per element as DeepSpeed's): use "
                          "\"AdamW\" (adam_w_mode true, no torch_adam), or fp32 masters")
    if offload and opt is not None and not _is_cpu_adam(cfg):
        raise ConfigError(f"{_MASTER} = true with zero_optimization.offload_optimizer needs DeepSpeed's CPU Adam (it "
                          "asserts \"Master weights feature requires ZeRO Offload with DeepSpeedCPUAdam\"), but "
                          f"optimizer.type is \"{opt.type}\"{' with torch_adam' if _torch_adam(cfg) else ''}"
                          f"{' with adam_w_mode false' if _l2_adam(cfg) else ''}: use \"AdamW\" (adam_w_mode true, "
                          "no torch_adam), or turn offload off")


def _torch_adam(cfg: Config) -> bool:
    return bool(getattr(cfg.optimizer.params, "torch_adam", False)) if cfg.optimizer is not None else False


def _l2_adam(cfg: Config) -> bool:
    return cfg.optimizer is not None and getattr(cfg.optimizer.params, "adam_w_mode", True) is False


def _is_cpu_adam(cfg: Config) -> bool:
    """The config's optimizer is the one DeepSpeed runs as DeepSpeedCPUAdam under offload and the
    engine as its fused CPU Adam (engine.optim.FusedAdamW): Adam/AdamW in adam_w_mode without
    torch_adam (Adam with L2 decay runs torch's update here, not the fused kernel)."""
    return (cfg.optimizer is not None and cfg.optimizer.type in ("Adam", "AdamW")
            and not _torch_adam(cfg) and not _l2_adam(cfg))


def _check_autocast(cfg: Config) -> None:
    a = cfg.torch_autocast
    if not a.enabled:
        return
    if cfg.fp16.enabled:
        raise ConfigError("torch_autocast.enabled with fp16.enabled is not implemented: autocast's fp16 needs a "
                          "GradScaler, the fp16 section its own loss scaler; use one of them")
    if a.dtype == "fp16":
        raise ConfigError("torch_autocast.dtype \"float16\" is not implemented (DeepSpeed pairs it with a "
                          "torch.amp.GradScaler): use \"bfloat16\", or the fp16 section")
    if cfg.pipeline.stages > 1:
        raise ConfigError("torch_autocast.enabled with pipeline.stages > 1 is not implemented (the autocast region "
                          "is the engine's forward call); use the bf16 section for pipeline runs")
    if cfg.fp8.enabled:
        raise ConfigError("torch_autocast.enabled with fp8.enabled: the FP8 GEMMs choose their own input dtypes; "
                          "turn one of them off")
