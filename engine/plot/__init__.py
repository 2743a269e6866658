"""A loss curve from a run's ``metrics.jsonl``, with no plotting dependency required.

    python -m engine.plot runs/default                 # writes runs/default/loss.png (matplotlib)
                                                       # or runs/default/loss.svg, and a text plot
    python -m engine.plot runs/default --key grad_norm --out gn.svg

:func:`read_series` reads one field per optimizer step (a torn last line, as a kill during a
write leaves, is skipped; any other bad line is an error naming the file and line);
:func:`svg_plot` and :func:`text_plot` draw it with the standard library only;
:func:`png_plot` uses matplotlib when it is installed (it is not a dependency).
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional, Sequence
from xml.sax.saxutils import escape

__all__ = ["read_series", "svg_plot", "text_plot", "png_plot", "metrics_path", "write_plot", "default_out",
           "PlotError"]


class PlotError(ValueError):
    """The run's metrics cannot be plotted (missing file, bad line, no such field)."""


def metrics_path(run: str) -> str:
    """``run`` is an output folder (its ``metrics.jsonl``) or the file itself."""
    path = os.path.join(run, "metrics.jsonl") if os.path.isdir(run) else run
    if not os.path.isfile(path):
        raise PlotError(f"{path}: no such file (give a run's --output folder or its metrics.jsonl)")
    return path


def read_series(path: str, key: str = "loss") -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` from a metrics.jsonl; non-finite values and steps without the
    key are left out (a skipped step's NaN loss would hide the curve)."""
    with open(path, encoding="utf-8") as f:
        lines = [(i, line) for i, line in enumerate(f.read().split("\n"), 1) if line.strip()]
    steps: list[int] = []
    values: list[float] = []
    for n, (i, line) in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if n == len(lines):
                continue  # the torn last line of a run killed mid-write
            raise PlotError(f"{path}, line {i}: not JSON ({exc.msg})") from None
        if not isinstance(rec, dict):
            raise PlotError(f"{path}, line {i}: not a JSON object (one per optimizer step)")
        v = rec.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(int(rec.get("step", len(steps) + 1)))
            values.append(float(v))
    if not values:
        raise PlotError(f"{path}: no finite '{key}' values to plot")
    return steps, values


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    return [lo + (hi - lo) * k / (n - 1) for k in range(n)]


def svg_plot(steps: Sequence[int], values: Sequence[float], title: str = "loss",
             width: int = 640, height: int = 400) -> str:
    """A self-contained SVG line plot (axes, 5 ticks each, the title)."""
    left, right, top, bottom = 64, 16, 32, 40
    x0, x1 = min(steps), max(steps)
    y0, y1 = min(values), max(values)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    pw, ph = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return top + (y1 - y) / (y1 - y0) * ph

    pts = " ".join(f"{px(s):.1f},{py(v):.1f}" for s, v in zip(steps, values))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="20" text-anchor="middle">{escape(title)}</text>',
           f'<line x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + ph}" stroke="black"/>']
    for t in _ticks(y0, y1):
        out.append(f'<text x="{left - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{t:.4g}</text>')
        out.append(f'<line x1="{left}" y1="{py(t):.1f}" x2="{left + pw}" y2="{py(t):.1f}" stroke="#ddd"/>')
    for t in _ticks(x0, x1):
        out.append(f'<text x="{px(t):.1f}" y="{top + ph + 16}" text-anchor="middle">{t:.0f}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 6}" text-anchor="middle">step</text>')
    out.append(f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{pts}"/>')
    out.append("</svg>\n")
    return "\n".join(out)


def text_plot(steps: Sequence[int], values: Sequence[float], width: int = 60, height: int = 12) -> str:
    """A terminal plot: ``height`` rows of ``width`` columns, each column the mean of its steps."""
    n = len(values)
    cols = min(width, n)
    buckets = [values[c * n // cols:(c + 1) * n // cols] for c in range(cols)]
    means = [sum(b) / len(b) for b in buckets]
    lo, hi = min(means), max(means)
    span = (hi - lo) or 1.0
    rows = [[" "] * cols for _ in range(height)]
    for c, m in enumerate(means):
        rows[height - 1 - round((m - lo) / span * (height - 1))][c] = "*"
    label = [f"{hi:>10.4g} |"] + [" " * 10 + " |"] * (height - 2) + [f"{lo:>10.4g} |"]
    lines = [lab + "".join(r) for lab, r in zip(label, rows)]
    lines.append(" " * 11 + "+" + "-" * cols)
    lines.append(" " * 12 + f"step {steps[0]}" + f"step {steps[-1]}".rjust(max(0, cols - len(f"step {steps[0]}"))))
    return "\n".join(lines)


def png_plot(steps: Sequence[int], values: Sequence[float], path: str, title: str = "loss") -> bool:
    """Write a PNG with matplotlib; False (nothing written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(list(steps), list(values))
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def default_out(run: str, key: str, png: bool) -> str:
    folder = run if os.path.isdir(run) else os.path.dirname(os.path.abspath(run))
    return os.path.join(folder, f"{key}.{'png' if png else 'svg'}")


def write_plot(run: str, key: str = "loss", out: Optional[str] = None) -> tuple[str, str]:
    """Plot ``key`` of the run: (the file written, a text plot). A PNG when ``out`` ends in
    .png, or (no ``out``) when matplotlib is installed; an SVG otherwise."""
    steps, values = read_series(metrics_path(run), key)
    title = f"{key} ({os.path.basename(os.path.normpath(run))})"
    if out is None or out.endswith(".png"):
        target = out or default_out(run, key, png=True)
        if png_plot(steps, values, target, title):
            return target, text_plot(steps, values)
        if out is not None:
            raise PlotError(f"{out}: a PNG needs matplotlib (pip install matplotlib), or write --out FILE.svg")
    target = out or default_out(run, key, png=False)
    with open(target, "w", encoding="utf-8") as f:
        f.write(svg_plot(steps, values, title))
    return target, text_plot(steps, values)
