"""A rank does not outlive its launcher.

torchrun (or `accelerate launch`, the `deepspeed` launcher) starts each rank in a session of its
own, so when the launcher is killed outright (`kill -9`, an OOM kill) nothing tells the ranks:
they would train on as orphans. A daemon thread watches the parent; when it is gone the rank
sends itself SIGTERM, which the preemption path (trainloop/preemption.py) turns into "finish
the step, save, exit 75", and if the rank is still alive LAUNCHER_GONE_GRACE_S later (stuck in
a collective with a rank that already died, say) it ends at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from trainloop.preemption import kill_workers

LAUNCHER_GONE_GRACE_S = 20.0  # a rank is gone within this + POLL_S of its launcher's death
POLL_S = 1.0
EXIT_LAUNCHER_GONE = 1


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
