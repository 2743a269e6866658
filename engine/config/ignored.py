"""The one table of config keys that are accepted and have no effect here, with the reason.

DeepSpeed configs carry these keys, so they load (type- and range-checked like any other
key, and written back by ``Config.to_dict()`` where the schema holds them), but nothing in
the engine reads them. :func:`ignored_keys_in` finds the ones a config actually sets;
``load_config`` stores them in ``Config.ignored_keys`` and :func:`log_ignored_keys` tells
the user once, on rank 0, when the engine is built. A test (tests/unit/test_config_ignored.py)
fails when a schema field is neither read by the engine nor listed here, and when a key
listed here is read.

Keys are JSON paths (``section.key``). DeepSpeed's alternative spellings of a listed key
(``module_granularity_threshold`` for ``stage3_module_granularity_threshold``) are reported
under the listed name.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

__all__ = ["IGNORED_KEYS", "ignored_keys_in", "log_ignored_keys"]

_Z = "zero_optimization."
_OFFLOAD = "a DeepSpeed offload scheduling detail; offload_optimizer copies each group's gradient shard at once"
_DS_HOOKS = "a DeepSpeed ZeRO-3 hook/tracing internal; this engine gathers parameters per stage module"

IGNORED_KEYS: Mapping[str, str] = {
    # top level: switches of DeepSpeed's client / CPU optimizers
    "zero_allow_untested_optimizer": "DeepSpeed's guard for client optimizers under ZeRO; any torch optimizer works here",
    # fp16
    "fp16.auto_cast": "DeepSpeed casts floating-point inputs to fp16; our inputs are integer token ids",
    # zero_optimization
    _Z + "contiguous_gradients": "reduced gradients always live in contiguous flat buckets",
    _Z + "reduce_scatter": ("ZeRO-1/2/3 always reduce-scatter gradients and stage 0 all-reduces them; "
                            "DeepSpeed's false (all-reduce, then keep the shard) gives the same values"),
    _Z + "allgather_partitions": "updated partitions are always all-gathered (DeepSpeed's false = broadcasts)",
    _Z + "allgather_bucket_size": ("updated parameters are all-gathered per gradient bucket "
                                   "(reduce_bucket_size sets both)"),
    _Z + "use_multi_rank_bucket_allreduce": "a DeepSpeed reduce-op detail; buckets are always reduced collectively",
    _Z + "stage3_model_persistence_threshold": "caps persistent parameters for offload / inference",
    _Z + "stage3_module_granularity_threshold": _DS_HOOKS,
    _Z + "stage3_use_all_reduce_for_fetch_params": "parameters are fetched with all-gather",
    _Z + "stage3_allgather_sequential": "a DeepSpeed bucketing bypass",
    _Z + "sub_group_size": "optimizer-step tiling for offloaded ZeRO-3; each rank steps its shard at once",
    _Z + "round_robin_gradients": "speeds up gradient copies to CPU offload; " + _OFFLOAD,
    _Z + "elastic_checkpoint": "a legacy DeepSpeed option; our checkpoints reshape across topologies",
    _Z + "load_from_fp32_weights": "checkpoints always restore the fp32 master weights",
    _Z + "ignore_unused_parameters": ("parameters that get no gradient are not checked for "
                                      "(DeepSpeed's false makes one an error)"),
    _Z + "compute_grad_norm": "the global gradient norm is always computed (clipping, logging)",
    _Z + "parameter_alignment": "shard alignment is fixed by engine/zero/partition.py",
    _Z + "memory_efficient_linear": _DS_HOOKS,
    _Z + "override_module_apply": _DS_HOOKS,
    _Z + "pipeline_loading_checkpoint": _DS_HOOKS,
    _Z + "log_trace_cache_warnings": _DS_HOOKS,
    _Z + "enable_sanity_checks": _DS_HOOKS,
    _Z + "save_muon_momentum_buffer_in_memory": "an NVMe-offload detail; NVMe offload is not implemented",
    _Z + "leaf_module": "marks Hugging Face modules as ZeRO-3 leaves for DeepSpeed's hooks; we gather per block",
    # activation_checkpointing
    "activation_checkpointing.contiguous_memory_optimization": ("DeepSpeed's pre-allocated checkpoint buffer; "
                                                                "the caching allocator serves this"),
    "activation_checkpointing.number_checkpoints": "sizes DeepSpeed's pre-allocated checkpoint buffer",
    "activation_checkpointing.synchronize_checkpoint_boundary": ("a device synchronize at checkpoint boundaries "
                                                                 "for DeepSpeed's profiling"),
    "activation_checkpointing.profile": "DeepSpeed's checkpoint timers; use wall_clock_breakdown",
    # pipeline
    "pipeline.seed_layers": "DeepSpeed re-seeds per layer; our initialisation does not depend on the layout",
    "pipeline.pipe_partitioned": ("DeepSpeed splits pipeline activations across TP ranks to save bandwidth; "
                                  "not implemented (results are unaffected)"),
    "pipeline.grad_partitioned": ("DeepSpeed splits pipeline gradients across TP ranks to save bandwidth; "
                                  "not implemented (results are unaffected)"),
    # checkpoint
    "checkpoint.parallel_write": "every rank already writes its own shard",
}

# DeepSpeed's other spellings of listed keys (engine/config/sections.py accepts them)
_ALIASES: Mapping[str, str] = {
    _Z + "model_persistence_threshold": _Z + "stage3_model_persistence_threshold",
    _Z + "module_granularity_threshold": _Z + "stage3_module_granularity_threshold",
    _Z + "use_all_reduce_for_fetch_params": _Z + "stage3_use_all_reduce_for_fetch_params",
    _Z + "allgather_sequential": _Z + "stage3_allgather_sequential",
}


def ignored_keys_in(raw: Mapping[str, Any]) -> tuple[str, ...]:
    """The listed keys that the JSON object ``raw`` sets (to any value but null), in table order."""
    present: set[str] = set()
    for section, body in raw.items():
        if isinstance(body, Mapping):
            present.update(f"{section}.{key}" for key, v in body.items() if v is not None)
        elif body is not None:
            present.add(section)
    present |= {_ALIASES[k] for k in present if k in _ALIASES}
    return tuple(k for k in IGNORED_KEYS if k in present)


def log_ignored_keys(keys: tuple[str, ...], rank: int, logger: logging.Logger) -> None:
    """One warning on rank 0 naming every key in ``keys`` and why it has no effect."""
    if rank != 0 or not keys:
        return
    lines = "".join(f"\n  {k}: {IGNORED_KEYS[k]}" for k in keys)
    logger.warning("%d config key(s) accepted for DeepSpeed compatibility have no effect here "
                   "(remove them to silence this):%s", len(keys), lines)
