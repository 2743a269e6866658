"""The planner's context-parallel time model: the seconds one block's CP communication adds
to a micro-batch's forward and backward on the critical path (used by engine.planner.cost)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from engine.models.config import ModelConfig
from engine.planner.cluster import Cluster

if TYPE_CHECKING:
    from engine.planner.cost import Layout

__all__ = ["cp_comm_seconds"]


def _cp_bandwidth(layout: Layout, cluster: Cluster) -> float:
    """A CP group: its ranks are tp apart inside one data replica."""
    return cluster.intra_node_bw if layout.tp * layout.cp <= cluster.gpus_per_node else cluster.inter_node_bw


def cp_comm_seconds(model: ModelConfig, layout: Layout, cluster: Cluster, param_bytes: float = 2.0
                    ) -> tuple[float, float]:
    """(forward, backward) seconds of one block's context-parallel communication on the
    critical path, per micro-batch (0 without CP). Per rank, B micro-batch rows, T = B·S/C
    local tokens, g = kv_heads·d / t and a = heads·d / t per TP rank, e bytes:

    - ring (engine.context_parallel.ring): C−1 hops forward, each one K/V block (2·T·g·e)
      and its positions/document ids (16·T); backward C−1 K/V hops and C fp32 dK/dV
      accumulator hops (2·T·g·4). Each hop is posted before the block it overlaps is
      computed, so the hops hide behind the attention's own causal FLOPs (forward 2·T·S·a·d,
      backward twice that; the head-tail shards give every rank the same share) up to the
      cluster's ``comm_overlap``, except behind the last block; the backward's last dK/dV
      hop, sent after the last block, is exposed;
    - Ulysses (engine.context_parallel.ulysses): four all-to-alls forward (q, k, v, o) and
      four backward (dO, dq, dk, dv), each sending (U−1)/U of its tensor (k, v repeated to
      lcm(kv heads, U) when U does not divide them), plus the positions' all-gather; on
      the critical path (the attention waits for them).

    The CP group's ranks are tp apart in one data replica: intra-node while tp·cp fits a node."""
    c = layout.cp
    if c == 1:
        return 0.0, 0.0
    t, e = layout.tp, param_bytes
    tokens = layout.micro_batch * model.seq_len // c  # B·S/C on this rank
    bw, lat = _cp_bandwidth(layout, cluster), cluster.latency_s
    d = model.head_dim
    a, kv = model.num_heads // t, max(1, model.kv_heads // t)
    if layout.cp_mode == "ring":
        rate = cluster.peak_flops * cluster.compute_efficiency
        # this rank's share of the causal attention: its T queries against the S/2 keys a
        # causal mask leaves on average (QK^T and PV, 2 FLOPs per multiply-add)
        attn_f = 2 * tokens * model.seq_len * a * d / rate
        kv_hop = (2 * tokens * kv * d * e + 16 * tokens) / bw + lat
        acc_hop = 2 * tokens * kv * d * 4 / bw + lat
        behind = (c - 1) / c  # no transfer behind the last block's compute
        fwd = max(0.0, (c - 1) * kv_hop - cluster.comm_overlap * attn_f * behind)
        # backward: each K/V hop and the accumulator hop before it hide behind a block's
        # backward (twice its forward); the last accumulator hop, sent after the last block,
        # is waited on with nothing left to overlap
        bwd = max(0.0, (c - 1) * (kv_hop + acc_hop) - cluster.comm_overlap * 2 * attn_f * behind) + acc_hop
        return fwd, bwd
    u = layout.ulysses_size
    kv_u = kv if kv % u == 0 else math.lcm(kv, u)
    frac = (u - 1) / u

    def a2a(width: int) -> float:  # one all-to-all of a (T, width·d) tensor
        return frac * tokens * width * d * e / bw + (u - 1) * lat

    fwd = 2 * a2a(a) + 2 * a2a(kv_u) + (u - 1) * (16 * tokens / bw + lat)  # q, o; k, v; positions
    return fwd, 2 * a2a(a) + 2 * a2a(kv_u)
