"""`python -m trainloop.report`: real runs in, a matplotlib figure with every run's curves out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import matplotlib.image
import pytest

from helpers import launch, legend_texts, panels, read_metrics, train, warm
from trainloop.tools import report
from trainloop.tools.report import DPI, FIGSIZE, main

GIB = 2 ** 30


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path]:
    """Two real 4-step runs; only the first samples telemetry and knows a peak for its MFU."""
    root = tmp_path_factory.mktemp("runs")
    first = train(root / "adamw", "optimizer=adamw", "logging.telemetry_every=2", "logging.peak_tflops=0.5")
    second = train(root / "sgd", "optimizer=sgd")
    return first, second


def curve(run_dir: Path, key: str, event: str | None = None) -> tuple[list[int], list[float]]:
    """(steps, values) of one key from metrics.jsonl, each step once."""
    points = {r["step"]: r[key] for r in read_metrics(run_dir) if r.get(key) is not None and r.get("event") == event}
    return list(points), list(points.values())


def line(ax, label: str):
    (found,) = [ln for ln in ax.get_lines() if ln.get_label() == label]
    return found


def test_report_draws_both_runs_with_a_legend(two_runs, tmp_path):
    first, second = two_runs
    out = tmp_path / "out.png"
    proc = warm(1, [str(first), str(second), "-o", str(out)], module="trainloop.report")
    assert f"wrote {out} (2 run(s))" in proc.stdout
    final_eval = curve(first, "eval_loss")[1][-1]
    assert f"adamw: 4 steps, loss {curve(first, 'loss')[1][-1]:.4f}, eval_loss {final_eval:.4f}" in proc.stdout
    image = matplotlib.image.imread(out)
    assert image.shape[:2] == (FIGSIZE[1] * DPI, FIGSIZE[0] * DPI)  # rows, columns
    assert image.std() > 0.05  # more than a blank page

    fig = main([str(first), str(second), "-o", str(tmp_path / "again.png")])  # the same call, in this process
    assert legend_texts(fig) == ["adamw", "sgd"]
    axes = panels(fig)
    assert set(axes) == {"loss", "learning rate", "tokens/s", "MFU", "grad norm", "memory"}
    colors = [line(axes["loss"], f"{name} train").get_color() for name in ("adamw", "sgd")]
    assert colors[0] != colors[1]
    for title, key, label in (("loss", "loss", "train"), ("loss", "eval_loss", "eval"), ("learning rate", "lr", "lr"),
                              ("tokens/s", "tokens_per_s", "tokens/s"), ("grad norm", "grad_norm", "grad norm")):
        assert len(axes[title].get_lines()) == 2 * (1 + (title == "loss")), title
        for run_dir, color in zip(two_runs, colors):
            drawn = line(axes[title], f"{run_dir.name} {label}")
            steps, values = curve(run_dir, key)
            assert list(drawn.get_xdata()) == steps and len(steps) >= 2
            assert list(drawn.get_ydata()) == pytest.approx(values, rel=1e-12) and drawn.get_color() == color

    # MFU: a number in the first run (logging.peak_tflops), null in the second: one line, its share
    assert [ln.get_label() for ln in axes["MFU"].get_lines()] == ["adamw mfu"]
    assert list(axes["MFU"].get_lines()[0].get_ydata()) == pytest.approx(curve(first, "mfu")[1])
    # memory: the first run's telemetry lines (host RSS on CPU) in GiB; the second has none
    steps, rss = curve(first, "rss_bytes", event="telemetry")
    assert steps == [2, 4]
    drawn = line(axes["memory"], "adamw host RSS")
    assert list(drawn.get_xdata()) == steps and list(drawn.get_ydata()) == pytest.approx([v / GIB for v in rss])
    assert len(axes["memory"].get_lines()) == 1


def test_a_panel_without_data_says_so_and_the_default_path(two_runs):
    _, second = two_runs
    fig = main([str(second)])
    assert (second / "report.png").is_file() and legend_texts(fig) == ["sgd"]
    axes = panels(fig)
    for title, hint in (("MFU", "logging.peak_tflops"), ("memory", "logging.telemetry_every")):
        assert not axes[title].get_lines()
        assert any(t.get_text().startswith("no data") and hint in t.get_text() for t in axes[title].texts)


def test_a_resumed_run_keeps_the_last_value_of_each_step(two_runs, tmp_path):
    """A resumed run appends to metrics.jsonl and logs again the steps after its checkpoint."""
    run = tmp_path / "resumed"
    run.mkdir()
    shutil.copy(two_runs[0] / "metrics.jsonl", run / "metrics.jsonl")
    again = [r for r in read_metrics(run) if r["step"] >= 3 and "loss" in r]
    with open(run / "metrics.jsonl", "a") as f:
        for record in again:
            f.write(json.dumps({**record, "loss": record["loss"] + 1.0}) + "\n")
    fig = main([str(run), "-o", str(tmp_path / "r.png")])
    drawn = line(panels(fig)["loss"], "resumed train")
    steps, losses = curve(two_runs[0], "loss")
    assert list(drawn.get_xdata()) == steps == [1, 2, 3, 4]
    assert list(drawn.get_ydata()) == pytest.approx(losses[:2] + [v + 1.0 for v in losses[2:]])


def test_gpu_telemetry_draws_peak_reserved_and_rss(two_runs, tmp_path):
    """The GPU fields trainloop.observe.telemetry writes on CUDA, added to a CPU run's telemetry lines."""
    run = tmp_path / "gpu"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
        for record in read_metrics(two_runs[0]):
            if record.get("event") == "telemetry":
                record.update(gpu_mem_allocated_bytes=GIB, gpu_mem_reserved_bytes=3 * GIB * record["step"],
                              gpu_mem_peak_allocated_bytes=2 * GIB * record["step"])
            f.write(json.dumps(record) + "\n")
    memory = panels(main([str(run), "-o", str(tmp_path / "g.png")]))["memory"]
    drawn = {ln.get_label(): list(ln.get_ydata()) for ln in memory.get_lines()}
    assert drawn == {"gpu GPU peak allocated": [4.0, 8.0], "gpu GPU reserved": [6.0, 12.0],
                     "gpu host RSS": pytest.approx([v / GIB for v in curve(run, "rss_bytes", "telemetry")[1]])}
    assert [t.get_text() for t in memory.get_legend().get_texts()] == ["GPU peak allocated", "GPU reserved", "host RSS"]


def test_two_runs_of_one_name_are_told_apart(two_runs, tmp_path):
    copies = [tmp_path / "a" / "sgd", tmp_path / "b" / "sgd"]
    for copy in copies:
        shutil.copytree(two_runs[1], copy)
    fig = main([str(c) for c in copies] + [str(copies[0] / ".." / "sgd"), "-o", str(tmp_path / "same.png")])
    assert legend_texts(fig) == ["a/sgd", "b/sgd"]  # and the first, named again, is drawn once


def test_three_runs_with_long_names_all_show_in_the_legend(two_runs, tmp_path):
    names = [f"learning-rate-sweep-with-a-long-descriptive-name-{i}" for i in range(3)]
    for name in names:
        shutil.copytree(two_runs[0], tmp_path / name)
    fig = main([str(tmp_path / name) for name in names] + ["-o", str(tmp_path / "three.png")])
    assert legend_texts(fig) == names
    renderer, width = fig.canvas.get_renderer(), fig.bbox.width
    for text in fig.legends[0].get_texts():  # every entry inside the picture, none cut at its edges
        box = text.get_window_extent(renderer)
        assert 0 <= box.x0 and box.x1 <= width, (text.get_text(), box, width)


def test_a_name_longer_than_the_picture_is_wrapped_inside_it(two_runs, tmp_path):
    """The header fits the image: a label wider than the figure (a run dir named for its overrides)
    is broken into lines, not cut at the picture's edges."""
    name = "grpo_" + "_".join(f"objective.rewards=reward_functions.py:verifier_{i}" for i in range(5))
    shutil.copytree(two_runs[0], tmp_path / name)
    fig = main([str(tmp_path / name), "-o", str(tmp_path / "long.png")])
    (text,) = fig.legends[0].get_texts()
    box = text.get_window_extent(fig.canvas.get_renderer())
    assert text.get_text().count("\n") >= 1 and text.get_text().replace("\n", "") == name
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width, (box, fig.bbox.width)


def test_report_refuses_a_folder_without_metrics(tmp_path):
    proc = warm(1, [str(tmp_path)], module="trainloop.report", check=False)
    assert proc.returncode == 2
    assert f"{tmp_path}: no metrics.jsonl" in proc.stderr and not (tmp_path / "report.png").exists()


def test_report_refuses_an_empty_metrics_file(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path)])
    assert exit_.value.code == 2
    assert f"{tmp_path / 'metrics.jsonl'} is empty" in capsys.readouterr().err
    assert not (tmp_path / "report.png").exists()


def test_the_report_holds_no_png_encoder_and_loads_matplotlib_lazily():
    source = Path(report.__file__).read_text()
    for sign in ("zlib", "struct", "IHDR", "IDAT", "\\x89PNG", "crc32"):
        assert sign not in source, sign
    # `python -m trainloop` (and importing the report) must not pay for matplotlib
    probe = ("import sys, trainloop.__main__, trainloop.tools.report; "
             "print(sorted(m for m in sys.modules if m.startswith('matplotlib')))")
    assert launch(["python", "-c", probe]).stdout.strip() == "[]"
