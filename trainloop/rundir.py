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
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from trainloop.errors import ConfigError

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
