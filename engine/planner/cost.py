"""The planner's cost model: memory per device (analytic) and step time (compute from FLOPs,
communication from bytes over bandwidth per collective, the pipeline from the schedule
simulator) of one :class:`Layout` of the reference GPT on a :class:`Cluster`.

Conventions (ours, i.e. this engine's; the Megatron-LM practice where they agree):

- ranks are laid out TP innermost, then DP, then PP (:class:`engine.topology.Topology`), so
  a TP group stays inside a node and DP / PP groups span nodes once ``tp*dp`` (resp. the
  world) exceeds a node;
- TP > 1 uses sequence parallelism (activations between TP regions are split over the
  sequence);
- compute dtype ``param_bytes`` (2 = bf16); gradients accumulate and are reduced in fp32
  (4 bytes), Adam keeps fp32 master weights and two moments (12 bytes): the ZeRO paper's
  K = 12 with our fp32 gradients (:func:`engine.zero.memory.zero_state_bytes`); ZeRO-1
  also holds its fp32 master-gradient shard (4 Psi / N_d, our stage 1);
- activations: :mod:`engine.planner.activations` - the bytes each block keeps for backward
  under the layout's recompute policy (``none`` / ``selective`` / ``full``) from the one
  formula of :mod:`engine.models.activation_memory` (docs/activation_memory.md; for Llama
  shapes in bf16 ~54.75 h bytes per token and layer without recomputation, measured exact),
  the head's logits and the loss's fp32 temporaries, a backward's working set (and the
  recomputed block), and the micro-batch chunks each rank holds, walked from the schedule's
  own compute order; checked against the measured ``activation_peak_bytes`` by
  benchmarks/activation_memory_planner.py (tests/unit/test_planner_activations.py).

Time per step: the pipeline makespan from :func:`engine.pipeline.simulate.simulate` with
per-stage forward/backward costs (compute at ``peak * compute_efficiency``, plus the TP
collectives of each block and, with ZeRO-3, the parameter all-gathers not hidden behind
compute) and the point-to-point transfer as the communication cost; plus the DP gradient
reduction and parameter gather not hidden behind the last micro-batch's backward; plus the
optimizer step (memory-bound: ~34 bytes per local master element).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional, Sequence

from engine.errors import ConfigError
from engine.models import flops_per_token
from engine.models.activation_memory import BlockDims, block_bytes_per_token
from engine.models.config import ModelConfig
from engine.pipeline.partition import partition_layers
from engine.pipeline.schedule import SCHEDULES, build_all, check_schedule_args, placement_of, stage_index
from engine.pipeline.simulate import bubble_fraction, per_stage_costs, simulate
from engine.pipeline.stages import reference_layer_params
from engine.planner.activations import (
    RECOMPUTE_POLICIES,
    ActivationShape,
    cp_block_bytes_per_token,
    inflight_peaks,
    policy_modules,
    recompute_forward_fraction,
)
from engine.planner.cluster import Cluster
from engine.planner.cp_time import cp_comm_seconds
from engine.validate import check_int
from engine.zero.memory import zero_state_bytes as engine_state_bytes

__all__ = ["Layout", "MemoryEstimate", "TimeEstimate", "StageShape", "stage_shapes", "memory_estimate",
           "time_estimate", "pipeline_makespan", "activation_bytes_per_token", "activation_peaks", "check_layout", "model_states_bytes", "zero_state_bytes", "peak_estimate", "layout_peak_bytes",
           "memory_lower_bound",
           "ADAM_STEP_BYTES", "CP_MODES", "cp_comm_seconds"]

CP_MODES = ("ring", "ulysses")  # the context_parallel modes the planner models
ADAM_STEP_BYTES = 34.0  # per master element: read grad, master, m, v; write master, m, v, param; norm pass
SIM_MICROBATCH_MIN = 8  # pipelines longer than max(p + 2, this) are simulated at that length and extrapolated


@dataclass(frozen=True)
class Layout:
    """One parallel layout of a training step. ``micro_batch`` sequences per micro-batch,
    ``num_microbatches`` per optimizer step and DP replica; ``schedule`` is ``"none"``
    without a pipeline; ``recompute``: the activation recompute policy, one of
    :data:`engine.planner.activations.RECOMPUTE_POLICIES` (``"none"``, ``"selective"`` with
    the default modules, ``"full"`` one block per unit)."""

    dp: int
    tp: int
    pp: int
    micro_batch: int
    num_microbatches: int
    zero_stage: int
    schedule: str = "none"
    virtual_stages: int = 1
    recompute: str = "none"
    cp: int = 1
    cp_mode: str = "ring"

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_POLICIES:
            raise ValueError(f"Layout.recompute={self.recompute!r}: use one of {RECOMPUTE_POLICIES} "
                             "(an activation_checkpointing granularity)")
        check_int("Layout.cp", self.cp, minimum=1, error=ValueError,
                  fix="the context-parallel degree (context_parallel.size)")
        if self.cp_mode not in CP_MODES:
            raise ValueError(f"Layout.cp_mode={self.cp_mode!r}: the planner models context_parallel.mode "
                             f"{' or '.join(repr(m) for m in CP_MODES)} (not \"hybrid\")")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def grad_ranks(self) -> int:
        """The ranks that reduce and (ZeRO) partition gradients and optimizer state: the
        engine's grad role spans ``cp x dp`` (engine.topology.ROLE_AXES)."""
        return self.dp * self.cp

    @property
    def ulysses_size(self) -> int:
        """The all-to-all degree U: C under Ulysses, 1 for the ring (and without CP)."""
        return self.cp if self.cp_mode == "ulysses" and self.cp > 1 else 1

    def describe(self) -> str:
        sched = self.schedule + (f"(v{self.virtual_stages})" if self.virtual_stages > 1 else "")
        cp = f" cp{self.cp}({self.cp_mode})" if self.cp > 1 else ""
        return (f"dp{self.dp} tp{self.tp} pp{self.pp}{cp} {sched} mb{self.micro_batch}x{self.num_microbatches} "
                f"ZeRO-{self.zero_stage}" + (f" recompute={self.recompute}" if self.recompute != "none" else ""))


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the most loaded device."""

    params: float
    grads: float
    optimizer_state: float
    activations: float  # the activation peak (schedule walk), the head's logits included
    logits: float  # 0: counted in ``activations`` (kept for the breakdown's shape)
    transient: float  # ZeRO-3 gathered parameters and their fp32 gradients
    reserved: float
    inflight_microbatches: int
    stage: int  # the pipeline stage that needs the most

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer_state

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.logits + self.transient + self.reserved


@dataclass(frozen=True)
class TimeEstimate:
    step_s: float
    compute_s: float      # this device's forward + backward (+ recompute) FLOPs at the achieved rate
    tp_comm_s: float      # TP collectives on the critical path
    pp_comm_s: float      # point-to-point transfers on the critical path (approximate)
    zero3_gather_s: float  # exposed ZeRO-3 parameter all-gathers
    bubble_s: float       # pipeline idle time of the busiest stage
    bubble_fraction: float
    dp_comm_s: float      # exposed gradient reduction + parameter gather
    optimizer_s: float
    tokens_per_s: float
    mfu: float
    notes: tuple[str, ...] = field(default=())
    cp_comm_s: float = 0.0  # context-parallel communication on the critical path (cp_comm_seconds)


@dataclass(frozen=True)
class StageShape:
    """What one pipeline piece (virtual stage) holds."""

    blocks: int
    has_embedding: bool
    has_head: bool
    params: int  # unsharded


def stage_shapes(model: ModelConfig, pp: int, virtual_stages: int = 1) -> list[StageShape]:
    """The ``pp * virtual_stages`` pieces of the reference layer list under the engine's
    ``blocks`` partition (blocks split evenly, embedding on the first, head on the last;
    a tied head on another stage holds its own copy, as the engine's does)."""
    counts = reference_layer_params(model)
    bounds = partition_layers(counts, pp * virtual_stages, "blocks")
    last = len(counts) - 1
    out = []
    for k in range(pp * virtual_stages):
        lo, hi = bounds[k], bounds[k + 1]
        blocks = sum(1 for i in range(lo, hi) if 0 < i < last)
        n = sum(counts[lo:hi])
        if model.tie_embeddings and lo == 0 and hi == len(counts):  # one tied matrix, counted once
            n -= model.vocab_size * model.hidden_size
        out.append(StageShape(blocks, lo == 0, hi == len(counts), n))
    return out


def _rank_pieces(layout: Layout, shapes: Sequence[StageShape], rank: int) -> list[StageShape]:
    """The pieces pipeline rank ``rank`` holds, chunk by chunk, under the layout's schedule
    (:func:`engine.pipeline.schedule.stage_index`: the loop placement, or V for zb-v)."""
    sched = "1f1b" if layout.schedule == "none" else layout.schedule
    return [shapes[stage_index(sched, rank, c, layout.pp, layout.virtual_stages)]
            for c in range(layout.virtual_stages)]


def _rank_params(model: ModelConfig, mine: Sequence[StageShape]) -> int:
    """Unsharded parameters of one rank's pieces: a tied embedding and head on the same rank
    (V placement, rank 0) are one matrix, counted once."""
    n = sum(s.params for s in mine)
    if model.tie_embeddings and len(mine) > 1 and any(s.has_embedding for s in mine) and any(s.has_head for s in mine):
        n -= model.vocab_size * model.hidden_size
    return n


def _block_matmul_params(model: ModelConfig) -> int:
    counts = reference_layer_params(model)
    return counts[1] - 2 * model.hidden_size  # minus the two RMSNorm weights


def activation_bytes_per_token(model: ModelConfig, tp: int, param_bytes: float = 2.0,
                               recompute: str = "none", cp_extra: float = 0.0) -> float:
    """Saved activations of ONE block per token under a recompute policy, TP ``tp`` with
    sequence parallelism when tp > 1: :func:`engine.models.activation_memory.block_bytes_per_token`
    (the per-block constant, the fp32 norm weight copies, left out); ``cp_extra``: what
    context parallelism adds per token and block
    (:func:`engine.planner.activations.cp_block_bytes_per_token`)."""
    if recompute == "full":  # one block per unit: its input, on the residual stream
        return param_bytes * model.hidden_size / (tp if tp > 1 else 1)
    return block_bytes_per_token(BlockDims.of(model), elem=param_bytes, tp=tp, sp=tp > 1,
                                 modules=policy_modules(recompute))[0] + cp_extra


def _tokens(model: ModelConfig, layout: Layout) -> int:
    """Tokens of one micro-batch on one rank: B·S/cp (each CP rank holds S/cp of every sequence)."""
    return layout.micro_batch * model.seq_len // layout.cp


def _cp_extra(model: ModelConfig, layout: Layout, param_bytes: float) -> float:
    return cp_block_bytes_per_token(model, layout.cp, layout.ulysses_size, layout.tp, int(param_bytes))


def activation_peaks(model: ModelConfig, layout: Layout, param_bytes: float = 2.0) -> list[float]:
    """Activation peak bytes of each pipeline rank (:mod:`engine.planner.activations`); a
    schedule's peak is reached within its first micro-batches, so it is walked at the
    simulated length (all of GPipe's)."""
    sched = "1f1b" if layout.schedule == "none" else layout.schedule
    m = layout.num_microbatches
    if sched != "gpipe":
        m = _sim_length(sched, layout.pp, m, layout.virtual_stages)
    a = ActivationShape(_tokens(model, layout), layout.tp, layout.tp > 1, int(param_bytes), layout.recompute,
                        _cp_extra(model, layout, param_bytes))
    pieces = [(s.blocks, s.has_head) for s in stage_shapes(model, layout.pp, layout.virtual_stages)]
    return inflight_peaks(model, a, sched, layout.pp, m, layout.virtual_stages, pieces)


def _ring(bytes_: float, n: int, bw: float, latency: float, factor: float) -> float:
    """``factor`` = 2 for all-reduce, 1 for reduce-scatter / all-gather."""
    if n <= 1 or bytes_ <= 0:
        return 0.0
    return factor * (n - 1) / n * bytes_ / bw + factor * (n - 1) * latency


def _dp_bandwidth(layout: Layout, cluster: Cluster) -> float:
    """The gradient group (cp x dp, ranks laid out tp, cp, dp, pp innermost first)."""
    return cluster.intra_node_bw if layout.tp * layout.grad_ranks <= cluster.gpus_per_node else cluster.inter_node_bw


def _pp_bandwidth(layout: Layout, cluster: Cluster) -> float:
    return cluster.intra_node_bw if layout.world_size <= cluster.gpus_per_node else cluster.inter_node_bw


def zero_state_bytes(numel: float, stage: int, dp: int, param_bytes: float = 2.0, *,
                     accumulating: bool = True) -> dict[str, float]:
    """Parameter / gradient / optimizer-state bytes per rank of ``numel`` elements under our
    ZeRO ``stage`` over ``dp`` ranks: :func:`engine.zero.memory.zero_state_bytes`, the one
    place with this engine's corrections to the paper's formula."""
    return engine_state_bytes(numel, stage, dp, param_bytes=param_bytes, accumulating=accumulating)


def _rank_states(model: ModelConfig, layout: Layout, shapes: list[StageShape], rank: int,
                 param_bytes: float) -> tuple[float, float, float]:
    """(params, grads, optimizer state) bytes of pipeline rank ``rank``."""
    n_params = _rank_params(model, _rank_pieces(layout, shapes, rank)) / layout.tp
    st = zero_state_bytes(n_params, layout.zero_stage, layout.grad_ranks, param_bytes,
                          accumulating=layout.num_microbatches > 1 or layout.pp > 1)
    return st["params"], st["grads"], st["optimizer_state"]


def model_states_bytes(model: ModelConfig, layout: Layout, *, param_bytes: float = 2.0) -> float:
    """Parameters + gradients + optimizer state on the most loaded pipeline rank."""
    shapes = stage_shapes(model, layout.pp, layout.virtual_stages)
    return max(sum(_rank_states(model, layout, shapes, r, param_bytes)) for r in range(layout.pp))


def memory_lower_bound(model: ModelConfig, layout: Layout, cluster: Cluster, *, param_bytes: float = 2.0) -> float:
    """A cheap lower bound of :func:`memory_estimate` (no simulation): the first pipeline
    rank holds at least ``min(pp, micro-batches)`` micro-batches of its blocks' activations
    under every schedule here (one chunk each with interleaving)."""
    shapes = stage_shapes(model, layout.pp, layout.virtual_stages)
    tokens = _tokens(model, layout)
    act = activation_bytes_per_token(model, layout.tp, param_bytes, layout.recompute,
                                     _cp_extra(model, layout, param_bytes))
    first = shapes[0].blocks * min(layout.pp, layout.num_microbatches) * tokens * act
    return max(model_states_bytes(model, layout, param_bytes=param_bytes), sum(
        _rank_states(model, layout, shapes, 0, param_bytes)) + first) + cluster.reserved_bytes


def memory_estimate(model: ModelConfig, layout: Layout, cluster: Cluster, *, param_bytes: float = 2.0,
                    inflight: Optional[list[int]] = None) -> MemoryEstimate:
    """Bytes per device on the stage that needs most (activations: :func:`activation_peaks`).
    ``inflight[k]``: micro-batch chunks pipeline rank k holds at its peak, reported in the
    breakdown (default: the simulator's count)."""
    shapes = stage_shapes(model, layout.pp, layout.virtual_stages)
    if inflight is None:
        inflight = list(_simulate(model, layout, cluster, param_bytes).peak_activations)
    peaks = activation_peaks(model, layout, param_bytes)
    per_block_params = reference_layer_params(model)[1]
    best: Optional[MemoryEstimate] = None
    for rank in range(layout.pp):
        params, grads, opt = _rank_states(model, layout, shapes, rank, param_bytes)
        acts, logits = peaks[rank], 0.0
        transient = 0.0
        if layout.zero_stage == 3:  # current + prefetched block gathered, and the block's fp32 grads
            transient = per_block_params / layout.tp * (2 * param_bytes + 4)
        est = MemoryEstimate(params, grads, opt, acts, logits, transient,
                             cluster.reserved_bytes, inflight[rank], rank)
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    return best


def _piece_costs(model: ModelConfig, layout: Layout, cluster: Cluster, param_bytes: float) -> list[tuple]:
    """Per pipeline piece: (forward s, backward s, compute s, tp comm s, zero3 exposed s,
    cp comm s). Every rank computes its B·S/cp tokens (the head-tail shards balance the
    causal attention exactly, so the attention FLOPs split by cp as well)."""
    h, s, tp = model.hidden_size, model.seq_len, layout.tp
    tokens = _tokens(model, layout)
    rate = cluster.peak_flops * cluster.compute_efficiency
    f_block = 2 * _block_matmul_params(model) + 4 * s * h  # forward FLOPs per token per block
    f_head = 2 * model.vocab_size * h
    act_bytes = tokens * h * param_bytes  # one full (unsharded) activation
    # 2 all-reduces per block forward (attention out, MLP out) = 2 AG + 2 RS with sequence parallelism
    tp_fwd_block = 2 * _ring(act_bytes, tp, cluster.intra_node_bw, cluster.latency_s, 2.0)
    # selective recompute reruns only elementwise ops (zero GEMM FLOPs): memory-bound, the bytes
    # it frees written again and read once more, at the device's memory bandwidth
    rewrite = 0.0
    if layout.recompute == "selective":
        freed = (activation_bytes_per_token(model, tp, param_bytes) -
                 activation_bytes_per_token(model, tp, param_bytes, "selective"))
        rewrite = 2 * freed / cluster.hbm_bw
    cp_f_block, cp_b_block = cp_comm_seconds(model, layout, cluster, param_bytes)
    out = []
    for piece in stage_shapes(model, layout.pp, layout.virtual_stages):
        fwd_flops = tokens * (piece.blocks * f_block + (f_head if piece.has_head else 0)) / tp
        c_f = fwd_flops / rate
        rerun = recompute_forward_fraction(layout.recompute)  # of each block's forward, rerun in backward
        c_b = 2 * c_f + rerun * piece.blocks * tokens * f_block / tp / rate + piece.blocks * tokens * rewrite
        tp_f = piece.blocks * tp_fwd_block + (tp_fwd_block / 2 if piece.has_embedding else 0.0)
        tp_b = tp_f + rerun * piece.blocks * tp_fwd_block
        cp_f = piece.blocks * cp_f_block
        cp_b = piece.blocks * (cp_b_block + rerun * cp_f_block)  # a recomputed attention communicates again
        z3_f = z3_b = 0.0
        if layout.zero_stage == 3 and layout.grad_ranks > 1:  # gathered in forward and again in backward
            g = _ring(piece.params / tp * param_bytes, layout.grad_ranks, _dp_bandwidth(layout, cluster),
                      cluster.latency_s, 1.0)
            z3_f = max(0.0, g - cluster.comm_overlap * c_f)
            z3_b = max(0.0, g - cluster.comm_overlap * c_b)
        out.append((c_f + tp_f + z3_f + cp_f, c_b + tp_b + z3_b + cp_b, c_f + c_b, tp_f + tp_b, z3_f + z3_b,
                    cp_f + cp_b))
    return out


def _sim_length(schedule: str, p: int, m: int, v: int) -> int:
    """The micro-batch count simulated: ``m`` up to ``max(p + 2, 8)``, else that (the
    steady state is reached after p micro-batches; the rest is extrapolated), rounded up to
    a multiple of p for interleaved 1F1B."""
    n = max(p + 2, SIM_MICROBATCH_MIN, 2 * p if schedule == "dualpipe-v" else 0)  # dualpipe-v: m >= 2p
    if m <= n:
        return m
    if schedule == "interleaved-1f1b":
        n = -(-n // p) * p
    return min(n, m)


@functools.lru_cache(maxsize=4096)
def _sim_cached(schedule: str, p: int, m: int, v: int, fwd: tuple, bwd: tuple, comm: float):
    placement = placement_of(schedule)
    return simulate(build_all(schedule, p, m, v), m, v, costs=per_stage_costs(fwd, bwd, p, placement),
                    comm_cost=comm, placement=placement)


def _round(x: float) -> float:
    return float(f"{x:.3g}")


@dataclass(frozen=True)
class _Sim:
    """A simulation result in seconds (the cached run is in units of the largest forward)."""

    makespan: float
    bubble_fraction: float
    busy: tuple[float, ...]
    peak_activations: tuple[int, ...]


def _simulate(model: ModelConfig, layout: Layout, cluster: Cluster, param_bytes: float,
              m_sim: Optional[int] = None) -> _Sim:
    """The schedule simulated at ``m_sim`` (default ``_sim_length``) micro-batches with this
    layout's costs, normalised by the largest forward so that layouts differing only in
    scale (micro-batch size, bandwidths) share one simulation."""
    p, v = layout.pp, layout.virtual_stages
    sched = "1f1b" if layout.schedule == "none" else layout.schedule
    costs = _piece_costs(model, layout, cluster, param_bytes)
    unit = max(c[0] for c in costs) or 1.0
    fwd = tuple(_round(c[0] / unit) for c in costs)
    bwd = tuple(_round(c[1] / unit) for c in costs)
    comm = _round(_p2p_seconds(model, layout, cluster, param_bytes) / unit) if p > 1 else 0.0
    if m_sim is None:
        m_sim = _sim_length(sched, p, layout.num_microbatches, v)
    res = _sim_cached(sched, p, m_sim, v, fwd, bwd, comm)
    peak = res.peak_activations
    if sched == "gpipe" and m_sim < layout.num_microbatches:  # gpipe holds every micro-batch
        peak = tuple(layout.num_microbatches for _ in peak)
    return _Sim(res.makespan * unit, res.bubble_fraction, tuple(b * unit for b in res.busy), peak)


def _p2p_seconds(model: ModelConfig, layout: Layout, cluster: Cluster, param_bytes: float) -> float:
    """One activation (or its gradient) across a stage boundary: (micro, S/(cp·tp), H)."""
    bytes_ = _tokens(model, layout) * model.hidden_size * param_bytes / layout.tp
    return bytes_ / _pp_bandwidth(layout, cluster) + cluster.latency_s


def pipeline_makespan(model: ModelConfig, layout: Layout, cluster: Cluster, param_bytes: float = 2.0
                      ) -> tuple[float, float, tuple[float, ...]]:
    """(makespan s, bubble fraction, busy s per rank) of the forward/backward part of a step
    with ``num_microbatches``. Beyond the simulated length ``n`` the pipeline is in steady
    state: the makespan grows by the pace measured between simulations of ``n`` and
    ``n + pp`` micro-batches (whatever sets it: the slowest stage or the transfers), and
    each rank's busy time by its per-micro-batch work."""
    m = layout.num_microbatches
    sched = "1f1b" if layout.schedule == "none" else layout.schedule
    n = _sim_length(sched, layout.pp, m, layout.virtual_stages)
    res = _simulate(model, layout, cluster, param_bytes, n)
    if n == m:
        return res.makespan, res.bubble_fraction, res.busy
    n2 = min(n + layout.pp, m)
    res2 = _simulate(model, layout, cluster, param_bytes, n2)
    pace = (res2.makespan - res.makespan) / (n2 - n)
    makespan = res2.makespan + (m - n2) * pace
    busy = tuple(b / n * m for b in res.busy)
    return makespan, max(0.0, bubble_fraction(busy, makespan)), busy


def time_estimate(model: ModelConfig, layout: Layout, cluster: Cluster, *, param_bytes: float = 2.0
                  ) -> TimeEstimate:
    """Predicted time of one optimizer step (see the module docstring)."""
    costs = _piece_costs(model, layout, cluster, param_bytes)
    p, v, m = layout.pp, layout.virtual_stages, layout.num_microbatches
    makespan, bubble_frac, busy = pipeline_makespan(model, layout, cluster, param_bytes)
    worst = max(range(p), key=lambda r: busy[r])
    sched = "1f1b" if layout.schedule == "none" else layout.schedule
    chunks = [costs[stage_index(sched, worst, c, p, v)] for c in range(v)]
    compute = m * sum(c[2] for c in chunks)
    tp_comm = m * sum(c[3] for c in chunks)
    z3 = m * sum(c[4] for c in chunks)
    cp_comm = m * sum(c[5] for c in chunks)
    pp_comm = (2 * m * _p2p_seconds(model, layout, cluster, param_bytes)) if p > 1 else 0.0
    bubble = max(makespan - busy[worst], 0.0)
    # data-parallel gradient reduction (fp32) and parameter gather (compute dtype)
    shapes = stage_shapes(model, p, v)
    n_local = max(_rank_params(model, _rank_pieces(layout, shapes, r)) for r in range(p)) / layout.tp
    bw = _dp_bandwidth(layout, cluster)
    n_grad = layout.grad_ranks  # gradients are reduced (and partitioned) over cp x dp
    if layout.zero_stage == 0:
        dp = _ring(4 * n_local, n_grad, bw, cluster.latency_s, 2.0)
    else:
        dp = _ring(4 * n_local, n_grad, bw, cluster.latency_s, 1.0)
        if layout.zero_stage in (1, 2):
            dp += _ring(param_bytes * n_local, n_grad, bw, cluster.latency_s, 1.0)
    last_backward = sum(c[1] for c in chunks)  # the last micro-batch's backward on this rank
    dp_exposed = max(0.0, dp - cluster.comm_overlap * last_backward)
    master = n_local / (n_grad if layout.zero_stage >= 1 else 1)
    optimizer = ADAM_STEP_BYTES * master / cluster.hbm_bw
    step = makespan + dp_exposed + optimizer
    tokens = layout.dp * m * layout.micro_batch * model.seq_len
    tps = tokens / step
    mfu = flops_per_token(model) * tps / (cluster.peak_flops * layout.world_size)
    return TimeEstimate(step, compute, tp_comm, pp_comm, z3, bubble, bubble_frac, dp_exposed, optimizer, tps, mfu,
                        cp_comm_s=cp_comm)


def check_layout(model: ModelConfig, layout: Layout, cluster: Cluster) -> list[str]:
    """Structural reasons this layout cannot run (empty: it can)."""
    why = []
    if layout.world_size != cluster.world_size:
        why.append(f"dp*tp*pp*cp = {layout.world_size} but the cluster has {cluster.world_size} devices")
    if layout.tp > cluster.gpus_per_node:
        why.append(f"tp={layout.tp} > {cluster.gpus_per_node} devices per node (TP must stay inside a node)")
    try:
        model.check_parallel(layout.tp, layout.pp * layout.virtual_stages)
    except ConfigError as exc:
        why.append(str(exc).split(":")[0])
    if layout.zero_stage not in (0, 1, 2, 3):
        why.append(f"ZeRO stage {layout.zero_stage} is not 0-3")
    if layout.pp == 1 and layout.schedule != "none":
        why.append("a schedule needs pp > 1")
    if layout.pp > 1:
        if layout.schedule not in SCHEDULES:
            why.append(f"unknown schedule {layout.schedule!r}")
        else:
            try:
                check_schedule_args(layout.schedule, 0, layout.pp, layout.num_microbatches, layout.virtual_stages)
            except ConfigError as exc:
                why.append(str(exc))
    if layout.tp > 1 and model.seq_len % layout.tp:
        why.append(f"sequence parallelism needs seq_len ({model.seq_len}) divisible by tp={layout.tp}")
    if layout.cp > 1:  # the engine's own check of the context_parallel section against the model
        from engine.config.context_parallel import check_context_parallel
        from engine.config.schema import ContextParallelConfig

        try:
            check_context_parallel(ContextParallelConfig(layout.cp, layout.cp_mode, layout.ulysses_size), model,
                                   layout.tp, layout.tp > 1)
        except ConfigError as exc:
            why.append(str(exc).split(":")[0])
    return why



def peak_estimate(model: ModelConfig, layout: Layout, *, param_bytes: float = 2.0, bucket_numel: int = 500_000_000,
                  prefetch_numel: int = 50_000_000, torch_adam: bool = False,
                  first_step: bool = False) -> dict[str, float]:
    """Predicted per-rank PEAK bytes during a step, on the pipeline rank that needs most, by
    term:

    - ``states`` and the step-only terms of :func:`engine.zero.memory.zero_peak_formula`
      (three pooled fp32 buckets and two receive shards at stages 2/3; the largest
      parameter's gradient in flight, three
      copies of a tied embedding summed by autograd, two at stage 3, which takes each use's
      contribution apart; at stage 3 the gathered unit (the tied embedding's owner
      included) and the prefetch window);
    - ``activations``: :func:`activation_peaks` (the layout's recompute policy, the
      micro-batch chunks the schedule keeps in flight on the rank, the logits and the
      backward's working set).

    ``bucket_numel``: ``reduce_bucket_size`` (or the largest bucket when a single parameter
    is larger; in fp32 the pooled buckets are the multi-parameter ones); ``prefetch_numel``: ``stage3_prefetch_bucket_size``; ``torch_adam``: the
    inner optimizer is torch's AdamW (a master-sized temporary in the step) rather than the
    fused kernel. Backward transients and the step's temporary do not coexist. The default is
    the steady state (every step after the first; what decides whether a run fits);
    ``first_step``: the first step's peak, in which Adam's moments appear only in the
    update. Measured against ``benchmarks/memory.py`` (tests/unit/test_planner_peak.py)."""
    from engine.zero.memory import zero_peak_formula

    shapes = stage_shapes(model, layout.pp, layout.virtual_stages)
    peaks = activation_peaks(model, layout, param_bytes)
    vh = model.vocab_size * model.hidden_size // layout.tp
    h, f = model.hidden_size, model.ffn_size
    largest_block_unit = max(2 * f * h, (h + 2 * model.kv_heads * model.head_dim) * h) // layout.tp
    best: Optional[dict[str, float]] = None
    for rank in range(layout.pp):
        mine = _rank_pieces(layout, shapes, rank)
        numel = _rank_params(model, mine) / layout.tp
        has_embed = rank == 0
        has_head = any(s.has_head for s in mine)
        tied_here = model.tie_embeddings and has_embed and has_head
        largest = vh if (has_embed or has_head) else largest_block_unit
        pooled = min(int(bucket_numel), max(int(numel), largest)) if layout.zero_stage >= 1 else 0
        # the gradient of a one-parameter bucket is reduced where autograd left it (fp32) or
        # through its own fp32 copy (bf16/fp16; engine.zero.base): only buckets of several
        # parameters use the pool; at stage 3 those hold just the small persistent ones (the norms)
        pooled = min(pooled, (2 * model.num_layers + 1) * h if layout.zero_stage == 3 else int(numel))
        out = zero_peak_formula(int(numel), layout.zero_stage, layout.grad_ranks, param_bytes=int(param_bytes),
                                bucket_numel=pooled,
                                accumulating=layout.num_microbatches > 1 or layout.pp > 1,
                                largest_param_numel=largest,
                                unit_numel=largest_block_unit if tied_here else largest,  # the tied one counts below
                                prefetch_numel=int(prefetch_numel) if layout.zero_stage == 3 else 0,
                                tied_numel=vh if tied_here else 0, activation_bytes=peaks[rank],
                                torch_adam=torch_adam, first_step=first_step)
        if best is None or out["peak"] > best["peak"]:
            best = out
    assert best is not None
    return best


def layout_peak_bytes(model: ModelConfig, layout: Layout, cluster: Cluster, *, param_bytes: float = 2.0) -> float:
    """What the planner's search ranks and rejects by: :func:`peak_estimate` (activations by
    the schedule's own compute order), DeepSpeed's default bucket sizes, the fused Adam (no
    step temporary), plus the cluster's reserved bytes."""
    peak = peak_estimate(model, layout, param_bytes=param_bytes)["peak"]
    return peak + cluster.reserved_bytes
