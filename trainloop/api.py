"""`trainloop.train(...)`: a run from Python (a notebook, a script), with reward functions, tools and an
environment given as Python objects, where the command line can only name them (`file.py:name`).

    import trainloop

    def brief(prompts, completions, **columns):
        return [1.0 if len(c[-1]["content"]) < 20 else 0.0 for c in completions]

    done = trainloop.train(["+preset=smoke", "data=prompts", "data.path=prompts.jsonl", "objective=grpo"],
                           rewards=[brief])
    done.run_dir, done.metrics["reward"]

The overrides are those of `python -m trainloop`; the objects are named in the config as
`trainloop.given:NAME` (NAME the function's or class's own), so the run, its checkpoint and its
messages say which was used, and reward metrics keep the function's name (rewards/brief). The run is
this process's (one process, as `python -m trainloop` without a launcher), logged to the run dir's
train.log and to stderr as the command's run is; `run_dir` defaults to outputs/DATE/TIME as Hydra's.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from trainloop.errors import ConfigError

LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's job logging, as the command logs


@dataclass
class Trained:
    """What trainloop.train returns: the run dir, and its last train line merged with its last eval line."""

    run_dir: Path
    metrics: dict = field(default_factory=dict)


def train(overrides: Sequence[str] = (), *, rewards: Sequence[Callable] = (), tools: Sequence[Callable] = (),
          environment: type | None = None, run_dir: str | Path | None = None) -> Trained:
    """Train as `python -m trainloop OVERRIDES` does, in this process. `rewards` (objective.rewards), `tools`
    (objective.tools) and `environment` (objective.environment): Python objects, named by the config
    through trainloop.given; giving both an object and its key in `overrides` is refused."""
    from trainloop.config.compose import compose_config
    from trainloop.run import run

    overrides = list(overrides)
    for key, given in (("objective.rewards", rewards), ("objective.tools", tools),
                       ("objective.environment", [environment] if environment is not None else [])):
        if not given:
            continue
        if any(o.lstrip("+~").startswith(f"{key}=") for o in overrides):
            raise ConfigError(f"{key} is given twice: as Python objects to trainloop.train and as {key}=... in the "
                              "overrides; give it once")
        specs = [give(obj) for obj in given]
        overrides.append(f"{key}={specs[0]}" if key == "objective.environment" else f"{key}=[{','.join(specs)}]")
    if run_dir is None:
        run_dir = Path("outputs") / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S")
    run_dir = Path(run_dir)
    cfg = compose_config(overrides)  # checked as a run checks it, before anything is built
    run_dir.mkdir(parents=True, exist_ok=True)
    with logged_to(run_dir / "train.log"):
        run(cfg, run_dir=run_dir, overrides=overrides)
    return Trained(run_dir, last_metrics(run_dir))


def give(obj) -> str:
    """`obj` as an attribute of trainloop.given, named by its own name (a second object of that name: NAME_2)."""
    import trainloop.given as given

    name = getattr(obj, "__name__", None)
    if not callable(obj) or not name or not name.isidentifier():
        raise ConfigError(f"{obj!r} is not a named function or class: trainloop.train names each object it is "
                          "given by its __name__ (a lambda has none: define it with def)")
    base, n = name, 1
    while getattr(given, name, obj) is not obj:
        n += 1
        name = f"{base}_{n}"
    setattr(given, name, obj)
    return f"trainloop.given:{name}"


class logged_to:
    """The run's log lines to `path` and to stderr for the duration of the run, as Hydra's job logging
    sends them (the root logger at INFO); the handlers and the level are put back after."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        root = logging.getLogger()
        self.level = root.level
        formatter = logging.Formatter(LOG_FORMAT)
        self.handlers = [logging.FileHandler(self.path), logging.StreamHandler(sys.stderr)]
        for handler in self.handlers:
            handler.setFormatter(formatter)
            root.addHandler(handler)
        root.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        root = logging.getLogger()
        for handler in self.handlers:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(self.level)


def last_metrics(run_dir: Path) -> dict:
    """The last train line of metrics.jsonl, with the last eval line's values over it."""
    import json

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out = {}
    for key in ("loss", "eval_loss"):
        last = next((line for line in reversed(lines) if key in line and "event" not in line), None)
        if last is not None:
            out.update(last)
    return out
