"""The parallelism planner: for a model, a cluster and a global batch, enumerate the
(dp, tp, pp, micro-batch, ZeRO stage, schedule, recomputation, and when asked the
context-parallel degree and mode) layouts, predict memory per
device and step time, reject what does not fit (with the reasons) and rank the rest.

    from engine.planner import plan, cluster_preset, model_preset, format_plans
    plans = plan(model_preset("llama3-70b"), cluster_preset("h100", nodes=8), global_batch=512)
    text = format_plans(plans)

CLI: ``python -m engine.planner --help``. The cost model is in :mod:`engine.planner.cost`,
its calibration against measured runs in :mod:`engine.planner.calibrate`.
"""

from engine.planner.cluster import CLUSTERS, MODELS, Cluster, GiB, cluster_preset, model_preset
from engine.planner.cost import (
                                 Layout,
                                 MemoryEstimate,
                                 TimeEstimate,
                                 activation_bytes_per_token,
                                 check_layout,
                                 memory_estimate,
                                 pipeline_makespan,
                                 stage_shapes,
                                 time_estimate,
                                 zero_state_bytes,
)
from engine.planner.search import Plan, enumerate_layouts, evaluate, format_plans, plan

__all__ = ["Cluster", "CLUSTERS", "MODELS", "GiB", "cluster_preset", "model_preset", "Layout", "MemoryEstimate",
           "TimeEstimate", "activation_bytes_per_token", "check_layout", "memory_estimate", "pipeline_makespan",
           "stage_shapes", "time_estimate", "zero_state_bytes", "Plan", "enumerate_layouts", "evaluate", "format_plans", "plan"]
