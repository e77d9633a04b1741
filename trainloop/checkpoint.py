"""Checkpoints: atomic saves under RUN_DIR/checkpoints/step_NNNNNNN, resume, retention, preemption.

A save is written to a temporary folder by every rank (accelerate's save_state: model,
optimizer, scheduler, scaler, every RNG per rank, the accumulation micro-step), completed with
the trainer state and the config, synced to disk, marked COMPLETE, renamed into place, and only
then named in `latest`. A folder without COMPLETE is never loaded (a save cut short by SIGKILL
leaves `.tmp_step_*`, removed at the next start), and older checkpoints are removed only after
a newer one is complete. The parameters are checked to be finite first: a non-finite state is
never saved over a good one. The checkpoints folder must be on a file system every node sees.

Exit codes of `python -m trainloop` (each rank's; torchrun and `accelerate launch` themselves
exit 1 whenever a rank exits non-zero, and print each rank's code):
  0   finished (or stopped at trainer.stop_at_step, with a checkpoint)
  1   an unexpected error (traceback)
  2   a bad config (one message naming the key)
  3   stopped on a non-finite loss or gradient norm (trainer.on_nonfinite=stop)
  75  preempted: SIGTERM, SIGUSR1 or one Ctrl-C; a checkpoint was saved, run the same command
      again to continue (EX_TEMPFAIL: "try again later"; 143 would look like a plain kill)
  130 a second Ctrl-C: stopped at once, without a checkpoint
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path

from omegaconf import OmegaConf

from trainloop.config import ConfigError

log = logging.getLogger("trainloop")

COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
TMP_PREFIX = ".tmp_"
EXIT_NONFINITE = 3
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130


class Preempted(Exception):
    """Every rank agreed to stop on a signal and the checkpoint is saved; exit EXIT_PREEMPTED."""


class NonFiniteError(RuntimeError):
    """Training met a non-finite loss, gradient norm or parameter; exit EXIT_NONFINITE."""


def run_fingerprint(cfg, world_size: int) -> dict:
    """What a checkpoint must agree with to be resumed exactly."""
    model = OmegaConf.to_container(cfg.model, resolve=True)
    for key in ("attn_implementation", "gradient_checkpointing"):  # do not change the weights
        model.pop(key)
    return {
        "world_size": world_size,
        "trainer.gradient_accumulation_steps": cfg.trainer.gradient_accumulation_steps,
        "trainer.seed": cfg.trainer.seed,  # the data order is a function of (seed, epoch)
        "data.batch_size": cfg.data.batch_size,
        "data.seq_len": cfg.data.seq_len,
        "deepspeed.stage": cfg.deepspeed.stage,
        **{f"model.{key}": value for key, value in model.items()},
    }


def step_of(path: Path) -> int:
    return int(path.name.rpartition("_")[2])


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


def parameters_finite(accelerator, model) -> bool:
    """True when every rank's parameters (its ZeRO-3 partition, if any) are all finite."""
    import torch

    bad = torch.zeros((), device=accelerator.device)
    for p in model.parameters():
        local = getattr(p, "ds_tensor", p)  # ZeRO-3 keeps this rank's shard in ds_tensor
        if local.numel():
            bad += (~torch.isfinite(local.detach())).any().float()
    return accelerator.reduce(bad, reduction="sum").item() == 0


class Checkpointer:
    def __init__(self, cfg, accelerator, run_dir: Path):
        self.cfg = cfg
        self.every = cfg.checkpoint.every_steps
        self.keep_last = cfg.checkpoint.keep_last
        self.accelerator = accelerator
        self.root = Path(run_dir) / "checkpoints"
        self.fingerprint = run_fingerprint(cfg, accelerator.num_processes)

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.glob("step_*") if (p / COMPLETE).is_file()), key=step_of)

    def last_good(self) -> str:
        found = self.complete()
        return str(found[-1]) if found else "none (no checkpoint was saved yet)"

    def save(self, state, model) -> Path:
        acc = self.accelerator
        final = self.root / f"step_{state.step:07d}"
        if not parameters_finite(acc, model):
            raise NonFiniteError(f"the parameters are not finite after optimizer step {state.step}; "
                                 f"not saving them. The last good checkpoint is {self.last_good()}")
        tmp = self.root / f"{TMP_PREFIX}{final.name}"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))
        acc.wait_for_everyone()  # every rank's files are written (and closed) from here on
        if acc.is_main_process:
            (tmp / STATE_FILE).write_text(json.dumps(
                {"state": state.state_dict(), "fingerprint": self.fingerprint,
                 "max_steps": self.cfg.trainer.max_steps}, indent=2))
            (tmp / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg, resolve=True))
            (tmp / COMPLETE).write_text("")
            _fsync_tree(tmp)
            if final.exists():  # another history's (find_resume refuses that) or a user's copy
                log.warning("replacing %s", final)
                shutil.rmtree(final.rename(self.root / f"{TMP_PREFIX}removing_{final.name}"))
            os.replace(tmp, final)
            _fsync(self.root)  # the rename itself is durable only once the folder is synced
            _write_atomic(self.root / "latest", final.name)
            for old in self.complete()[:-self.keep_last]:
                doomed = old.rename(self.root / f"{TMP_PREFIX}removing_{old.name}")  # never half a checkpoint
                shutil.rmtree(doomed)
            log.info("saved checkpoint %s", final)
        acc.wait_for_everyone()
        return final

    def remove_partial(self) -> None:
        """Remove what a save cut short (SIGKILL, node failure) left behind; main process only."""
        if not (self.accelerator.is_main_process and self.root.is_dir()):
            return
        for partial in self.root.glob(TMP_PREFIX + "*"):
            log.warning("removing %s: a save there did not complete", partial)
            if partial.is_dir():
                shutil.rmtree(partial, ignore_errors=True)
            else:
                partial.unlink(missing_ok=True)

    def find_resume(self) -> Path | None:
        """The checkpoint checkpoint.resume names, checked against this run's config."""
        self.remove_partial()
        spec = self.cfg.checkpoint.resume
        found = self.complete()
        if spec is None:
            if found:
                raise ConfigError(
                    f"checkpoint.resume=null, but {self.root} already holds checkpoints (latest "
                    f"{found[-1].name}) that this run would mix with its own. Use "
                    "checkpoint.resume=auto to continue them, or a new hydra.run.dir")
            return None
        if spec == "auto":
            if not found:
                log.info("checkpoint.resume=auto: no complete checkpoint in %s; starting fresh", self.root)
                return None
            path = found[-1]
        else:
            path = Path(spec).expanduser()
            if not (path / COMPLETE).is_file():
                raise ConfigError(f"checkpoint.resume={spec!r} is not a complete checkpoint "
                                  f"(no {COMPLETE} marker); give a checkpoints/step_NNNNNNN folder, "
                                  "or auto for the latest in the run directory")
        saved = json.loads((path / STATE_FILE).read_text())
        changed = [f"{k}: {saved['fingerprint'].get(k)!r} -> {v!r}"
                   for k, v in self.fingerprint.items() if saved["fingerprint"].get(k) != v]
        if changed:
            raise ConfigError(f"checkpoint {path} was made with another config; changed: "
                              + "; ".join(changed) + ". Restore those settings to resume it, or "
                              "start a new run in a new hydra.run.dir")
        newer = [p.name for p in found if step_of(p) > saved["state"]["step"]]
        if newer:
            raise ConfigError(f"checkpoint.resume={spec!r}: {self.root} holds later checkpoints "
                              f"({', '.join(newer)}) that this run would mix with its own; resume "
                              "into a new hydra.run.dir (a checkpoint path works from any run dir)")
        if saved.get("max_steps") != self.cfg.trainer.max_steps:
            log.warning("trainer.max_steps changed since %s (%s -> %s): the learning-rate schedule "
                        "now runs to %s", path.name, saved.get("max_steps"),
                        self.cfg.trainer.max_steps, self.cfg.trainer.max_steps)
        return path

    def load(self, path: Path, state) -> None:
        # Model, optimizer, scheduler, scaler, RNG states and accelerate's micro-step counter;
        # the data position is in `state`: the loop skips that many batches of the epoch.
        self.accelerator.load_state(str(path))
        state.load_state_dict(json.loads((path / STATE_FILE).read_text())["state"])
        log.info("resumed from %s at step %d (epoch %d, batch %d)", path, state.step, state.epoch,
                 state.batches_in_epoch)


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader workers' init: a scheduler signals every process, but a worker that dies on
    SIGTERM (torch's default there) or Ctrl-C crashes the main process before it can save.
    The main process kills its workers at exit instead (see _kill_workers_at_exit)."""
    for name in Preemption.SIGNALS:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)


def _kill_workers_at_exit() -> None:
    """multiprocessing ends daemonic children at exit with SIGTERM and waits for them; workers
    that ignore SIGTERM would make that wait endless after a crash, so SIGKILL them first."""
    import multiprocessing

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would report these kills
    for child in multiprocessing.active_children():
        if child.daemon and child.pid:
            os.kill(child.pid, signal.SIGKILL)


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
