"""`python -m trainloop.report`: real runs in, a valid PNG with every run's curves out."""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

import pytest

from conftest import launch, read_metrics, train
from trainloop.tools.report import COLORS, PANEL_H, PANEL_W, PANELS, nice_axis, tick_labels


def read_png(path: Path) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB PNG (filter type 0 rows, as the report writes): width, height, rows."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, at = {}, 8
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        assert struct.unpack(">I", data[at + 8 + length:at + 12 + length])[0] == zlib.crc32(kind + body)
        chunks[kind] = chunks.get(kind, b"") + body
        at += 12 + length
    assert list(chunks)[0] == b"IHDR" and list(chunks)[-1] == b"IEND"
    width, height, depth, color_type, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, color_type, interlace) == (8, 2, 0)
    raw = zlib.decompress(chunks[b"IDAT"])
    stride = 1 + 3 * width
    assert len(raw) == stride * height
    rows = [raw[y * stride:(y + 1) * stride] for y in range(height)]
    assert all(row[0] == 0 for row in rows)
    return width, height, [row[1:] for row in rows]


def colors_in(rows: list[bytes], x0: int, y0: int, x1: int, y1: int) -> set[tuple[int, int, int]]:
    return {tuple(row[x * 3:x * 3 + 3]) for row in rows[y0:y1] for x in range(x0, x1)}


def panel_colors(path: Path) -> list[set]:
    """The colours inside each of the four panels (the header's legend is above them)."""
    width, height, rows = read_png(path)
    header = height - 2 * PANEL_H
    return [colors_in(rows, (i % 2) * PANEL_W, header + (i // 2) * PANEL_H,
                      (i % 2 + 1) * PANEL_W, header + (i // 2 + 1) * PANEL_H) for i in range(len(PANELS))]


def test_report_draws_every_curve_of_every_run(tmp_path):
    first = train(tmp_path / "adamw", "optimizer=adamw")
    second = train(tmp_path / "sgd", "optimizer=sgd")
    assert {"loss", "lr", "tokens_per_s"} <= set(read_metrics(first)[0])

    proc = launch(["python", "-m", "trainloop.report", str(first), str(second)])
    assert "2 run(s)" in proc.stdout
    panels = panel_colors(first / "report.png")
    for (key, _), colors in zip(PANELS, panels):
        assert {COLORS[0], COLORS[1]} <= colors, f"panel {key} lacks a run's line"

    out = tmp_path / "elsewhere" / "one.png"
    launch(["python", "-m", "trainloop.report", str(second), "--out", str(out)])
    for colors in panel_colors(out):
        assert COLORS[0] in colors and COLORS[1] not in colors  # one run, one colour


def test_report_refuses_a_folder_without_metrics(tmp_path):
    proc = launch(["python", "-m", "trainloop.report", str(tmp_path)], check=False)
    assert proc.returncode == 2
    assert "no metrics.jsonl" in proc.stderr and not (tmp_path / "report.png").exists()


@pytest.mark.parametrize("lo, hi", [(0, 600), (2.13, 5.61), (0.0, 1e-3), (41_000, 57_500), (5.0, 5.0)])
def test_axes_are_round_and_hold_the_data(lo, hi):
    low, high, ticks = nice_axis(lo, hi)
    assert low <= lo and high >= hi and ticks[0] == pytest.approx(low) and ticks[-1] == pytest.approx(high)
    assert 3 <= len(ticks) <= 11
    step = ticks[1] - ticks[0]
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert round(mantissa, 6) in (1, 2, 2.5, 5)
    assert len(set(tick_labels(ticks))) == len(ticks)  # the labels tell the ticks apart


def test_tick_labels_read_like_a_person_wrote_them():
    assert tick_labels([0, 200, 400, 600]) == ["0", "200", "400", "600"]
    assert tick_labels([2.0, 2.5, 3.0]) == ["2.0", "2.5", "3.0"]
    assert tick_labels([2.0, 2.25, 2.5]) == ["2.00", "2.25", "2.50"]
    assert tick_labels([0.0, 2e-4, 4e-4, 6e-4, 8e-4, 1e-3]) == ["0", "2e-4", "4e-4", "6e-4", "8e-4", "1e-3"]
    assert tick_labels([4000, 6000, 8000, 10000, 12000]) == ["4k", "6k", "8k", "10k", "12k"]
    assert tick_labels([0, 500_000, 1_000_000, 1_500_000]) == ["0", "0.5M", "1.0M", "1.5M"]
