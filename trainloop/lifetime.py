"""A rank does not outlive its launcher.

torchrun (or `accelerate launch`, the `deepspeed` launcher) starts each rank in a session of its
own, so when the launcher is killed outright (`kill -9`, an OOM kill) nothing tells the ranks:
they would train on as orphans. A daemon thread watches the parent; when it is gone the rank
sends itself SIGTERM, which the preemption path (trainloop/preemption.py) turns into "finish
the step, save, exit 75", and if the rank is still alive LAUNCHER_GONE_GRACE_S later (stuck in
a collective with a rank that already died, say) it ends at once.

A DataLoader worker does not outlive its training process either, however that dies (`kill -9`
included). Nothing else would end it: a worker started through the forkserver is the forkserver's
child, so torch's watchdog (which compares os.getppid() with the parent it started with) watches
the forkserver; the forkserver exits when its "alive" pipe from the training process reaches EOF,
but each of its children is handed that pipe's write end (and the resource tracker's), so the
workers, the forkserver and the tracker wait on one another forever. Each worker instead waits on
a pidfd of the training process in a daemon thread and exits the moment it is gone; the forkserver
and the resource tracker then see EOF and exit by themselves.

So does every process os.fork()ed from a run (register_forked_children): `datasets.map` with
data.num_proc > 1 forks a pool and then a Manager, which inherits the pool's task pipe; killed
mid-map, the trainer left the Manager serving forever and the pool's workers waiting on it.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time

from trainloop.preemption import ignore_stop_signals, kill_workers

LAUNCHER_GONE_GRACE_S = 20.0  # a rank is gone within this + POLL_S of its launcher's death
POLL_S = 1.0
EXIT_LAUNCHER_GONE = 1
EXIT_OWNER_GONE = 1  # a DataLoader worker whose training process is gone


def launched_by_launcher(env: dict[str, str]) -> bool:
    return "LOCAL_RANK" in env or int(env.get("WORLD_SIZE", "1")) > 1


def watch_launcher(grace_s: float = LAUNCHER_GONE_GRACE_S) -> threading.Thread | None:
    """Under a launcher, start the thread that ends this rank when the launcher dies."""
    launcher = os.getppid()
    if not launched_by_launcher(dict(os.environ)) or launcher == 1:
        return None
    watcher = threading.Thread(target=_watch, args=(launcher, grace_s), name="trainloop-launcher-watch",
                               daemon=True)
    watcher.start()
    return watcher


def _watch(launcher: int, grace_s: float) -> None:
    stop = threading.Event()  # never set: only its timed wait is used, which a signal cannot cut short
    while os.getppid() == launcher:
        stop.wait(POLL_S)
    print(f"trainloop: the launcher (pid {launcher}) is gone: stopping this rank (SIGTERM: save a "
          f"checkpoint if training), at the latest in {grace_s:.0f} s", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    stop.wait(grace_s)
    print(f"trainloop: this rank did not stop within {grace_s:.0f} s of its launcher's death; ending it now",
          file=sys.stderr, flush=True)
    kill_workers()  # they would wait for a parent that ends without its exit hooks
    os._exit(EXIT_LAUNCHER_GONE)


_forked_children_registered = False


def register_forked_children() -> None:
    """From now on every process os.fork()ed from this one (multiprocessing's fork context:
    datasets.map's pool and Manager, fork DataLoader workers) ends as soon as its parent ends."""
    global _forked_children_registered
    if not _forked_children_registered:
        os.register_at_fork(after_in_child=lambda: end_with(os.getppid()))
        _forked_children_registered = True


def start_loader_worker(trainer: int, worker_id: int) -> None:
    """DataLoader workers' init, bound to the training process's pid (functools.partial): they
    leave the stop signals to it (trainloop.preemption) and end the moment it ends."""
    ignore_stop_signals(worker_id)
    end_with(trainer)


def end_with(owner: int) -> threading.Thread:
    """Start the daemon thread that ends this process (os._exit: no exit hooks, no queue feeder
    to join) as soon as process `owner` has exited, or at once if it already has."""
    watcher = threading.Thread(target=_end_with, args=(owner,), name="trainloop-owner-watch", daemon=True)
    watcher.start()
    return watcher


def _end_with(owner: int) -> None:
    wait_for_exit(owner)
    os._exit(EXIT_OWNER_GONE)


def wait_for_exit(pid: int) -> None:
    """Block until process `pid` has exited. A pidfd (Linux 5.3+) is readable once its process has
    exited, whoever its parent is and whether or not it has been reaped; elsewhere, look every POLL_S."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd_open here: look every POLL_S
        while _exists(pid):
            time.sleep(POLL_S)
        return
    try:
        select.select([pidfd], [], [])
    finally:
        os.close(pidfd)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's
        pass
    return True
