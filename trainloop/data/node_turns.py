"""Build the data once per node, with the node's other ranks waiting outside any collective.

accelerate's `main_process_first` makes the other ranks wait in a barrier, a collective that
fails after the process group's timeout (trainer.collective_timeout_s): tokenizing a large corpus
takes longer and kills the job. Here the node's local main process builds first while the other
ranks poll marker files in RUN_DIR/.data_build/, with no time limit but the builder's life: if it
fails they stop with its message, if it dies they stop saying so. Then they build too (a cache
hit for data read from files: `datasets` caches the tokenized rows), while the builder waits for
them the same way, so that no rank enters a training collective while another still builds.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

from trainloop.errors import ConfigError

log = logging.getLogger("trainloop")

POLL_S = 0.2


class DataBuildFailed(RuntimeError):
    """Another rank of this node failed to build the data, or died building it."""


def alive(pid: int) -> bool:
    """pid runs, and is not a zombie (a dead child its launcher has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def write_failure(path: Path, err: BaseException) -> None:
    path.write_text(json.dumps({"config_error": isinstance(err, ConfigError),
                                "message": str(err) or type(err).__name__}))


def raise_failure(path: Path, who: str) -> None:
    failure = json.loads(path.read_text())
    if failure["config_error"]:  # the same one line (exit 2) on every rank
        raise ConfigError(failure["message"])
    raise DataBuildFailed(f"{who} failed while building the data ({failure['message']}); see its traceback")


def wait_for(done: Path, failed: Path, pid: int, who: str) -> None:
    """Until `done` appears; stop if `failed` does (with its message) or the process `pid` ends."""
    while not done.exists():
        if failed.exists():
            raise_failure(failed, who)
        if not alive(pid):
            if done.exists():
                return
            raise DataBuildFailed(f"{who} (pid {pid}) ended while building the data for this node; see its output")
        time.sleep(POLL_S)


def build_once_per_node(strategy, run_dir: str | os.PathLike, build):
    """`build()` on every rank, the node's local main process first; returns what it returns.
    `strategy`: trainloop.parallel's, for the processes of the run."""
    if strategy.world_size == 1:
        return build()
    accelerator = strategy.accelerator
    rank, local_rank = accelerator.process_index, accelerator.local_process_index
    holder = rank - local_rank  # the global rank of this node's local main process
    folder = Path(run_dir) / ".data_build" / f"node_of_rank_{holder}"
    if local_rank == 0:  # a fresh folder: a resumed run's run dir may hold an earlier run's markers
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        (folder / "builder").write_text(str(os.getpid()))
    accelerator.wait_for_everyone()  # every rank is here: the folder is fresh, the builder named
    if local_rank:
        (folder / f"waiting_{rank}").write_text(str(os.getpid()))
    accelerator.wait_for_everyone()  # every waiting rank is named: the builder knows whom to wait for
    if local_rank == 0:
        return build_first(folder, build)
    wait_for(folder / "ready", folder / "failed", int((folder / "builder").read_text()),
             f"rank {holder}, the local main process")
    try:
        result = build()
    except BaseException as err:
        write_failure(folder / f"failed_{rank}", err)
        raise
    (folder / f"done_{rank}").touch()
    return result


def build_first(folder: Path, build):
    """The builder: build, say so, then wait for the node's other ranks to build from the cache."""
    started = time.monotonic()
    try:
        result = build()
    except BaseException as err:
        write_failure(folder / "failed", err)
        raise
    (folder / "ready").touch()
    waiting = sorted(folder.glob("waiting_*"))
    log.info("built the data in %.0f s while %d other rank(s) of this node waited outside any collective",
             time.monotonic() - started, len(waiting))
    for marker in waiting:
        rank = marker.name.partition("_")[2]
        wait_for(folder / f"done_{rank}", folder / f"failed_{rank}", int(marker.read_text()), f"rank {rank}")
    shutil.rmtree(folder, ignore_errors=True)
    try:
        folder.parent.rmdir()  # unless another node's folder is still there
    except OSError:
        pass
    return result
