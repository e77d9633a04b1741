"""Preemption: SIGTERM, SIGUSR1 and Ctrl-C ask the run to save a checkpoint and stop.

The handler only sets a flag; the loop (trainloop/guard.py) agrees on it across ranks at the
next optimizer step. DataLoader workers leave these signals to the training process.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time

from trainloop.errors import EXIT_PREEMPTED, NonFiniteError, Preempted

log = logging.getLogger("trainloop")


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader workers' init: a scheduler signals every process, but a worker that dies on
    SIGTERM (torch's default there) or Ctrl-C crashes the main process before it can save.
    The main process kills its workers at exit instead (see _kill_workers_at_exit)."""
    for name in Preemption.SIGNALS:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)


def kill_workers() -> None:
    """SIGKILL this process's DataLoader workers (its daemonic multiprocessing children)."""
    import multiprocessing

    for child in multiprocessing.active_children():
        if child.daemon and child.pid:
            try:
                os.kill(child.pid, signal.SIGKILL)
            except ProcessLookupError:  # it exited meanwhile
                pass


def _kill_workers_at_exit() -> None:
    """multiprocessing ends daemonic children at exit with SIGTERM and waits for them; workers
    that ignore SIGTERM would make that wait endless after a crash, so SIGKILL them first."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would report these kills
    kill_workers()


class Preemption:
    """SIGTERM, SIGUSR1 (SLURM's warning) and one Ctrl-C ask the run to stop after this step.

    The handler only sets a flag; the loop agrees on it across ranks at the next optimizer step,
    saves a checkpoint and raises Preempted. A second Ctrl-C stops at once (KeyboardInterrupt).
    Launchers forward a Ctrl-C they also received, so a second SIGINT within a second of the
    first counts as the same one.
    """

    SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")

    def __init__(self):
        self.requested: str | None = None
        self._first_at = 0.0
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.requested and name == "SIGINT" and now - self._first_at > 1.0:
            raise KeyboardInterrupt("second Ctrl-C: stopping at once, without a checkpoint")
        if not self.requested:
            self.requested, self._first_at = name, now
            log.warning("received %s: finishing this optimizer step, saving a checkpoint, then exiting "
                        "with code %d (Ctrl-C again to stop at once)", name, EXIT_PREEMPTED)

    def __enter__(self) -> "Preemption":
        atexit.unregister(_kill_workers_at_exit)  # once, and after multiprocessing's own hook
        atexit.register(_kill_workers_at_exit)
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                if hasattr(signal, name):
                    sig = getattr(signal, name)
                    self._previous[sig] = signal.signal(sig, self._handle)
        else:
            log.warning("not in the main thread: SIGTERM/SIGUSR1 will not save a checkpoint")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type in (Preempted, NonFiniteError):
            # Every rank agreed to stop and exits with its own code; a launcher that saw another
            # rank exit first sends SIGTERM to the rest, which must not turn their code into -15.
            # SIG_IGN, unlike a Python handler, lasts through the interpreter's shutdown.
            self.requested = self.requested or "stop"
            for sig in self._previous:
                if sig != signal.SIGINT:  # a second Ctrl-C still stops at once
                    signal.signal(sig, signal.SIG_IGN)
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
