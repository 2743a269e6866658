"""DeepSpeed names and modules this engine does not implement, refused with the reason.

A DeepSpeed script (or a library such as transformers) often imports more than it uses, so
an unsupported *name* imports fine and fails when used: :func:`unsupported` makes a class
whose construction or call raises :class:`UnsupportedFeatureError` naming the feature and
why (``isinstance(x, it)`` is simply ``False``; subclassing it works, instantiating the
subclass raises). An unsupported *module* fails at import with
:class:`UnsupportedModuleError` (a ``ModuleNotFoundError``, so ``try: import ... except
ImportError`` guards in libraries keep working) carrying the reason:
:data:`UNSUPPORTED_MODULES` lists them, relative to the package (``"inference"`` is
``deepspeed.inference``); the import finder in :mod:`engine.compat.deepspeed._alias`
raises it for ``deepspeed.<name>`` and ``engine.compat.deepspeed.<name>`` alike.
"""

from __future__ import annotations

from typing import Any, Mapping, NoReturn, Optional

__all__ = ["UnsupportedFeatureError", "UnsupportedModuleError", "UnsupportedAttributeError", "unsupported",
           "is_unsupported", "UNSUPPORTED_MODULES", "unsupported_module_reason"]

_NI = "not implemented in this engine"


class UnsupportedFeatureError(NotImplementedError):
    """A DeepSpeed name the engine provides only to refuse it: the message says why."""


class UnsupportedModuleError(ModuleNotFoundError):
    """A DeepSpeed module the engine does not provide: the message says why."""


class UnsupportedAttributeError(AttributeError):
    """A DeepSpeed submodule reached as an attribute (``deepspeed.inference``) that the engine
    does not provide (an ``AttributeError``, so ``hasattr`` answers False)."""


class _UnsupportedMeta(type):
    _ds_path: str
    _ds_reason: str

    def __call__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        raise UnsupportedFeatureError(f"{cls._ds_path} is not supported by this engine: {cls._ds_reason}")

    def __repr__(cls) -> str:
        return f"<unsupported {cls._ds_path}: {cls._ds_reason}>"


class _Unsupported(metaclass=_UnsupportedMeta):
    """Base of every placeholder :func:`unsupported` makes."""

    _ds_path = "?"
    _ds_reason = "?"


def unsupported(path: str, reason: str) -> Any:
    """A placeholder for DeepSpeed's ``path`` (``"deepspeed.init_inference"``): importable,
    and raising :class:`UnsupportedFeatureError` with ``reason`` when called or instantiated."""
    name = path.rsplit(".", 1)[-1]
    return _UnsupportedMeta(name, (_Unsupported,), {"_ds_path": path, "_ds_reason": reason, "__doc__":
                                                     f"Not supported: {reason}"})


def is_unsupported(obj: object) -> bool:
    """True for a placeholder made by :func:`unsupported`."""
    return isinstance(obj, type) and issubclass(obj, _Unsupported)


_OFFLOAD_ONLY = "NVMe / asynchronous I/O offload is " + _NI + " (ZeRO-Offload to the CPU is: offload_optimizer)"

# Relative to the package: "inference" is deepspeed.inference. A listed package refuses its
# submodules too (the most specific entry gives the reason).
_UNIVERSAL = ("DeepSpeed's universal-checkpoint tools are " + _NI + ": the engine's checkpoints reshape across "
              "layouts themselves (engine.checkpoint); zero_to_fp32 is deepspeed.utils.zero_to_fp32 "
              "(deepspeed.checkpoint.utils.clone_tensors_for_torch_save is supported)")
UNSUPPORTED_MODULES: Mapping[str, str] = {
    "inference": "DeepSpeed-Inference (init_inference, kernel injection) is " + _NI + ": this is a training engine",
    "module_inject": "kernel injection / AutoTP for inference is " + _NI + " (AutoTP training is: "
                     "the tensor_parallel.autotp_size config key)",
    "model_implementations": "DeepSpeed-Inference model implementations are " + _NI,
    "profiling": "the flops profiler is " + _NI + " (the engine logs tokens/s and MFU: engine.metrics)",
    "monitor": "DeepSpeed's monitor classes are " + _NI + " as a module: configure tensorboard / csv_monitor / "
               "wandb in the config instead",
    "sequence": "DeepSpeed-Ulysses' DistributedAttention is " + _NI + " as a layer: set sequence_parallel_size "
                "(or context_parallel) in the config and the engine's attention is split for you",
    "runtime.sequence_parallel": "DeepSpeed's Ulysses-SP helpers for Hugging Face are " + _NI + ": use the "
                                 "config's sequence_parallel_size / context_parallel",
    "compression": "compression training is " + _NI,
    "autotuning": "the autotuner is " + _NI,
    "elasticity": "elastic training is " + _NI,
    "compile": "DeepCompile is " + _NI,
    "linear": "DeepSpeed's LoRA / quantized linear layers (deepspeed.linear) are " + _NI,
    "datastates": "DataStates asynchronous checkpointing is " + _NI + " (the engine's own is checkpoint.async)",
    "nvme": _OFFLOAD_ONLY,
    "ops.aio": _OFFLOAD_ONLY,
    "ops.op_builder": "DeepSpeed's op builders are " + _NI + ": the engine builds its own ops (engine.ops)",
    "ops.sparse_attention": "sparse attention is " + _NI,
    "ops.transformer": "DeepSpeed's fused transformer kernels are " + _NI,
    "ops.deepspeed4science": "DeepSpeed4Science kernels are " + _NI,
    "ops.lamb": "the LAMB optimizer is " + _NI + ": use Adam / AdamW / Lion / Muon",
    "ops.lion": "DeepSpeed's Lion op is " + _NI + " as a client optimizer: use optimizer.type \"Lion\" in the config",
    "ops.adagrad": "Adagrad is " + _NI,
    "runtime.fp16": "DeepSpeed's fp16 module (FP16_Optimizer, its loss scalers; 1-bit Adam / LAMB / 0/1 Adam with "
                    "compressed communication in runtime.fp16.onebit) is " + _NI + ": mixed precision is the bf16 / "
                    "fp16 config sections (engine.precision)",
    "runtime.data_pipeline": "DeepSpeed's data-efficiency pipeline (curriculum learning) is " + _NI,
    "runtime.torch_autocast": "DeepSpeed's autocast internals (init_autocast_params, the comm-dtype attributes) are "
                              + _NI + ": the torch_autocast config section is (engine.precision.autocast)",
    "runtime.pipe.schedule": "DeepSpeed's pipeline instruction classes are " + _NI + ": the engine's schedules are "
                             "engine.pipeline.schedule, chosen by the config's pipeline.schedule",
    "runtime.hybrid_engine": "the RLHF hybrid engine is " + _NI,
    "runtime.zero.offload_states": "offload_states / reload_states are " + _NI,
    "runtime.activation_checkpointing.offload_activations": "offloading checkpointed activations to the host is "
                                                            + _NI,
    "runtime.zero.config": "DeepSpeed's pydantic config models are not reproduced: the engine's typed config is "
                           "engine.config (Config.zero for zero_optimization)",
    "runtime.zero.tiling": "TiledLinear is " + _NI,
    "checkpoint.deepspeed_checkpoint": _UNIVERSAL,
    "checkpoint.universal_checkpoint": _UNIVERSAL,
    "checkpoint.ds_to_universal": _UNIVERSAL,
    "checkpoint.zero_checkpoint": _UNIVERSAL,
    "checkpoint.reshape_meg_2d": _UNIVERSAL,
    "checkpoint.reshape_3d_utils": _UNIVERSAL,
    "checkpoint.reshape_utils": _UNIVERSAL,
    "checkpoint.constants": _UNIVERSAL,
}


def unsupported_module_reason(relative: str) -> Optional[str]:
    """The reason ``relative`` (``"profiling.flops_profiler"``) is refused, from its most specific
    listed package, or None when it is not listed."""
    parts = relative.split(".")
    for end in range(len(parts), 0, -1):
        reason = UNSUPPORTED_MODULES.get(".".join(parts[:end]))
        if reason is not None:
            return reason
    return None
