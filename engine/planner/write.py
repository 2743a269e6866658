"""A planned layout as a DeepSpeed-format config that ``launch/train.py`` runs.

``layout_config(model, layout)`` maps each field of a :class:`~engine.planner.cost.Layout`
onto the config keys the engine reads: ``dp`` follows from the world size (world / (tp·pp·cp)),
``cp``/``cp_mode`` -> ``context_parallel.size`` / ``mode`` (no section when cp is 1),
``tp`` -> ``tensor_parallel.autotp_size`` (with sequence parallelism, which the cost model
assumes for TP > 1), ``pp``/``schedule``/``virtual_stages`` -> ``pipeline``, the micro-batch
and the number of micro-batches -> ``train_micro_batch_size_per_gpu`` /
``gradient_accumulation_steps``, ``recompute`` -> ``activation_checkpointing.granularity``
(``selective`` with the default modules; ``full`` one block per unit), the ZeRO stage -> ``zero_optimization.stage``. The optimizer and schedule
are the Llama recipe (AdamW 3e-4, betas 0.9/0.95, cosine with warmup, clipping 1.0): change
them to taste; they do not enter the plan.
"""

from __future__ import annotations

import json
from typing import Any

from engine.errors import ConfigError
from engine.models.config import DEFAULT_SELECTIVE, ModelConfig
from engine.models.recompute import policy_from_config
from engine.planner.activations import policy_config
from engine.planner.cost import CP_MODES, Layout

__all__ = ["layout_config", "layout_of_config", "config_text"]


def layout_config(model: ModelConfig, layout: Layout, *, param_bytes: float = 2.0,
                  total_steps: int = 10000) -> dict[str, Any]:
    """The config dict that runs ``model`` in ``layout`` (bf16 when ``param_bytes`` is 2, else fp32)."""
    pipeline: dict[str, Any] = {"stages": layout.pp, "partition": "blocks"}  # the pieces the cost model has
    if layout.pp > 1:
        pipeline["schedule"] = layout.schedule
        if layout.virtual_stages > 1:
            pipeline["virtual_stages"] = layout.virtual_stages
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": layout.num_microbatches,
        "steps_per_print": 10,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": total_steps, "warmup_num_steps": max(1, total_steps // 50),
                                 "cos_min_ratio": 0.1}},
        "bf16": {"enabled": param_bytes == 2.0},
        "zero_optimization": {"stage": layout.zero_stage},
        "pipeline": pipeline,
        "tensor_parallel": {"autotp_size": layout.tp, "sequence_parallel": layout.tp > 1},
        "checkpoint": {"tag_validation": "Fail", "save_interval": 1000, "keep_last": 3},
        "model": model.to_dict(),
    }
    section = policy_config(layout.recompute)
    if section is not None:
        cfg["activation_checkpointing"] = section
    if layout.cp > 1:  # the CP ranks of a replica read the same rows: the batch keys count dp alone
        cfg["context_parallel"] = {"size": layout.cp, "mode": layout.cp_mode}
    return cfg


def config_text(cfg: dict[str, Any]) -> str:
    """The config as JSON with one top-level key per line (the shape of the files in configs/)."""
    body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in cfg.items())
    return "{\n" + body + "\n}\n"


def layout_of_config(cfg: Any) -> Layout:
    """The planner's :class:`Layout` of a loaded :class:`~engine.config.Config` (to rank a
    shipped config in the planner's own list)."""
    pipe = cfg.pipeline
    return Layout(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, micro_batch=cfg.train_micro_batch_size_per_gpu,
                  num_microbatches=cfg.gradient_accumulation_steps, zero_stage=cfg.zero.stage,
                  schedule=pipe.schedule if cfg.pp > 1 else "none",
                  virtual_stages=pipe.virtual_stages if cfg.pp > 1 else 1,
                  recompute=_policy_of(cfg), cp=cfg.cp, cp_mode=_cp_mode_of(cfg))


def _cp_mode_of(cfg: Any) -> str:
    """The config's context_parallel mode; an error for hybrid, which the planner does not model."""
    if cfg.cp == 1:
        return "ring"
    mode: str = cfg.context_parallel.mode
    if mode not in CP_MODES:
        raise ConfigError(f"context_parallel.mode \"{mode}\": the planner models \"ring\" and \"ulysses\"; rank "
                          "the config with one of them")
    return mode


def _policy_of(cfg: Any) -> str:
    """The searched policy a config's ``activation_checkpointing`` is; an error for one the
    planner does not model (other modules, several blocks per unit, offloaded or partitioned)."""
    pol = policy_from_config(cfg)
    if pol.cpu_checkpointing or pol.partition_activations:
        raise ConfigError("activation_checkpointing: the planner does not model cpu_checkpointing or "
                          "partition_activations; rank the config without them")
    if pol.granularity == "none":
        return "none"
    if pol.granularity == "selective" and tuple(pol.modules) == tuple(DEFAULT_SELECTIVE):
        return "selective"
    if pol.granularity == "full" and pol.method == "uniform" and pol.num_layers == 1:
        return "full"
    raise ConfigError(f"activation_checkpointing {pol}: the planner models granularity none, selective with "
                      f"the default modules {list(DEFAULT_SELECTIVE)}, and full with one block per unit")
