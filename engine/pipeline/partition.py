"""Layers to pipeline stages (pure).

The model is a list of layers ``[embedding, block_1 .. block_N, head]`` (the head carries
the loss). :func:`partition_layers` cuts it into ``num_parts`` contiguous pieces
(``num_parts = pp * virtual_stages``; piece ``k`` is virtual stage ``k``, i.e. chunk
``k // pp`` of rank ``k % pp`` in the loop placement; :func:`layers_of` takes the placement) and returns the boundaries: piece ``k`` holds layers
``bounds[k]:bounds[k+1]``. Every piece is non-empty and contiguous, so the embedding is
always on the first stage and the head on the last.

Methods (``pipeline.partition`` and PipelineModule's ``partition_method``; the names and
their meanings are one table, :data:`engine.config.sections.PARTITION_METHODS`):

- ``parameters``: balance the parameter counts - the partition whose largest piece is
  smallest, and among those the most even one (least sum of squares);
- ``uniform``: DeepSpeed's ``partition_uniform``: equal numbers of layers, the first
  ``n % parts`` pieces one more (the embedding and the head count as layers);
- ``blocks``: Megatron's: the N blocks split as evenly as possible (the first pieces take
  the remainder); the embedding joins the first piece and the head the last.

A :class:`engine.pipe.PipelineModule` cuts as DeepSpeed's does: ``uniform`` as above, and
``parameters`` / ``type:<regex>`` (layers weighed by class name) with
:func:`partition_balanced`, DeepSpeed's ``partition_balanced`` (the least spread between the
heaviest and the lightest piece, by its dynamic programme and tie rule), so a zero-parameter
layer lands where DeepSpeed puts it.
"""

from __future__ import annotations

from typing import Sequence

from engine.config.sections import CONFIG_PARTITION_METHODS, PARTITION_METHODS
from engine.errors import ConfigError
from engine.pipeline.actions import virtual_stage
from engine.validate import check_int

__all__ = ["PARTITION_METHODS", "partition_layers", "partition_balanced", "partition_uniform", "part_sizes", "layers_of"]


def _check(layer_params: Sequence[int], num_parts: int) -> None:
    check_int("num_parts (pipeline stages x virtual stages)", num_parts, minimum=1)
    if len(layer_params) < 1:
        raise ConfigError("cannot partition an empty list of layers")
    for i, n in enumerate(layer_params):
        check_int(f"layer {i}: parameter count", n, minimum=0)


def _blocks(num_layers: int, num_parts: int) -> list[int]:
    if num_parts == 1:
        return [0, num_layers]
    blocks = num_layers - 2  # everything between the embedding and the head
    if blocks < num_parts:
        raise ConfigError(
            f"the blocks partition needs at least one block per pipeline piece: the model has "
            f"{blocks} blocks (besides embedding and head) for {num_parts} pieces "
            f"(pipeline stages x virtual stages); use more layers or fewer stages/virtual stages")
    base, extra = divmod(blocks, num_parts)
    bounds = [0]
    for k in range(num_parts):
        bounds.append(bounds[-1] + base + (k < extra))
    bounds = [b + 1 for b in bounds]  # shift past the embedding ...
    bounds[0] = 0  # ... which joins the first piece
    bounds[-1] = num_layers  # and the head joins the last
    return bounds


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed's ``partition_uniform``: ``num_parts`` pieces of ``num_items // num_parts``
    items, the first ``num_items % num_parts`` pieces one more (fewer items than pieces: the
    last pieces are empty, as DeepSpeed's; :func:`partition_layers` refuses that case)."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    base, extra = divmod(num_items, num_parts)
    return [p * base + min(p, extra) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[int], num_parts: int) -> list[int]:
    """DeepSpeed's ``partition_balanced`` (deepspeed/runtime/utils.py), the same boundaries:
    a dynamic programme over prefixes keeping, for ``i`` layers in ``j`` pieces, the split
    with the least spread (heaviest minus lightest piece) and on a tie the latest last cut.
    Its spread is not decomposable, so this is DeepSpeed's heuristic, not an optimum; it is
    what a DeepSpeed script's ``partition_method="parameters"`` gets. ``len(weights) <=
    num_parts``: :func:`partition_uniform`. Sums are float64, as DeepSpeed's numpy arrays."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = float("inf")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    # hi/lo/cost[i][j]: heaviest, lightest piece and spread of the kept split of i layers in j pieces
    hi = [[inf] * (m + 1) for _ in range(n + 1)]
    lo = [[inf] * (m + 1) for _ in range(n + 1)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    cut = [[0] * (m + 1) for _ in range(n + 1)]
    hi[0][0] = cost[0][0] = 0.0  # (lo[0][0] stays inf, as in DeepSpeed)
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                piece = prefix[i] - prefix[k]
                top, bottom = max(hi[k][j - 1], piece), min(lo[k][j - 1], piece)
                c = top - bottom
                if cost[i][j] >= c:  # ">=": a tie moves the cut later, as DeepSpeed's
                    cost[i][j], hi[i][j], lo[i][j], cut[i][j] = c, top, bottom, k
    bounds = [n]
    for j in range(m, 0, -1):
        bounds.append(cut[bounds[-1]][j])
    return bounds[::-1]


def _balanced(layer_params: Sequence[int], num_parts: int) -> list[int]:
    n = len(layer_params)
    prefix = [0]
    for c in layer_params:
        prefix.append(prefix[-1] + c)
    inf = (float("inf"), float("inf"))
    # best[k][i]: (largest piece, sum of squares) splitting layers[:i] into k pieces
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = (0, 0)
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                prev = best[k - 1][j]
                if prev[0] == float("inf"):
                    continue
                piece = prefix[i] - prefix[j]
                cand = (max(prev[0], piece), prev[1] + piece * piece)
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    bounds = [n]
    for k in range(num_parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def partition_layers(layer_params: Sequence[int], num_parts: int, method: str = "parameters") -> list[int]:
    """Boundaries ``[0, b_1, ..., n]`` of ``num_parts`` contiguous, non-empty pieces.

    ``layer_params[i]`` is layer i's parameter count; layer 0 is the embedding and the
    last layer the head (they stay on the first and last piece).
    """
    _check(layer_params, num_parts)
    n = len(layer_params)
    if method not in CONFIG_PARTITION_METHODS:
        raise ConfigError(f"unknown pipeline.partition {method!r}: choose one of {', '.join(CONFIG_PARTITION_METHODS)}")
    if n < num_parts:
        raise ConfigError(f"cannot cut {n} layers into {num_parts} pipeline pieces (pipeline stages x "
                          f"virtual stages): every piece needs a layer; use fewer stages or more layers")
    if method == "blocks":
        return _blocks(n, num_parts)
    if method == "uniform":
        return partition_uniform(n, num_parts)
    return _balanced(layer_params, num_parts)


def part_sizes(layer_params: Sequence[int], bounds: Sequence[int]) -> list[int]:
    """Parameter count of each piece."""
    return [sum(layer_params[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def layers_of(bounds: Sequence[int], stage: int, num_stages: int, chunk: int = 0, placement: str = "loop") -> range:
    """Layer indices of ``chunk`` on pipeline rank ``stage``: piece ``virtual_stage(stage, chunk)``
    under the schedule's ``placement`` (``chunk*pp + stage`` for the loop, V: ``2p-1-stage`` on chunk 1;
    :func:`engine.pipeline.schedule.stage_index`)."""
    k = virtual_stage(stage, chunk, num_stages, placement)
    if not 0 <= k < len(bounds) - 1:
        raise ConfigError(f"stage {stage} chunk {chunk} is outside the {len(bounds) - 1} pieces")
    return range(bounds[k], bounds[k + 1])
