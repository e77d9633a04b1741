"""`python -m trainloop.report RUN_DIR [RUN_DIR ...] [--out PATH]`: see a run instead of its JSON.

Draws train loss, eval loss, learning rate and tokens/s against the optimizer step from each
run's metrics.jsonl, one coloured line per run, into RUN_DIR/report.png (the first run's) or
--out. A sweep directory stands for its jobs. The PNG is made with the standard library alone
(zlib, struct) and a small bitmap font, so the report needs no plotting package.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import zlib
from pathlib import Path

# A 5x9 bitmap font: per glyph 9 rows (7 above the baseline, 2 for descenders), each row one
# base-32 digit whose 5 bits are its pixels, the leftmost pixel the highest bit.
FONT = dict(zip(
    "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz.,-+_/:()%=?*[]'!<>#| ",
    "ehjlphe00 4c4444e00 eh1248v00 v2421he00 26aiv2200 vgu11he00 68guhhe00 v12488800 ehhehhe00 "
    "ehhf12c00 ehhvhhh00 uhhuhhu00 ehggghe00 sihhhis00 vgguggv00 vgguggg00 ehgnhhf00 hhhvhhh00 "
    "e44444e00 72222ic00 hikokih00 ggggggv00 hrllhhh00 hhpljhh00 ehhhhhe00 uhhuggg00 ehhhlid00 "
    "uhhukih00 fgge11u00 v44444400 hhhhhhe00 hhhhha400 hhhllla00 hha4ahh00 hha444400 v1248gv00 "
    "00e1fhf00 gguhhhu00 00egghe00 11fhhhf00 00ehvge00 698s88800 00fhhhf1e ggmphhh00 40c444e00 "
    "2062222ic ggikoki00 c44444e00 00qllll00 00mphhh00 00ehhhe00 00uhhhugg 00fhhhf11 00mpggg00 "
    "00fge1u00 88s889600 00hhhjd00 00hhha400 00hhlla00 00ha4ah00 00hhhhf1e 00v248v00 00000cc00 "
    "0000c4800 000v00000 044v44000 0000000v0 01248g000 0cc0cc000 248884200 842224800 op248j300 "
    "00v0v0000 eh1240400 04lel4000 e88888e00 e22222e00 448000000 444440400 248g84200 842124800 "
    "aavavaa00 444444444 000000000".split(),
))

PANELS = (("loss", "train loss"), ("eval_loss", "eval loss"),
          ("lr", "learning rate"), ("tokens_per_s", "tokens/s"))
COLORS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
          (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207))
WHITE, PAPER, GRID, FRAME, INK = (255, 255, 255), (250, 250, 252), (226, 226, 232), (110, 110, 120), (40, 40, 48)
PANEL_W, PANEL_H, SCALE = 640, 420, 2  # SCALE: screen pixels per font pixel


class Canvas:
    """An RGB raster with the few primitives a line chart needs."""

    def __init__(self, width: int, height: int, color=WHITE):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(color) * (width * height))

    def rect(self, x0: int, y0: int, x1: int, y1: int, color) -> None:
        """Fill [x0, x1) x [y0, y1), clipped to the canvas."""
        x0, x1 = max(0, x0), min(self.width, x1)
        if x1 <= x0:
            return
        row = bytes(color) * (x1 - x0)
        for y in range(max(0, y0), min(self.height, y1)):
            start = (y * self.width + x0) * 3
            self.pixels[start:start + len(row)] = row

    def line(self, x0: int, y0: int, x1: int, y1: int, color, width: int = 2) -> None:
        """Bresenham's line, stamped with a width x width square."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err, half = dx + dy, width // 2
        while True:
            self.rect(x0 - half, y0 - half, x0 - half + width, y0 - half + width, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    def text(self, x: int, y: int, text: str, color=INK, align: str = "left", scale: int = SCALE) -> None:
        """Draw text whose cap top is at y; align: left, center or right of x."""
        x -= {"left": 0, "center": text_width(text, scale) // 2, "right": text_width(text, scale)}[align]
        for ch in text:
            for row, digit in enumerate(FONT.get(ch, FONT["?"])):
                bits = int(digit, 32)
                for col in range(5):
                    if bits >> (4 - col) & 1:
                        px, py = x + col * scale, y + row * scale
                        self.rect(px, py, px + scale, py + scale, color)
            x += 6 * scale

    def png(self) -> bytes:
        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        stride = self.width * 3
        rows = b"".join(b"\x00" + self.pixels[y * stride:(y + 1) * stride] for y in range(self.height))
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 9))
                + chunk(b"IEND", b""))


def text_width(text: str, scale: int = SCALE) -> int:
    return len(text) * 6 * scale - scale


def nice_axis(lo: float, hi: float, count: int = 5) -> tuple[float, float, list[float]]:
    """Widen [lo, hi] to round bounds; return them and about `count` round ticks between."""
    if hi - lo <= abs(hi) * 1e-9:
        pad = abs(hi) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw * 0.999)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return first * step, last * step, [i * step for i in range(first, last + 1)]


def tick_labels(ticks: list[float]) -> list[str]:
    """Labels for one axis's evenly spaced ticks, all in one format (12k, 0.5, 2e-4)."""
    step, top = ticks[1] - ticks[0], max(abs(t) for t in ticks)
    div, suffix = (1e6, "M") if top >= 1e6 else (1e3, "k") if top >= 1e4 else (1, "")
    labels = []
    for value in ticks:
        if abs(value) < step * 1e-6:
            labels.append("0")
        elif div == 1 and step < 1e-2:
            mantissa, exponent = f"{value:.2e}".split("e")
            labels.append(f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}")
        else:
            scaled = step / div
            decimals = max(0, -math.floor(math.log10(scaled) + 1e-9)) + (f"{scaled:.3g}".endswith("25"))
            labels.append(f"{value / div:.{decimals}f}{suffix}")
    return labels


def draw_panel(canvas: Canvas, left: int, top: int, title: str, series: list) -> None:
    """One chart in the PANEL_W x PANEL_H box at (left, top); series: (color, [(step, value)])."""
    x0, y0, x1, y1 = left + 96, top + 40, left + PANEL_W - 24, top + PANEL_H - 52
    canvas.text((x0 + x1) // 2, top + 12, title, align="center")
    canvas.rect(x0, y0, x1, y1, PAPER)
    points = [p for _, pts in series for p in pts]
    if not points:
        canvas.text((x0 + x1) // 2, (y0 + y1) // 2 - 9, "no data", FRAME, align="center")
    else:
        xlo, xhi, xticks = nice_axis(min(0, min(s for s, _ in points)), max(s for s, _ in points))
        ylo, yhi, yticks = nice_axis(min(v for _, v in points), max(v for _, v in points))
        sx = lambda s: round(x0 + (s - xlo) / (xhi - xlo) * (x1 - x0 - 1))  # noqa: E731
        sy = lambda v: round(y1 - 1 - (v - ylo) / (yhi - ylo) * (y1 - y0 - 1))  # noqa: E731
        for t, label in zip(xticks, tick_labels(xticks)):
            canvas.rect(sx(t), y0, sx(t) + 1, y1, GRID)
            canvas.text(sx(t), y1 + 10, label, align="center")
        for t, label in zip(yticks, tick_labels(yticks)):
            canvas.rect(x0, sy(t), x1, sy(t) + 1, GRID)
            canvas.text(x0 - 10, sy(t) - 7, label, align="right")
        for k, (color, pts) in enumerate(series):
            # earlier runs are drawn wider, so a run that another one covers still shows its edge
            width = 2 + min(3, len(series) - 1 - k)
            xy = [(sx(s), sy(v)) for s, v in pts]
            for (ax, ay), (bx, by) in zip(xy, xy[1:]):
                canvas.line(ax, ay, bx, by, color, width)
            if len(xy) == 1 or (xy[-1][0] - xy[0][0]) / (len(xy) - 1) >= 12:  # sparse: mark each
                for px, py in xy:
                    canvas.rect(px - width - 1, py - width - 1, px + width + 2, py + width + 2, color)
        canvas.text((x0 + x1) // 2, y1 + 34, "step", FRAME, align="center")
    for a, b, c, d in ((x0, y0, x1, y0 + 1), (x0, y1 - 1, x1, y1), (x0, y0, x0 + 1, y1), (x1 - 1, y0, x1, y1)):
        canvas.rect(a, b, c, d, FRAME)


def read_curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """key -> [(step, value)], sorted; a step logged twice (a resumed run) keeps its last value."""
    curves: dict[str, dict[int, float]] = {key: {} for key, _ in PANELS}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        for key in curves:
            value = record.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value) and "step" in record:
                curves[key][record["step"]] = float(value)
    return {key: sorted(values.items()) for key, values in curves.items()}


def run_labels(run_dirs: list[Path]) -> list[str]:
    """The shortest path endings that tell the runs apart, plus the overrides they differ in."""
    parts = [d.resolve().parts for d in run_dirs]
    depth = 1
    while depth < max(map(len, parts)) and len({p[-depth:] for p in parts}) < len(parts):
        depth += 1
    labels = ["/".join(p[-depth:]) for p in parts]
    overrides = [_overrides(d) for d in run_dirs]
    if len(run_dirs) > 1 and any(overrides):
        common = set.intersection(*(set(o) for o in overrides if o))
        labels = [" ".join([label] + [o for o in own if o not in common])
                  for label, own in zip(labels, overrides)]
    return labels


def _overrides(run_dir: Path) -> list[str]:
    path = run_dir / ".hydra" / "overrides.yaml"  # written by Hydra for every run and sweep job
    if not path.is_file():
        return []
    from omegaconf import OmegaConf

    return [str(o) for o in OmegaConf.load(path)]


def draw_report(run_dirs: list[Path]) -> Canvas:
    curves = [read_curves(d) for d in run_dirs]
    colors = [COLORS[i % len(COLORS)] for i in range(len(run_dirs))]
    width = 2 * PANEL_W
    labels = [label + (f"  (eval {c['eval_loss'][-1][1]:.4f})" if c["eval_loss"] else "")
              for label, c in zip(run_labels(run_dirs), curves)]
    legend, x, y = [], 24, 60  # place the legend entries, wrapping into rows
    longest = (width - 24 - 40 - 24) // (6 * SCALE)
    for label, color in zip(labels, colors):
        label = label if len(label) <= longest else label[:longest - 3] + "..."
        if x + 40 + text_width(label) > width - 24 and x > 24:
            x, y = 24, y + 28
        legend.append((x, y, label, color))
        x += 40 + text_width(label) + 32
    header = y + 36
    canvas = Canvas(width, header + 2 * PANEL_H)
    canvas.text(24, 14, f"trainloop report: {len(run_dirs)} run(s)", scale=3)
    for x, y, label, color in legend:
        canvas.rect(x, y + 5, x + 28, y + 9, color)
        canvas.text(x + 38, y, label)
    for i, (key, title) in enumerate(PANELS):
        series = [(color, c[key]) for color, c in zip(colors, curves) if c[key]]
        draw_panel(canvas, (i % 2) * PANEL_W, header + (i // 2) * PANEL_H, title, series)
    return canvas


def find_runs(paths: list[Path]) -> list[Path]:
    """Run directories (with metrics.jsonl); a sweep directory stands for its jobs."""
    runs = []
    for path in paths:
        if (path / "metrics.jsonl").is_file():
            runs.append(path)
            continue
        jobs = sorted((p.parent for p in path.glob("*/metrics.jsonl")),
                      key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))
        if not jobs:
            raise FileNotFoundError(f"{path}: no metrics.jsonl in it or in its subfolders; "
                                    "give a run directory (RUN_DIR/metrics.jsonl) or a sweep directory")
        runs.extend(jobs)
    return runs


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        prog="python -m trainloop.report",
        description="Draw loss, eval loss, learning rate and tokens/s of one or more runs to a PNG.")
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="a run directory (with metrics.jsonl) or a sweep directory")
    parser.add_argument("--out", type=Path, help="the PNG to write (default: FIRST_RUN_DIR/report.png)")
    args = parser.parse_args(argv)
    try:
        runs = find_runs(args.run_dirs)
    except FileNotFoundError as err:
        parser.error(str(err))
    out = args.out or args.run_dirs[0] / "report.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(draw_report(runs).png())
    print(f"wrote {out} ({len(runs)} run(s))")
    return out


if __name__ == "__main__":
    main()
