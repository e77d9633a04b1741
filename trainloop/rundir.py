"""The run directory a run holds: one run at a time, and the record of each launch's config.

Two launches into one `hydra.run.dir` would interleave their metrics and overwrite each other's
checkpoints, so the main process holds an flock on `RUN_LOCK` in the directory for the whole
run. The kernel drops an flock when its holder dies, so a crashed or killed run never blocks
the next one. The lock file names its holder (host, pid, start time) for the refusal message.

Hydra would write `.hydra/{config,hydra,overrides}.yaml` before trainloop sees the config, so
a launch that is then refused (a bad value, bad data, a run dir in use) would overwrite the
record of the run that really used the directory. trainloop turns that off
(`hydra.output_subdir: null`) and writes the same three files itself once the run is accepted;
the previous launch's files move to `.hydra/launches/NNN/` (001 is the first launch).
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hydra.experimental.callback import Callback

from trainloop.errors import EXIT_BAD_CONFIG, ConfigError

log = logging.getLogger("trainloop")

RUN_LOCK = ".trainloop.lock"
RECORD_DIR = ".hydra"
RECORD_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")


def _holder() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def _describe_holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"host {holder['host']}, pid {holder['pid']}, started {holder['started']}"
    except (OSError, ValueError, KeyError):  # the holder took the lock but has not written yet
        return "a process that has not yet said who it is"


@contextmanager
def hold_run_dir(run_dir: str | os.PathLike):
    """Hold `run_dir` for the duration of the block; refuse it if a live run holds it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"run dir {run_dir} is in use by another run ({_describe_holder(fd)}); "
                              "wait for it to end, stop it, or choose another hydra.run.dir") from None
        except OSError as err:  # a file system without flock (some network mounts): run unguarded
            log.warning("cannot lock run dir %s (%s): a second launch into it would not be refused",
                        run_dir, err)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(_holder()) + "\n").encode(), 0)
        yield run_dir
    finally:
        os.close(fd)  # releases the flock


@dataclass
class LaunchRecord:
    """What Hydra would have written to .hydra/, captured before the run changes its config."""

    config: str
    hydra: str
    overrides: str

    @classmethod
    def from_hydra(cls, cfg) -> "LaunchRecord":
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf

        hydra_cfg = HydraConfig.instance().cfg  # {"hydra": ...}, as Hydra saves it
        return cls(config=OmegaConf.to_yaml(cfg), hydra=OmegaConf.to_yaml(hydra_cfg),
                   overrides=OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task))

    def write(self, run_dir: str | os.PathLike) -> None:
        """Write this launch's files into run_dir/.hydra, keeping the previous launch's."""
        record_dir = Path(run_dir) / RECORD_DIR
        record_dir.mkdir(parents=True, exist_ok=True)
        previous = [record_dir / name for name in RECORD_FILES if (record_dir / name).exists()]
        if previous:
            kept = _next_launch_dir(record_dir / "launches")
            kept.mkdir(parents=True)
            for path in previous:
                path.rename(kept / path.name)
        for name, text in zip(RECORD_FILES, (self.config, self.hydra, self.overrides)):
            (record_dir / name).write_text(text, encoding="utf-8")


def _next_launch_dir(launches: Path) -> Path:
    numbers = [int(p.name) for p in launches.glob("[0-9][0-9][0-9]*") if p.name.isdigit()]
    return launches / f"{max(numbers, default=0) + 1:03d}"


def same_command(run_dir: str | os.PathLike, *overrides: str) -> str:
    """The command that continues a stopped run from its checkpoints in run_dir: the same one, with
    `overrides`. Hydra's default run dir (outputs/DATE/TIME) is made from the launch's time, so the
    same command would start afresh in a new one: then the command names this run's."""
    named = launch_time_dir(run_dir)
    if named:
        overrides = (*overrides, shlex.quote(named))
    return "the same command" + (f" with {' '.join(overrides)}" if overrides else "")


def launch_time_dir(run_dir: str | os.PathLike) -> str | None:
    """hydra.run.dir=RUN_DIR where Hydra made this launch's dir from the time (a ${now:...} in it, the
    default), hydra.sweep.dir=SWEEP_DIR for a sweep's job (in SWEEP_DIR/JOB_NUMBER); None where the
    same command finds it again, or without Hydra (an in-process run is given its run dir)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    key = "sweep" if hydra.mode.name == "MULTIRUN" else "run"
    if "${now:" not in str(OmegaConf.to_container(hydra[key], resolve=False)["dir"]):
        return None
    return f"hydra.{key}.dir={Path(run_dir).parent if key == 'sweep' else run_dir}"


def run_dir_problem(run_dir: str | os.PathLike) -> str | None:
    """Why a run cannot write into run_dir (None if it can). The folder is made here, as Hydra makes
    it next: a path under a file or in a read-only place fails now, by its own error, for root too."""
    path = Path(run_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        where = path.absolute()
        made = next(p for p in (where, *where.parents) if p.exists())  # "/" at the latest
        why = f"{made} is a file" if not made.is_dir() else f"{err.strerror}: {err.filename}"
        return f"cannot create the run dir {path} ({why})"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"cannot write into the run dir {path} (permission denied)"
    return None


class RunDirCheck(Callback):
    """Registered in conf/train.yaml: refuse a run dir nothing can be written to in one line, before
    Hydra opens its log file there (whose failure is a 30-line traceback)."""

    def on_run_start(self, config, **kwargs) -> None:
        self._check(config, "hydra.run.dir")

    def on_multirun_start(self, config, **kwargs) -> None:
        self._check(config, "hydra.sweep.dir")

    @staticmethod
    def _check(config, key: str) -> None:
        from omegaconf import OmegaConf

        try:
            run_dir = OmegaConf.select(config, key)
        except Exception:  # an interpolation only Hydra's job can resolve: Hydra checks it itself
            return
        problem = run_dir_problem(run_dir)
        if problem:  # a callback's exception would only be a warning to Hydra
            print(f"trainloop: error: {problem}; choose another {key}", file=sys.stderr)
            sys.exit(EXIT_BAD_CONFIG)
