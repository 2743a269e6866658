"""Enumerate the layouts of a model on a cluster, predict each, reject what cannot run, rank
the rest.

:func:`plan` returns every candidate as a :class:`Plan`: feasible ones first, fastest
first; rejected ones after, each with its reasons (a structural problem, or memory). The
enumeration covers (dp, tp, pp) with ``dp*tp*pp`` = the cluster's devices, the
micro-batch size (the number of micro-batches follows from the global batch), the ZeRO
stage, the pipeline schedule (``virtual_stages`` 2 for interleaved 1F1B) and the activation
recompute policy (``none``, ``selective``, ``full``: its memory in the predicted peak, its
recomputed FLOPs in the step time) and, when asked (``cp_sizes``, default ``(1,)``: no
context parallelism, so that a plan without it is unchanged), the context-parallel degree
and mode (``cp_modes``: ``ring``, ``ulysses``), with ``dp*tp*pp*cp`` = the devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

from engine.errors import ConfigError
from engine.models.config import ModelConfig
from engine.pipeline.schedule import V_SCHEDULES
from engine.planner.activations import RECOMPUTE_POLICIES
from engine.planner.cluster import Cluster, GiB
from engine.planner.cost import (
    CP_MODES,
    Layout,
    MemoryEstimate,
    TimeEstimate,
    check_layout,
    layout_peak_bytes,
    memory_estimate,
    memory_lower_bound,
    time_estimate,
)
from engine.validate import check_int

__all__ = ["Plan", "plan", "enumerate_layouts", "evaluate", "format_plans", "divisors"]

# GPipe has 1F1B's bubble and holds every micro-batch: dominated, so not searched by default; zb-v
# (two chunks in V placement) is searched when named (--schedules ... zb-v)
DEFAULT_SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1")


@dataclass(frozen=True)
class Plan:
    layout: Layout
    memory: Optional[MemoryEstimate]
    time: Optional[TimeEstimate]
    reasons: tuple[str, ...]  # empty: feasible
    peak: Optional[float] = None  # predicted per-device peak bytes (cost.layout_peak_bytes): ranks and rejects

    @property
    def feasible(self) -> bool:
        return not self.reasons

    @property
    def feasible_time(self) -> TimeEstimate:
        """The time estimate of a feasible plan (evaluate() times every layout it does not reject)."""
        assert self.time is not None, f"{self.layout.describe()}: a rejected plan may have no time estimate"
        return self.time


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(model: ModelConfig, cluster: Cluster, global_batch: int, *,  # noqa: PLR0913 (one per dimension)
                      micro_batches: Sequence[int] = (1, 2, 4, 8), zero_stages: Sequence[int] = (0, 1, 2, 3),
                      schedules: Sequence[str] = DEFAULT_SCHEDULES, recompute: Sequence[str] = RECOMPUTE_POLICIES,
                      tp_sizes: Optional[Sequence[int]] = None, pp_sizes: Optional[Sequence[int]] = None,
                      balanced_stages: bool = True, cp_sizes: Sequence[int] = (1,),
                      cp_modes: Sequence[str] = ("ring",)) -> Iterable[tuple[Layout, list[str]]]:
    """Every candidate with the reasons found before any cost is computed (batch
    divisibility; with ``balanced_stages``, a pipeline degree that does not divide the
    layers - the engine runs uneven stages, but the slowest one sets the pace);
    ``global_batch`` is in sequences (the CP ranks of a replica read the same ones, so it
    divides by dp alone)."""
    check_int("global batch (sequences)", global_batch, minimum=1)
    for c in cp_sizes:
        check_int("context-parallel degree", c, minimum=1)
    for mode in cp_modes:
        if mode not in CP_MODES:
            raise ConfigError(f"context-parallel mode {mode!r}: the planner searches {', '.join(CP_MODES)}")
    for cp in cp_sizes:
        if cluster.world_size % cp:
            continue  # no layout of this cluster has that degree
        for mode in (cp_modes if cp > 1 else ("ring",)):
            yield from _layouts_at_cp(model, cluster, global_batch, (cp, mode), dict(
                micro_batches=micro_batches, zero_stages=zero_stages, schedules=schedules, recompute=recompute,
                tp_sizes=tp_sizes, pp_sizes=pp_sizes, balanced_stages=balanced_stages))


def _layouts_at_cp(model: ModelConfig, cluster: Cluster, global_batch: int, cp_layout: tuple[int, str],
                   opts: dict[str, Any]) -> Iterable[tuple[Layout, list[str]]]:
    """:func:`enumerate_layouts` at one context-parallel (degree, mode); ``opts``: its other
    keyword arguments."""
    cp, cp_mode = cp_layout
    micro_batches, zero_stages, schedules = opts["micro_batches"], opts["zero_stages"], opts["schedules"]
    recompute, balanced_stages = opts["recompute"], opts["balanced_stages"]
    world = cluster.world_size // cp  # the ranks of one CP index: dp * tp * pp
    tps = opts["tp_sizes"] or [t for t in divisors(world) if t <= max(cluster.gpus_per_node, 1) * 2]
    for tp in tps:
        for pp in (opts["pp_sizes"] or divisors(world // tp) if world % tp == 0 else []):
            if (world // tp) % pp:
                continue
            dp = world // (tp * pp)
            for mb in micro_batches:
                why = []
                if balanced_stages and pp > 1 and model.num_layers % pp:
                    why.append(f"pp={pp} does not divide the {model.num_layers} layers (unbalanced stages; "
                               "search them with balanced_stages=False)")
                if global_batch % dp:
                    why.append(f"global batch {global_batch} is not divisible by dp={dp}")
                    m = 1
                elif (global_batch // dp) % mb:
                    why.append(f"micro-batch {mb} does not divide the {global_batch // dp} sequences per replica")
                    m = 1
                else:
                    m = global_batch // dp // mb
                scheds = ([(s, 2 if s in ("interleaved-1f1b", *V_SCHEDULES) else 1) for s in schedules]
                          if pp > 1 else [("none", 1)])
                for sched, v in scheds:
                    for z in zero_stages:
                        for rc in recompute:
                            yield Layout(dp, tp, pp, mb, m, z, sched, v, rc, cp, cp_mode), list(why)


def evaluate(model: ModelConfig, layout: Layout, cluster: Cluster, *, param_bytes: float = 2.0,
             extra_reasons: Sequence[str] = ()) -> Plan:
    """Predict one layout; the plan's reasons say why it cannot run (if so)."""
    why = list(extra_reasons) + check_layout(model, layout, cluster)
    if why:
        return Plan(layout, None, None, tuple(why))
    floor = memory_lower_bound(model, layout, cluster, param_bytes=param_bytes)
    if floor > cluster.memory_bytes:  # cannot fit whatever the schedule does: skip the simulation
        return Plan(layout, None, None, (f"out of memory: needs at least {floor / GiB:.1f} GiB of "
                                          f"{cluster.memory_bytes / GiB:.1f} (model states, reserved, and the "
                                          "first stage's activations for min(pp, micro-batches) in flight)",))
    mem = memory_estimate(model, layout, cluster, param_bytes=param_bytes)  # the between-steps breakdown
    peak = layout_peak_bytes(model, layout, cluster, param_bytes=param_bytes)
    t = time_estimate(model, layout, cluster, param_bytes=param_bytes)
    if peak > cluster.memory_bytes:
        why.append(f"out of memory on stage {mem.stage}: the predicted peak needs {peak / GiB:.1f} GiB of "
                   f"{cluster.memory_bytes / GiB:.1f} (states {mem.model_states / GiB:.1f}, activations "
                   f"{mem.activations / GiB:.1f} for {mem.inflight_microbatches} micro-batches in flight "
                   f"(logits included), reserved {mem.reserved / GiB:.1f}, plus the step's buckets, "
                   f"gathered parameters and gradients in flight)")
    return Plan(layout, mem, t, tuple(why), peak)


def plan(model: ModelConfig, cluster: Cluster, global_batch: int, *, param_bytes: float = 2.0,
         **enum_kwargs) -> list[Plan]:
    """Every candidate layout, predicted: feasible by predicted step time, then the rejected
    ones (each with its reasons)."""
    plans = [evaluate(model, lay, cluster, param_bytes=param_bytes, extra_reasons=why)
             for lay, why in enumerate_layouts(model, cluster, global_batch, **enum_kwargs)]
    ok = sorted((p for p in plans if p.feasible), key=lambda p: (p.feasible_time.step_s, p.peak))
    bad = [p for p in plans if not p.feasible]
    bad.sort(key=lambda p: (p.time is None, p.time.step_s if p.time else 0.0))
    return ok + bad


def format_plans(plans: Sequence[Plan], top: int = 15, rejected: int = 10) -> str:
    """A text table of the best ``top`` feasible plans and ``rejected`` rejected ones."""
    with_cp = any(p.layout.cp > 1 for p in plans)  # the CP columns only when CP was searched
    cp_head = f" {'cp':>2} {'mode':<7}" if with_cp else ""
    head = (f"{'#':>3} {'dp':>3} {'tp':>3} {'pp':>3}{cp_head} {'schedule':<18} {'mb':>3} {'m':>4} {'Z':>1} {'rc':>2} "
            f"{'peak GiB':>8} {'step s':>8} {'tok/s':>10} {'MFU':>6} {'bubble':>6} {'TP comm':>7} {'DP comm':>7}"
            + (f" {'CP comm':>7}" if with_cp else ""))
    lines = [head, "-" * len(head)]
    ok = [p for p in plans if p.feasible][:top]
    for i, p in enumerate(ok, 1):
        lines.append(_row(i, p, with_cp))
    bad = [p for p in plans if not p.feasible]
    if bad and rejected:
        lines.append("")
        lines.append(f"rejected ({len(bad)} layouts; first {min(rejected, len(bad))}):")
        for p in bad[:rejected]:
            lines.append(f"  {p.layout.describe()}: {'; '.join(p.reasons)}")
    return "\n".join(lines)


def _row(i: int, p: Plan, with_cp: bool = False) -> str:
    lay, t = p.layout, p.feasible_time  # only feasible plans get a row
    sched = lay.schedule + (f"(v{lay.virtual_stages})" if lay.virtual_stages > 1 else "")
    cp = f" {lay.cp:>2} {lay.cp_mode if lay.cp > 1 else '-':<7}" if with_cp else ""
    return (f"{i:>3} {lay.dp:>3} {lay.tp:>3} {lay.pp:>3}{cp} {sched:<18} {lay.micro_batch:>3} "
            f"{lay.num_microbatches:>4} "
            f"{lay.zero_stage:>1} {lay.recompute[0]:>2} {(p.peak or 0.0) / GiB:>8.1f} {t.step_s:>8.3f} "
            f"{t.tokens_per_s:>10.0f} {100 * t.mfu:>5.1f}% {100 * t.bubble_fraction:>5.1f}% "
            f"{100 * t.tp_comm_s / t.step_s:>6.1f}% {t.dp_comm_s:>7.3f}"
            + (f" {100 * t.cp_comm_s / t.step_s:>6.1f}%" if with_cp else ""))
