"""A recorded pipeline step as numbers and pictures.

Input: per pipeline rank, the :class:`~engine.pipeline.executor.ActionRecord` list of one
step (``executor.records``; gather them to one rank, e.g. with
``dist.gather_object``). Times are ``time.perf_counter()`` seconds, one clock for all
processes on a host (CLOCK_MONOTONIC on Linux); across hosts align them first.

- :func:`measured_bubble`: idle fraction of the ranks over the step.
- :func:`chrome_trace`: Chrome trace / Perfetto JSON (one process row per stage).
- :func:`write_gantt_png`: stage x time chart, forward / backward / idle coloured; with
  matplotlib when installed, else a plain raster written by a tiny PNG encoder.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any, Optional, Sequence

from engine.pipeline.simulate import bubble_fraction

__all__ = ["COMPUTE_KINDS", "measured_bubble", "step_span", "chrome_trace", "write_chrome_trace",
           "write_gantt_png", "write_png"]

COMPUTE_KINDS = ("F", "B", "I", "W")
# (r, g, b) per kind; idle is the background
_COLOURS = {"F": (66, 133, 244), "B": (52, 168, 83), "I": (251, 188, 5), "W": (171, 71, 188)}
_IDLE = (235, 235, 235)
_NAMES = {"F": "forward", "B": "backward", "I": "backward (input grad)", "W": "backward (weight grad)"}


def _attr(r: Any, name: str) -> Any:
    return r[name] if isinstance(r, dict) else getattr(r, name)


def step_span(per_rank: Sequence[Sequence[Any]]) -> tuple[float, float]:
    """(first start, last end) over every rank's compute records."""
    spans = [(_attr(r, "start"), _attr(r, "end")) for recs in per_rank for r in recs
             if _attr(r, "kind") in COMPUTE_KINDS]
    if not spans:
        raise ValueError("no compute records: run a step with record=True first")
    return min(s for s, _ in spans), max(e for _, e in spans)


def measured_bubble(per_rank: Sequence[Sequence[Any]]) -> float:
    """1 - (compute time summed over ranks) / (ranks x step span)."""
    t0, t1 = step_span(per_rank)
    busy = [sum(_attr(r, "end") - _attr(r, "start") for r in recs if _attr(r, "kind") in COMPUTE_KINDS)
            for recs in per_rank]
    return bubble_fraction(busy, t1 - t0)


def chrome_trace(per_rank: Sequence[Sequence[Any]], title: str = "pipeline step") -> dict:
    """Trace-event JSON: a process per stage, thread 0 compute, thread 1 comm and waits."""
    t0, _ = step_span(per_rank)
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": title}}]
    for stage, recs in enumerate(per_rank):
        pid = stage + 1
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"stage {stage}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": stage}})
        for r in recs:
            kind = _attr(r, "kind")
            events.append({
                "name": _attr(r, "name"), "cat": kind, "ph": "X", "pid": pid,
                "tid": 0 if kind in COMPUTE_KINDS else 1,
                "ts": (_attr(r, "start") - t0) * 1e6, "dur": max((_attr(r, "end") - _attr(r, "start")) * 1e6, 0.01),
                "args": {"microbatch": _attr(r, "microbatch"), "chunk": _attr(r, "chunk")},
            })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(per_rank: Sequence[Sequence[Any]], path: str, title: str = "pipeline step") -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(per_rank, title), f)


# ------------------------------------------------------------------ PNG
def write_png(path: str, pixels: Sequence[Sequence[tuple[int, int, int]]]) -> None:
    """Write rows of (r, g, b) as an 8-bit RGB PNG (no dependencies)."""
    height, width = len(pixels), len(pixels[0])
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in pixels)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    with open(path, "wb") as f:
        f.write(png)


def _raster(per_rank: Sequence[Sequence[Any]], width: int = 1200, row: int = 40, gap: int = 8) -> list:
    t0, t1 = step_span(per_rank)
    scale = (width - 1) / (t1 - t0)
    white = (255, 255, 255)
    pixels = []
    for recs in per_rank:
        line = [_IDLE] * width
        for r in recs:
            kind = _attr(r, "kind")
            if kind in COMPUTE_KINDS:
                a = int((_attr(r, "start") - t0) * scale)
                b = max(int((_attr(r, "end") - t0) * scale), a + 1)
                for x in range(a, min(b, width)):
                    line[x] = _COLOURS[kind] if x < b - 1 or b - a < 3 else white  # 1px seam between actions
        pixels += [list(line) for _ in range(row)] + [[white] * width for _ in range(gap)]
    return pixels


def write_gantt_png(per_rank: Sequence[Sequence[Any]], path: str, title: Optional[str] = None) -> str:
    """Stage x time chart of the step. Returns "matplotlib" or "raw" (which writer was used)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        write_png(path, _raster(per_rank))
        return "raw"
    t0, t1 = step_span(per_rank)
    p = len(per_rank)
    fig, ax = plt.subplots(figsize=(12, 0.6 * p + 1.4))
    seen = set()
    for stage, recs in enumerate(per_rank):
        ax.broken_barh([(0, (t1 - t0) * 1e3)], (stage - 0.4, 0.8), facecolors=[tuple(c / 255 for c in _IDLE)])
        for r in recs:
            kind = _attr(r, "kind")
            if kind not in COMPUTE_KINDS:
                continue
            s, e = (_attr(r, "start") - t0) * 1e3, (_attr(r, "end") - t0) * 1e3
            label = None if kind in seen else _NAMES[kind]
            seen.add(kind)
            ax.broken_barh([(s, e - s)], (stage - 0.4, 0.8), facecolors=[tuple(c / 255 for c in _COLOURS[kind])],
                           edgecolor="white", linewidth=0.5, label=label)
            if e - s > 0.03 * (t1 - t0) * 1e3:
                ax.text((s + e) / 2, stage, _attr(r, "name"), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title or f"pipeline step, bubble {measured_bubble(per_rank):.3f}")
    ax.legend(loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return "matplotlib"
