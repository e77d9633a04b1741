"""Hydra multirun: every job in its own folder, a summary of their final eval losses at the end."""

from __future__ import annotations

import json

import pytest

from helpers import SMALL, clean_env, launch, legend_texts, panels, read_metrics, warm
from trainloop.tools.report import main as report


@pytest.mark.slow
def test_sweep_runs_each_job_and_summarises_them(tmp_path):
    sweep_dir = tmp_path / "sweep"
    # precision differs between jobs too: the jobs share one process, and accelerate refuses a
    # second Accelerator with another mixed precision unless its state is reset between jobs.
    proc = warm(1, ["-m", *SMALL, "checkpoint.save_final_model=false",
                   "optimizer=adamw,sgd", "precision=fp32,bf16", f"hydra.sweep.dir={sweep_dir}"],
                  cwd=tmp_path)

    records = [json.loads(line) for line in (sweep_dir / "summary.jsonl").read_text().splitlines()]
    assert [r["job"] for r in records] == [0, 1, 2, 3]
    table = (sweep_dir / "summary.md").read_text().strip()
    assert table in proc.stdout
    assert "Overrides of every job: +preset=smoke" in table
    losses = set()
    for record in records:
        job_dir = sweep_dir / str(record["job"])
        assert record["status"] == "COMPLETED" and record["dir"] == str(job_dir)
        evals = [r["eval_loss"] for r in read_metrics(job_dir) if "eval_loss" in r]
        assert record["eval_loss"] == evals[-1]  # run()'s return value is the last eval loss
        losses.add(record["eval_loss"])
        varying = [o for o in record["overrides"] if o.startswith(("optimizer=", "precision="))]
        row = next(line for line in table.splitlines() if line.startswith(f"| {record['job']} |"))
        assert " ".join(varying) in row and f"{record['eval_loss']:.4f}" in row
    assert len(losses) == 4  # four different trainings, not one result copied
    best = min(records, key=lambda r: r["eval_loss"])
    assert "(best)" in next(line for line in table.splitlines() if line.startswith(f"| {best['job']} |"))

    again = warm(1, [str(sweep_dir)], module="trainloop.sweep")
    assert again.stdout.strip() == table

    fig = report([str(sweep_dir)])  # a sweep dir stands for its jobs, each named by what it varies
    assert (sweep_dir / "report.png").is_file()
    assert legend_texts(fig) == [" ".join([str(r["job"])] + [o for o in r["overrides"]
                                                              if o.startswith(("optimizer=", "precision="))])
                                 for r in records]
    assert len(panels(fig)["loss"].get_lines()) == 8  # train and eval of each job


def test_sweep_under_a_launcher_is_refused_before_anything_runs(tmp_path):
    # Each job's end destroys the launcher's process group: a second job would hang.
    proc = launch(["python", "-m", "trainloop", "-m", *SMALL, "optimizer=adamw,sgd",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path, check=False,
                  env=clean_env(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0"))
    assert proc.returncode == 2 and "a sweep (-m) cannot run under a launcher" in proc.stderr
    assert not (tmp_path / "sweep").exists()
