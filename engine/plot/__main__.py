"""``python -m engine.plot RUN [--key loss] [--out FILE]``: plot a run's metrics.jsonl (engine/plot)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from engine.plot import PlotError, write_plot


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.plot",
                                 description="Plot a field of a run's metrics.jsonl against the step: a PNG "
                                             "when matplotlib is installed, else an SVG; and a text plot.")
    ap.add_argument("run", help="the run's --output folder (or its metrics.jsonl)")
    ap.add_argument("--key", default="loss",
                    help="the metrics.jsonl field: loss, lr, grad_norm, tokens_per_s, ... (default loss)")
    ap.add_argument("--out", default=None, metavar="FILE",
                    help="FILE.png or FILE.svg (default: RUN/<key>.png with matplotlib, else RUN/<key>.svg)")
    args = ap.parse_args(argv)
    try:
        path, text = write_plot(args.run, args.key, args.out)
    except (PlotError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
