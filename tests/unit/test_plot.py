"""python -m engine.plot: a loss curve from metrics.jsonl without a plotting dependency."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from engine.plot import PlotError, read_series, svg_plot, text_plot, write_plot
from engine.plot.__main__ import main


def _run(tmp_path, losses, torn: bool = False):
    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps({"step": i + 1, "loss": v, "lr": 1e-3}) for i, v in enumerate(losses)]
    text = "\n".join(lines) + "\n" + ('{"step": 99, "lo' if torn else "")
    (run / "metrics.jsonl").write_text(text)
    return run


def test_series_skips_a_torn_last_line_and_non_finite_values(tmp_path):
    run = _run(tmp_path, [7.5, float("nan"), 6.0, 5.0], torn=True)
    assert read_series(str(run / "metrics.jsonl")) == ([1, 3, 4], [7.5, 6.0, 5.0])


def test_a_bad_line_inside_the_file_is_named(tmp_path):
    run = _run(tmp_path, [7.5, 6.0])
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 7}\nnot json\n{"step": 3, "loss": 5}\n')
    with pytest.raises(PlotError, match=r"metrics.jsonl, line 2: not JSON"):
        read_series(str(run / "metrics.jsonl"))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 7}\n')
    with pytest.raises(PlotError, match="no finite 'tokens' values"):
        read_series(str(run / "metrics.jsonl"), key="tokens")


def test_svg_is_well_formed_and_spans_the_data(tmp_path):
    svg = svg_plot([1, 2, 3, 4], [8.0, 6.0, 5.5, 5.0], title="loss <run>")
    root = ET.fromstring(svg)
    line = root.find("{http://www.w3.org/2000/svg}polyline")
    pts = [tuple(map(float, p.split(","))) for p in line.get("points").split()]
    assert len(pts) == 4
    ys = [y for _, y in pts]
    assert ys == sorted(ys)  # loss falls -> the SVG y coordinate grows


def test_text_plot_shows_the_range_and_the_trend():
    txt = text_plot(list(range(1, 101)), [10 - 0.05 * s for s in range(1, 101)], width=20, height=5)
    rows = txt.splitlines()
    assert rows[0].strip().startswith("9.85 |") and rows[4].strip().startswith("5.1 |")  # means of 5 steps
    assert rows[0].index("*") < rows[4].index("*")  # falls from left to right


def test_cli_writes_a_plot_file(tmp_path, capsys):
    run = _run(tmp_path, [7.6, 6.1, 5.2, 4.9])
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    written = out.strip().splitlines()[-1].removeprefix("wrote ")
    assert written.startswith(str(run)) and written.endswith((".png", ".svg"))
    assert (run / written.rsplit("/", 1)[-1]).stat().st_size > 0
    path, _ = write_plot(str(run), "lr", str(tmp_path / "lr.svg"))
    assert ET.parse(path).getroot().tag.endswith("svg")
    assert main([str(tmp_path / "missing")]) == 2 and "no such file" in capsys.readouterr().err
