"""`python -m trainloop.report RUN_DIR [RUN_DIR ...] [-o PATH]`: see a run instead of its JSON.

Draws, from each run's metrics.jsonl, six panels against the optimizer step: train and eval loss,
learning rate, tokens/s, MFU, gradient norm and memory (the telemetry lines), then the objective's
own where a run logged them (grpo: reward, KL, completion length; dpo and simpo: accuracy and
margin) and a panel per lm-evaluation-harness task it scored (eval.harness), one colour per run with
a legend, into RUN_DIR/report.png (the first run's) or -o. A
sweep directory stands for its jobs. A resumed run appends to its metrics.jsonl and logs some
steps again: each step keeps its last value, so a curve shows the run as it finally stands.
Drawn with matplotlib's Agg canvas, imported only here so that `python -m trainloop` does not
pay for it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

GIB = 2 ** 30


@dataclass(frozen=True)
class Series:
    """One metrics.jsonl key drawn in a panel: `scale` turns its values into the panel's unit."""
    key: str
    label: str
    style: str = "-"
    scale: float = 1.0
    eval: bool | None = None  # read from eval lines only (True), train lines only (False), or any line

    def reads(self, record: dict) -> bool:
        """Whether this record holds a point of the series: dpo's eval lines repeat the train keys."""
        return self.eval is None or self.eval == ("eval_loss" in record)


@dataclass(frozen=True)
class Panel:
    title: str
    series: tuple[Series, ...]
    ylabel: str = ""
    log: bool = False  # log y when the values span a factor of 10 or more: a spike stays readable
    percent: bool = False
    zero: bool = False  # y from 0: a drop in throughput or a rise in memory shows at its true size
    no_data: str = "no data"


# Loss, learning rate and tokens/s are linear: their useful range is within a factor of a few,
# and the warmup and decay of the schedule read best on a linear axis. Grad norm goes log when
# it spikes.
PANELS = (
    Panel("loss", (Series("loss", "train"), Series("eval_loss", "eval", "--"))),
    Panel("learning rate", (Series("lr", "lr"),)),
    Panel("tokens/s", (Series("tokens_per_s", "tokens/s"),), ylabel="tokens/s (all processes)", zero=True),
    Panel("MFU", (Series("mfu", "mfu"),), percent=True, zero=True,
          no_data="no data: mfu is null on CPU unless logging.peak_tflops=N is set"),
    Panel("grad norm", (Series("grad_norm", "grad norm"),), log=True),
    # The current allocation is left out: between steps it holds little more than the weights and
    # optimizer state; the peak is what decides an out-of-memory.
    Panel("memory", (Series("gpu_mem_peak_allocated_bytes", "GPU peak allocated", "-", 1 / GIB),
                     Series("gpu_mem_reserved_bytes", "GPU reserved", "--", 1 / GIB),
                     Series("rss_bytes", "host RSS", ":", 1 / GIB)), ylabel="GiB", zero=True,
          no_data="no data: telemetry lines come with logging.telemetry_every=N"),
)
# The objective's own numbers (Objective.headline and more), each panel drawn when a run logged it.
OBJECTIVE_PANELS = (
    Panel("reward", (Series("reward", "train"), Series("eval_reward", "eval", "--"))),
    Panel("KL to the reference", (Series("kl", "kl"),)),
    Panel("completion length", (Series("completion_length", "mean"), Series("completion_length_max", "max", "--")),
          ylabel="tokens", zero=True),
    Panel("reward accuracy", (Series("rewards/accuracy", "train", eval=False),
                              Series("rewards/accuracy", "eval", "--", eval=True)), percent=True),
    Panel("reward margin", (Series("rewards/margin", "train", eval=False),
                            Series("rewards/margin", "eval", "--", eval=True))),
)
STYLES = ("-", "--", ":", "-.")
SERIES = tuple(dict.fromkeys(s for panel in PANELS + OBJECTIVE_PANELS for s in panel.series))
LOSS, EVAL_LOSS = PANELS[0].series
FIGSIZE, DPI = (12.0, 11.0), 100  # inches and dots per inch: a 1200 x 1100 PNG of PANELS' three rows


class ReportError(Exception):
    """Input the report cannot draw; main() prints it and exits 2, as argparse does."""


def read_curves(run_dir: Path) -> dict[Series, list[tuple[int, float]]]:
    """Series -> [(step, value)] sorted by step; a step logged twice (a resumed run) keeps its last value."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines()
    if not any(line.strip() for line in lines):
        raise ReportError(f"{path} is empty: the run logged nothing yet (its first line comes at "
                          "trainer.log_every steps)")
    curves: dict[Series, dict[int, float]] = {series: {} for series in SERIES}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # a run killed while writing its last line
                print(f"note: {path}: the last line is cut short; it is left out", file=sys.stderr)
                continue
            raise ReportError(f"{path}, line {number}: not JSON: {line[:80]!r}") from None
        for series in SERIES:
            value = record.get(series.key)
            if isinstance(value, (int, float)) and math.isfinite(value) and "step" in record and series.reads(record):
                curves[series][record["step"]] = float(value)
        if record.get("event") == "harness" and "step" in record:  # eval.harness: a series per TASK/METRIC
            drawn: dict[str, int] = {}  # a style per metric of its task, in the order the harness wrote them
            for key, value in record.items():
                if "/" in key and not key.endswith("_stderr") and isinstance(value, (int, float)):
                    task, metric = key.split("/", 1)
                    style = STYLES[drawn.get(task, 0) % len(STYLES)]
                    drawn[task] = drawn.get(task, 0) + 1
                    curves.setdefault(Series(key, metric, style), {})[record["step"]] = float(value)
    return {series: sorted(values.items()) for series, values in curves.items()}


def harness_panels(curves: list[dict]) -> tuple[Panel, ...]:
    """A panel per lm-evaluation-harness task any run scored, its metrics as series."""
    tasks: dict[str, dict[Series, None]] = {}
    for run in curves:
        for series in run:
            if series not in SERIES:
                tasks.setdefault(series.key.split("/", 1)[0], {})[series] = None
    return tuple(Panel(f"{task} (lm-evaluation-harness)", tuple(series), ylabel="score")
                 for task, series in tasks.items())


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


def run_colors(count: int) -> list:
    from matplotlib import colormaps, color_sequences

    if count <= 10:
        return list(color_sequences["tab10"][:count])
    return [colormaps["turbo"](i / (count - 1)) for i in range(count)]  # past 10: spread over a map


def draw_panel(ax, panel: Panel, runs: list[tuple[str, object, dict]]) -> None:
    """One panel: a line per run and series; `runs` holds (label, colour, curves)."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    ax.set_title(panel.title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    values, styles = [], []
    for label, color, curves in runs:
        for series in panel.series:
            points = curves.get(series, [])  # a harness metric another run scored
            if not points:
                continue
            steps, ys = zip(*points)
            ys = [y * series.scale for y in ys]
            # few points: mark each, a line between two points alone hides where they are
            ax.plot(steps, ys, series.style, color=color, label=f"{label} {series.label}",
                    marker="o" if len(points) <= 30 else None, markersize=3)
            values += ys
            styles += [series] if series not in styles else []
    if not values:
        ax.text(0.5, 0.5, panel.no_data, transform=ax.transAxes, ha="center", va="center",
                color="grey", wrap=True)
        ax.set_yticks([])
        return
    if panel.log and min(values) > 0 and max(values) >= 10 * min(values):
        ax.set_yscale("log")
    else:
        ax.ticklabel_format(axis="y", useOffset=False)  # 0.6113, not 1e-5 + 6.113e-1
    if panel.zero:
        ax.set_ylim(0, max(values) * 1.08)
    if panel.percent:
        ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    if len(panel.series) > 1:  # which line is which series: the run colours are in the figure's legend
        ax.legend(handles=[Line2D([], [], color="black", linestyle=s.style, label=s.label) for s in styles],
                  fontsize="small")


def draw_report(labels: list[str], curves: list[dict]):
    """The report as a matplotlib Figure on an Agg canvas (no display needed); a run per label."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    colors = run_colors(len(labels))
    runs = list(zip(labels, colors, curves))
    panels = (PANELS + tuple(p for p in OBJECTIVE_PANELS if any(run[s] for run in curves for s in p.series))
              + harness_panels(curves))
    rows = math.ceil(len(panels) / 2)
    fig = Figure(figsize=(FIGSIZE[0], FIGSIZE[1] * rows / 3), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 2, sharex=True)  # one step axis: a loss spike lines up with its grad norm
    for ax, panel in zip(axes.flat, panels):
        draw_panel(ax, panel, runs)
    if len(panels) % 2:  # an odd panel out: the one above the empty slot shows the steps
        fig.delaxes(axes[-1, 1])
        axes[-2, 1].xaxis.set_tick_params(labelbottom=True)
        axes[-2, 1].set_xlabel("step")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    header(fig, labels, colors)
    return fig


def header(fig, labels: list[str], colors: list) -> None:
    """The legend above the panels, in as many columns (up to 3) as fit the figure's width; a label
    too long for the width alone is wrapped, so none is cut at the picture's edges."""
    from matplotlib.lines import Line2D

    renderer, texts, ncols = fig.canvas.get_renderer(), labels, min(len(labels), 3)
    while True:
        handles = [Line2D([], [], color=c, linewidth=2, label=text) for text, c in zip(texts, colors)]
        legend = fig.legend(handles=handles, loc="outside upper center", ncols=ncols,
                            title=f"trainloop report: {len(labels)} run(s)")
        width = legend.get_window_extent(renderer).width
        widest = max(len(line) for text in texts for line in text.splitlines())
        if width <= fig.bbox.width or (ncols == 1 and widest <= 20):
            return
        legend.remove()
        if ncols > 1:  # fewer columns first
            ncols -= 1
        else:  # then shorter lines, in proportion to the overflow
            per_line = max(20, int(widest * fig.bbox.width / width) - 2)
            texts = [textwrap.fill(label, per_line) for label in labels]


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
            raise ReportError(f"{path}: no metrics.jsonl in it or in its subfolders; "
                              "give a run directory (RUN_DIR/metrics.jsonl) or a sweep directory")
        runs.extend(jobs)
    return list({run.resolve(): run for run in runs}.values())  # a run named twice is drawn once


def summary(label: str, curves: dict) -> str:
    """One line per run: how far it got and where its losses ended."""
    losses, evals = curves[LOSS], curves[EVAL_LOSS]
    parts = [f"{label}: {losses[-1][0] if losses else 0} steps"]
    parts += [f"loss {losses[-1][1]:.4f}"] if losses else []
    parts += [f"eval_loss {evals[-1][1]:.4f}"] if evals else []
    return ", ".join(parts)


def main(argv: list[str] | None = None):
    """Draw the report, print where it went and a line per run; returns the Figure it saved."""
    parser = argparse.ArgumentParser(
        prog="python -m trainloop.report",
        description="Draw loss, eval loss, learning rate, tokens/s, MFU, grad norm and memory of "
                    "one or more runs against the step, and the objective's reward, KL, accuracy or "
                    "margin and the lm-evaluation-harness scores where logged, into a PNG.")
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="a run directory (with metrics.jsonl) or a sweep directory")
    parser.add_argument("-o", "--out", type=Path, help="the PNG to write (default: FIRST_RUN_DIR/report.png)")
    args = parser.parse_args(argv)
    try:
        runs = find_runs(args.run_dirs)
        labels, curves = run_labels(runs), [read_curves(d) for d in runs]
    except ReportError as err:
        parser.error(str(err))
    out = args.out or args.run_dirs[0] / "report.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = draw_report(labels, curves)
    fig.savefig(out)
    print(f"wrote {out} ({len(runs)} run(s))")
    for label, run_curves in zip(labels, curves):
        print(summary(label, run_curves))
    return fig


if __name__ == "__main__":
    main()
