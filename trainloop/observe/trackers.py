"""Experiment trackers (logging.trackers): accelerate's own tracker classes, pointed at the run dir.

Offline by default: TensorBoard event files in RUN_DIR/tensorboard/, MLflow in a file store in
RUN_DIR/mlruns unless MLFLOW_TRACKING_URI is set, W&B in offline mode under RUN_DIR/wandb/ unless
the user configured it (WANDB_MODE, WANDB_API_KEY or `wandb login`). The Accelerator is built
before the ranks agree on the run dir, so trainloop builds the trackers here, once it is known,
and accelerate starts them (on the main process), logs to them and finishes them at end_training.
Nothing here imports a tracker's package until a run starts it: validating a config stays fast.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("trainloop")

PROJECT = "trainloop"  # MLflow's experiment, W&B's project; each run is named after its run dir


def _tensorboard(run_dir: Path):
    from accelerate.tracking import TensorBoardTracker

    class TensorBoard(TensorBoardTracker):
        """accelerate's, with the hyperparameters in the run's own folder: its own writes them,
        and a YAML copy of the config, into two timestamped folders that `tensorboard --logdir`
        lists as two more runs (the config is in RUN_DIR/.hydra/config.yaml already)."""

        def store_init_configuration(self, values: dict) -> None:
            self.writer.add_hparams(values, metric_dict={}, run_name=".")
            self.writer.flush()

    # accelerate writes to LOGGING_DIR/RUN_NAME: the "run name" is the folder, RUN_DIR/tensorboard
    return TensorBoard("tensorboard", run_dir)


def _mlflow(run_dir: Path):
    import mlflow
    from accelerate.tracking import MLflowTracker

    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri is None:
        uri = (run_dir / "mlruns").as_uri()
        # MLflow 3.x refuses a file store ("maintenance mode") unless this is set; its database
        # store needs SQLAlchemy, which mlflow-skinny leaves out. The file store still reads and writes.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri(uri)  # every run sets its own: a sweep's runs each have a store
    return MLflowTracker(experiment_name=PROJECT, run_name=run_dir.name)


def _wandb(run_dir: Path):
    from accelerate.tracking import WandBTracker

    configured = any(k in os.environ for k in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL")) or _wandb_logged_in()
    return WandBTracker(os.environ.get("WANDB_PROJECT", PROJECT), name=run_dir.name, dir=str(run_dir),
                        **({} if configured else {"mode": "offline"}))


def _wandb_logged_in() -> bool:
    """`wandb login` writes its key into the netrc file (NETRC, else ~/.netrc); no network asked."""
    import netrc

    try:
        hosts = netrc.netrc(os.environ.get("NETRC")).hosts
    except (OSError, netrc.NetrcParseError):
        return False
    return any("wandb" in host for host in hosts)


def _elsewhere(name: str) -> Callable[[Path], Any]:
    """Trackers trainloop does not configure: accelerate's class, logging where its own settings say."""
    def build(run_dir: Path):
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        cls = LOGGER_TYPE_TO_CLASS[name]
        return cls(PROJECT, run_dir / name) if cls.requires_logging_directory else cls(PROJECT)
    return build


def _samples_tensorboard(tracker, step: int | None, samples: list[dict]) -> None:
    for i, sample in enumerate(samples):  # markdown: a fenced block keeps the text's lines and spaces
        tracker.writer.add_text(f"samples/{i}", f"prompt: `{sample.get('prompt', '')}`\n\n```\n{sample['text']}\n```",
                                global_step=step)
    tracker.writer.flush()


def _samples_mlflow(tracker, step: int | None, samples: list[dict]) -> None:
    import mlflow

    text = "".join(f"--- prompt {sample.get('prompt', '')!r}\n{sample['text']}\n" for sample in samples)
    mlflow.log_text(text, f"samples/step_{step or 0:07d}.txt")  # MLflow has no text metric: an artifact per step


def _samples_wandb(tracker, step: int | None, samples: list[dict]) -> None:
    import wandb

    rows = [[sample.get("prompt", ""), sample["text"]] for sample in samples]
    tracker.run.log({"samples": wandb.Table(columns=["prompt", "text"], data=rows)}, step=step)


def _samples_as_strings(tracker, step: int | None, samples: list[dict]) -> None:
    tracker.log({f"samples/{i}": sample["text"] for i, sample in enumerate(samples)}, step=step)


def _mlflow_names(values: dict) -> dict:
    """MLflow refuses a metric name outside [\\w/.- :] or one that is not a normal path (a//b): a
    data.sources path in tokens_per_source/PATH would stop the run."""
    return {re.sub(r"[^\w/.\- :]", "_", posixpath.normpath(key)).lstrip("/"): value for key, value in values.items()}


def _same_names(values: dict) -> dict:
    return values


def _fail_mlflow(tracker) -> None:
    import mlflow

    mlflow.end_run(status="FAILED")


def _fail_wandb(tracker) -> None:
    tracker.run.finish(exit_code=1)


def _finish(tracker) -> None:
    tracker.finish()


@dataclass(frozen=True)
class Tracker:
    package: str  # the module a run needs; named but missing: refused before training
    install: str  # the command that brings it
    build: Callable[[Path], Any]  # the run dir -> accelerate's tracker, not yet started
    log_samples: Callable = _samples_as_strings  # an event=samples record: generated text
    fail: Callable = _finish  # a run that raised: end the tracker's run, marked failed where it can be
    names: Callable[[dict], dict] = _same_names  # the metric names the tracker accepts


# Every tracker accelerate 1.15 supports (tests/test_trackers.py checks the list against it).
TRACKERS = {
    "tensorboard": Tracker("tensorboard", "pip install tensorboard", _tensorboard, _samples_tensorboard),
    "mlflow": Tracker("mlflow", "pip install 'trainloop[mlflow]'", _mlflow, _samples_mlflow, _fail_mlflow,
                      _mlflow_names),
    "wandb": Tracker("wandb", "pip install 'trainloop[wandb]'", _wandb, _samples_wandb, _fail_wandb),
    **{name: Tracker(package, f"pip install {package}", _elsewhere(name)) for name, package in (
        ("aim", "aim"), ("comet_ml", "comet_ml"), ("clearml", "clearml"), ("dvclive", "dvclive"),
        ("swanlab", "swanlab"), ("trackio", "trackio"))},
}


def tracker_problems(names) -> list[str]:
    """logging.trackers: each a known tracker, installed; for validate()."""
    problems = []
    for name in names:
        if name not in TRACKERS:
            problems.append(f"logging.trackers: {name!r} is not a tracker; choose from: {', '.join(TRACKERS)} "
                            "(or logging.trackers=[] for none)")
        elif importlib.util.find_spec(TRACKERS[name].package) is None:
            problems.append(f"logging.trackers: {name} is not installed: {TRACKERS[name].install}, "
                            f"or drop {name} from logging.trackers")
    if len(set(names)) < len(names):
        problems.append(f"logging.trackers={list(names)} names a tracker twice")
    return problems


def hyperparameters(cfg) -> dict[str, Any]:
    """The whole composed config as KEY.PATH -> value; lists as JSON (trackers take scalars)."""
    from omegaconf import OmegaConf

    flat = {}

    def walk(node, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, list) else value
    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return flat


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """A metrics.jsonl record's numbers, by name: nested dicts as NAME/KEY, lists as NAME/INDEX."""
    out = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, list):
            out.update(scalars(dict(enumerate(value)), f"{name}/"))
        elif isinstance(value, (int, float)):  # bools as 0/1; strings and None are not scalars
            out[name] = value
    return out


class Trackers:
    """The run's trackers, started by accelerate; Metrics.write hands each record to `log`."""

    def __init__(self, accelerator, names):
        self.accelerator = accelerator
        self.names = list(names)

    @classmethod
    def start(cls, accelerator, cfg, run_dir: Path) -> Trackers | None:
        if not cfg.logging.trackers:
            return None
        if accelerator.is_main_process:
            run_dir = Path(run_dir)
            # instances, not names: accelerate would take the run dir at construction, before it is agreed
            accelerator.log_with = [TRACKERS[name].build(run_dir) for name in cfg.logging.trackers]
            accelerator.init_trackers(PROJECT, config=hyperparameters(cfg))
            log.info("trackers: %s", ", ".join(cfg.logging.trackers))
        return cls(accelerator, cfg.logging.trackers)

    def log(self, record: dict) -> None:
        """One metrics.jsonl record: train and eval keys as they are, an event's under EVENT/."""
        record = dict(record)
        step, event = record.pop("step", None), record.pop("event", None)
        samples = record.pop("samples", None) if event == "samples" else None
        values = scalars(record, f"{event}/" if event else "")
        for name, tracker in zip(self.names, self.accelerator.trackers):  # started on the main process only
            if values:
                tracker.log(TRACKERS[name].names(values), step=step)
            if samples:
                TRACKERS[name].log_samples(tracker, step, samples)

    def fail(self) -> None:
        """A run that raised: each tracker's run ends, flushed, marked failed where it can be."""
        for name, tracker in zip(self.names, self.accelerator.trackers):
            TRACKERS[name].fail(tracker)
