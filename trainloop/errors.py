"""How a run ends: the exception types that stop it and the exit code of each.

Exit codes of `python -m trainloop` (each rank's; torchrun and `accelerate launch` themselves
exit 1 whenever a rank exits non-zero, and print each rank's code):
  0   finished (or stopped at trainer.stop_at_step, with a checkpoint)
  1   an unexpected error (traceback)
  2   a bad config or input (one message naming the key or file), a checkpoint that cannot be
      saved (disk full) or loaded (truncated, corrupt)
  3   stopped on a non-finite loss or gradient norm (trainer.on_nonfinite=stop)
  75  preempted: SIGTERM, SIGUSR1 or one Ctrl-C; a checkpoint was saved, run the same command
      again to continue, with hydra.run.dir=RUN_DIR where Hydra made the run dir from the launch
      time (EX_TEMPFAIL: "try again later"; 143 would look like a plain kill)
  130 a second Ctrl-C: stopped at once, without a checkpoint

This module imports nothing from trainloop, so every module can raise these.
"""

EXIT_BAD_CONFIG = 2
EXIT_NONFINITE = 3
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130


class ConfigError(ValueError):
    """A config (or input) that cannot work; exit EXIT_BAD_CONFIG. The message names the key and what to change.
    `every_rank`: found by the config's own checks, which every rank makes alike, so the main rank alone says it."""

    every_rank = False


class CheckpointError(ConfigError):
    """A checkpoint could not be saved (disk full) or loaded: one message, no traceback, exit 2."""


class Preempted(Exception):
    """Every rank agreed to stop on a signal and the checkpoint is saved; exit EXIT_PREEMPTED."""


class NonFiniteError(RuntimeError):
    """Training met a non-finite loss, gradient norm or parameter; exit EXIT_NONFINITE."""
