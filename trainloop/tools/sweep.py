"""Hydra sweeps: `python -m trainloop -m optimizer=adamw,sgd optimizer.lr=1e-4,3e-4`.

Each job trains in its own folder under hydra.sweep.dir (conf/train.yaml). `SweepSummary`, a
Hydra callback registered in conf/train.yaml, gives every job a fresh accelerate state (the
jobs share one process) and records each job's overrides and final eval loss in
SWEEP_DIR/summary.jsonl as it ends, with the table in SWEEP_DIR/summary.md; when the sweep
ends it prints the table. `python -m trainloop.sweep SWEEP_DIR` prints it again.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode

log = logging.getLogger("trainloop")

SUMMARY = "summary.jsonl"


def is_main_rank() -> bool:
    """A sweep under torchrun runs in every rank; one of them keeps the books."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0


class SweepSummary(Callback):
    def on_multirun_start(self, config, **kwargs: Any) -> None:
        if is_main_rank():  # a sweep dir used again starts a new summary
            (Path(config.hydra.sweep.dir) / SUMMARY).unlink(missing_ok=True)

    def on_job_end(self, config, job_return, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN or not is_main_rank():
            return
        failed = job_return.status.name != "COMPLETED"
        result = job_return._return_value  # .return_value would re-raise a failed job's error
        record = {
            "job": config.hydra.job.num,
            "overrides": list(job_return.overrides),
            "dir": job_return.hydra_cfg.hydra.runtime.output_dir,
            "status": job_return.status.name,
            "eval_loss": None if failed or result is None else float(result),
            "error": f"{type(result).__name__}: {result}" if failed else None,
        }
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        with open(sweep_dir / SUMMARY, "a") as f:  # one appended line: safe for parallel jobs
            f.write(json.dumps(record) + "\n")
        # Kept current after every job: a failed job makes Hydra stop before on_multirun_end.
        (sweep_dir / "summary.md").write_text(summary_table(sweep_dir) + "\n")
        log.info("sweep job %d (%s): %s", record["job"], " ".join(record["overrides"]),
                 record["error"] or f"eval_loss {_loss(record['eval_loss'])}")

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        if not is_main_rank():
            return
        print(summary_table(Path(config.hydra.sweep.dir)), flush=True)


def _loss(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def read_summary(sweep_dir: Path) -> list[dict]:
    path = Path(sweep_dir) / SUMMARY
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {sweep_dir} a trainloop sweep dir?")
    records = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        records[record["job"]] = record  # a job run again counts once, with its latest result
    return [records[job] for job in sorted(records)]


def summary_table(sweep_dir: Path) -> str:
    """A Markdown table: one row per job with the overrides that differ between jobs."""
    records = read_summary(sweep_dir)
    common = [o for o in records[0]["overrides"] if all(o in r["overrides"] for r in records)]
    losses = [r["eval_loss"] for r in records if r["eval_loss"] is not None and math.isfinite(r["eval_loss"])]
    best = min(losses, default=None)
    lines = [f"Sweep {sweep_dir}: {len(records)} job(s)",
             f"Overrides of every job: {' '.join(common) or '(none)'}", "",
             "| job | overrides | final eval_loss | dir |", "| --- | --- | --- | --- |"]
    for r in records:
        own = " ".join(o for o in r["overrides"] if o not in common) or "(none)"
        result = r["error"] or _loss(r["eval_loss"])
        if r["eval_loss"] is not None and r["eval_loss"] == best:
            result = f"**{result}** (best)"
        lines.append(f"| {r['job']} | {own} | {result} | {os.path.relpath(r['dir'], sweep_dir)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m trainloop.sweep",
                                     description="Print the summary of a finished trainloop sweep.")
    parser.add_argument("sweep_dir", type=Path, help="the sweep's folder, e.g. multirun/DATE/TIME")
    print(summary_table(parser.parse_args().sweep_dir))


if __name__ == "__main__":
    main()
