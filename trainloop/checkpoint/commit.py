"""The durable commit: a save is written to a temporary folder, completed with the config, the
checksums and the trainer state, synced to disk, marked COMPLETE, renamed into place, and only then
named in `latest`; older checkpoints are removed only after a newer one is complete, each renamed
aside first so no half of one is ever left under its name."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path

from trainloop.checkpoint.integrity import COMPLETE, KEY, STATE_FILE, TMP_PREFIX, complete, file_sizes, gather

log = logging.getLogger("trainloop")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True) + [root]:
        _fsync(path)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(TMP_PREFIX + path.name)
    tmp.write_text(text)
    _fsync(tmp)
    os.replace(tmp, path)


def commit(tmp: Path, final: Path, record: dict, config_yaml: str, keep_last: int) -> None:
    """Main process: config, checksums, trainer state (`record` with the files' sizes and checksums),
    COMPLETE, fsync, rename into place, `latest`, retention of the newest `keep_last`."""
    root = final.parent
    (tmp / "config.yaml").write_text(config_yaml)
    checksums = gather(tmp)
    (tmp / STATE_FILE).write_text(json.dumps({**record, "files": file_sizes(tmp), KEY: checksums}, indent=2))
    (tmp / COMPLETE).write_text("")
    _fsync_tree(tmp)
    if final.exists():  # another history's (find_resume refuses that) or a user's copy
        log.warning("replacing %s", final)
        shutil.rmtree(final.rename(root / f"{TMP_PREFIX}removing_{final.name}"))
    os.replace(tmp, final)
    _fsync(root)  # the rename itself is durable only once the folder is synced
    _write_atomic(root / "latest", final.name)
    for old in complete(root)[:-keep_last]:
        doomed = old.rename(root / f"{TMP_PREFIX}removing_{old.name}")  # never half a checkpoint
        shutil.rmtree(doomed)
    log.info("saved checkpoint %s", final)


def no_space_left(err: BaseException, where: Path, needed: int) -> bool:
    """ENOSPC anywhere in the chain; torch's zip writer reports a short write without errno
    ("unexpected pos"), so a disk with less free space than a checkpoint takes counts too."""
    cause = err
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
            return True
        cause = cause.__cause__ or cause.__context__
    return shutil.disk_usage(where).free < max(needed, 1 << 20)
