"""DeepSpeed's public module tree over this engine. Either change a script's import

    import deepspeed                          ->  import engine.compat.deepspeed as deepspeed

or leave the script as it is and run it through the alias (docs/deepspeed_compat.md):

    torchrun --nproc_per_node 2 -m engine.compat.deepspeed train.py --deepspeed_config ds.json
    deepspeed --num_gpus 2 --module engine.compat.deepspeed train.py --deepspeed_config ds.json

(:func:`alias` installs this package as ``deepspeed`` and each of its modules as
``deepspeed.<name>``, so ``from deepspeed.X import Y`` and ``import deepspeed.comm as dist``
give the engine's.)

Top level, as DeepSpeed's: ``initialize``, ``init_distributed``, ``add_config_arguments``,
``get_accelerator``, ``DeepSpeedEngine``, ``PipelineEngine``, ``DeepSpeedConfig``,
``PipelineModule``, ``log_dist``, ``logger``, ``__version__``; modules ``accelerator``,
``comm``, ``utils`` (``RepeatingLoader``, ``zero_to_fp32``), ``runtime`` (``utils``,
``config``, ``engine``, ``lr_schedules``, ``zero``, ``pipe`` with its ``topology``),
``pipe``, ``zero``, ``ops.adam``, ``checkpointing`` and ``moe`` (imported on first use).

A DeepSpeed name the engine does not implement is still importable and raises
:class:`~engine.compat.deepspeed._unsupported.UnsupportedFeatureError` with the reason when
used; a DeepSpeed module it does not implement (``deepspeed.inference``, ``deepspeed.profiling``,
...) raises :class:`~engine.compat.deepspeed._unsupported.UnsupportedModuleError` (an
``ImportError``) with the reason when imported.
"""

from __future__ import annotations

import importlib
from typing import Any

from engine.assembly.initialize import initialize
from engine.compat.api import add_config_arguments, init_distributed
from engine.compat.deepspeed._alias import alias, install_finder, is_aliased
from engine.compat.deepspeed._unsupported import (
    UnsupportedAttributeError,
    UnsupportedFeatureError,
    UnsupportedModuleError,
    unsupported,
    unsupported_module_reason,
)

install_finder()  # unsupported modules fail with their reason, also before alias()

from engine.compat.deepspeed import accelerator, comm, ops, pipe, runtime, utils, zero  # noqa: E402
from engine.compat.deepspeed.accelerator import get_accelerator  # noqa: E402
from engine.compat.deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError  # noqa: E402
from engine.compat.deepspeed.runtime.engine import (  # noqa: E402
    DeepSpeedEngine,
    DeepSpeedOptimizerCallable,
    DeepSpeedSchedulerCallable,
)
from engine.compat.deepspeed.runtime.pipe.engine import PipelineEngine  # noqa: E402
from engine.compat.deepspeed.utils import OnDevice, log_dist, logger  # noqa: E402
from engine.pipe import PipelineModule  # noqa: E402
from engine.zero import ZeroOptimizer as DeepSpeedOptimizer  # noqa: E402

__version__ = "0.19.8+engine"  # the DeepSpeed release whose API this mirrors
version = __version__
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500

_INFERENCE = "DeepSpeed-Inference is not implemented in this engine: it is a training engine"
init_inference = unsupported("deepspeed.init_inference", _INFERENCE)
InferenceEngine = unsupported("deepspeed.InferenceEngine", _INFERENCE)
DeepSpeedInferenceConfig = unsupported("deepspeed.DeepSpeedInferenceConfig", _INFERENCE)
replace_transformer_layer = unsupported("deepspeed.replace_transformer_layer", _INFERENCE)
tp_model_init = unsupported("deepspeed.tp_model_init", "AutoTP is configured here by the config key "
                            "tensor_parallel.autotp_size and applied by deepspeed.initialize")
set_autotp_mode = unsupported("deepspeed.set_autotp_mode", "AutoTP is configured by tensor_parallel.autotp_size")
DeepSpeedTransformerLayer = unsupported("deepspeed.DeepSpeedTransformerLayer",
                                        "DeepSpeed's fused transformer kernels are not implemented in this engine")
DeepSpeedTransformerConfig = unsupported("deepspeed.DeepSpeedTransformerConfig",
                                         "DeepSpeed's fused transformer kernels are not implemented in this engine")
DeepSpeedHybridEngine = unsupported("deepspeed.DeepSpeedHybridEngine", "the RLHF hybrid engine is not implemented")
DualPipeVEngine = unsupported("deepspeed.DualPipeVEngine", "DualPipeV is not implemented: the engine's pipeline "
                              "schedules are the config's pipeline.schedule (1F1B, interleaved, zero-bubble, ...)")
DualPipeVModule = unsupported("deepspeed.DualPipeVModule", "DualPipeV is not implemented (see DualPipeVEngine)")
default_inference_config = unsupported("deepspeed.default_inference_config", _INFERENCE)
_AUTOTP_HELPERS = "DeepSpeed's AutoTP / Muon setup helpers are internals of its initialize; the engine's is engine.initialize"
load_ds_config = unsupported("deepspeed.load_ds_config", _AUTOTP_HELPERS)
merge_tp_model_init_into_config = unsupported("deepspeed.merge_tp_model_init_into_config", _AUTOTP_HELPERS)
record_tp_model_init_args = unsupported("deepspeed.record_tp_model_init_args", _AUTOTP_HELPERS)
set_optimizer_flags = unsupported("deepspeed.set_optimizer_flags", _AUTOTP_HELPERS)
resolve_per_head_muon_after_sharding = unsupported("deepspeed.resolve_per_head_muon_after_sharding", _AUTOTP_HELPERS)
MUON_OPTIMIZER = "muon"  # DeepSpeed's name of the Muon optimizer type
DeepSpeedDataLoader = unsupported("deepspeed.DeepSpeedDataLoader", "build the loader with "
                                  "deepspeed.initialize(training_data=...) (or your own DataLoader)")

# modules another part of the package provides, imported on first use
_LAZY_MODULES = ("checkpointing", "moe")

__all__ = ["initialize", "init_distributed", "add_config_arguments", "alias", "is_aliased", "get_accelerator",
           "DeepSpeedEngine", "PipelineEngine", "DeepSpeedConfig", "DeepSpeedConfigError", "DeepSpeedOptimizer",
           "DeepSpeedOptimizerCallable", "DeepSpeedSchedulerCallable", "PipelineModule", "log_dist", "logger",
           "OnDevice", "accelerator", "comm", "ops", "pipe", "runtime", "utils", "zero",
           "__version__", "version", "TORCH_DISTRIBUTED_DEFAULT_PORT", "init_inference", "InferenceEngine",
           "DeepSpeedInferenceConfig", "replace_transformer_layer", "tp_model_init", "set_autotp_mode",
           "DeepSpeedTransformerLayer", "DeepSpeedTransformerConfig", "DeepSpeedHybridEngine", "DualPipeVEngine",
           "DualPipeVModule", "DeepSpeedDataLoader", "UnsupportedFeatureError", "UnsupportedModuleError",
           "default_inference_config", "load_ds_config", "merge_tp_model_init_into_config", "record_tp_model_init_args",
           "set_optimizer_flags", "resolve_per_head_muon_after_sharding", "MUON_OPTIMIZER"]


def __getattr__(name: str) -> Any:
    if name in _LAZY_MODULES:
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:  # hasattr(deepspeed, name) must stay an attribute question
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'deepspeed' has no attribute {name!r} (engine.compat.deepspeed.{name} "
                                 "is not installed)") from e
    reason = unsupported_module_reason(name)
    if reason is not None:
        raise UnsupportedAttributeError(f"deepspeed.{name} is not supported by this engine: {reason}")
    raise AttributeError(f"module 'deepspeed' has no attribute {name!r}")
