"""The process group a run trains in: its size from the launcher's environment, a group of one
described without a launcher (DeepSpeed and FSDP2 need one), and torch.distributed left as found."""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


LAUNCHER_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
MPI_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
_solo_env: dict[str, str] = {}  # what single_process_group_env set, so that a later run in this process knows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_group_env() -> None:
    """Without a launcher, describe a 1-process group on loopback, as torchrun would for one process.

    DeepSpeed needs a process group even for one process, and accelerate only makes one when
    LOCAL_RANK is set; this is how HF Trainer users run `--deepspeed` on one GPU without a launcher.
    """
    launched = [k for k in LAUNCHER_RANK_VARS if k in os.environ and os.environ[k] != _solo_env.get(k)]
    if launched or any(k in os.environ for k in MPI_SIZE_VARS):  # mpirun: accelerate reads its ranks
        return
    # a fresh port each time: a run before this one in the same process (a sweep) held the last one
    _solo_env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    os.environ.update(_solo_env)


# what a process group is made from: single_process_group_env sets them, and accelerate's CPU path too
PROCESS_GROUP_ENV = (*LAUNCHER_RANK_VARS, "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


_held_groups: list = []  # see hold_default_group


def hold_default_group() -> None:
    """Before a multi-process run destroys its process group: keep the group referenced for the rest
    of the process (a launched rank ends with os._exit, which frees nothing; trainloop.__main__.leave).

    A DDP model's reducer references the group and is freed with the GIL held (its binding does not
    drop it). Had destroy_process_group dropped the world's reference, the reducer's would be the
    last, and ProcessGroupGloo's destructor then waits, GIL held, for a worker thread that needs the
    GIL to free the tensors of the work it just ran: 2-process runs hung at exit about one in ten
    on 2 loaded cores (pytorch/pytorch#56297).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        _held_groups.append(dist.group.WORLD)


@contextmanager
def environment_as_found(*keys: str):
    """The environment variables `keys` as they were before the block (set again, or removed)."""
    saved = {key: os.environ.get(key) for key in keys}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def distributed_as_found():
    """Leave torch.distributed and the rank variables as they were before a run in this process.

    A DeepSpeed or FSDP2 run without a launcher exports LOCAL_RANK (single_process_group_env); left
    behind, it made the next 1-process run in the same process (tests, sweeps) a gloo group of one
    with a DDP-wrapped model, whose reducer could hang freeing its process group. A one-process group
    this run made is destroyed even when the run failed: no peer can still be talking to it.
    """
    import torch.distributed as dist

    found = dist.is_available() and dist.is_initialized()
    with environment_as_found(*PROCESS_GROUP_ENV):
        try:
            yield
        finally:
            if not found and dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1:
                dist.destroy_process_group()
