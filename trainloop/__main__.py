"""`python -m trainloop [overrides]`: compose the config with Hydra, check it, train.

Launchers: torchrun and `accelerate launch` pass the rank in the environment; the `deepspeed`
launcher passes `--local_rank=N` on the command line, which Hydra would reject, so it is taken
off sys.argv here. Heavy imports (torch, transformers, deepspeed) wait until a run starts, so
`--help` and `--cfg job` stay fast.

Exit codes: 2 for a bad config, whether Hydra finds it (an unknown key, a wrong type, an unknown
option, before the run starts) or trainloop does (ConfigError); an error that escapes a run that
started exits 1, as Hydra reports it. The full table is in trainloop/errors.py.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

from trainloop.errors import (EXIT_BAD_CONFIG, EXIT_INTERRUPTED, EXIT_NONFINITE, EXIT_PREEMPTED, NonFiniteError,
                              Preempted)
from trainloop.memory.proc import ALLOCATORS, jemalloc_library


def take_launcher_args(argv: list[str]) -> list[str]:
    """Remove `--local_rank=N` / `--local-rank N` (deepspeed launcher) and export LOCAL_RANK."""
    kept, i = [], 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in ("--local_rank", "--local-rank"):
            if not eq:
                i += 1
                value = argv[i] if i < len(argv) else ""
            os.environ.setdefault("LOCAL_RANK", value)
        else:
            kept.append(arg)
        i += 1
    return kept


def rank_overrides() -> list[str]:
    """Ranks other than 0 must not write Hydra's files: rank 0's run dir is the run's."""
    if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0:
        return []
    return ["hydra.output_subdir=null", "hydra/job_logging=stdout", "hydra/hydra_logging=none"]


def exit_code_of_hydra_failure(code, run_started: bool):
    """Hydra reports any error with exit 1; one raised before the task function ran is the
    config's (composing, overriding, type-checking it): exit 2, as for trainloop's own checks."""
    return EXIT_BAD_CONFIG if code == 1 and not run_started else code


def with_jemalloc(argv: list[str], environ: dict, find: Callable[[], str | None] = jemalloc_library) -> str | None:
    """The LD_PRELOAD that `python -m trainloop` (interpreter `argv`, sys.orig_argv) runs again with: jemalloc
    before what is preloaded already, as PyTorch's own CPU launcher (torch.backends.xeon.run_cpu) preloads it.
    glibc's heap keeps freed tensors resident in holes that later tensors fit as the order of the allocations
    allows, so the same run's peak wanders by tens of MB; jemalloc's does not, and is lower at the same speed
    (BENCHMARKS.md). None where the run keeps its malloc: TRAINLOOP_MALLOC=glibc, an allocator preloaded
    already (by the user, or by this before its exec), trainloop not run as `-m trainloop` (a warm rank of the
    test suite, which calls main in a forked process), or jemalloc not installed (`find` finds no library)."""
    choice = environ.get("TRAINLOOP_MALLOC", "jemalloc")
    if choice not in ("jemalloc", "glibc"):
        print(f"trainloop: error: TRAINLOOP_MALLOC={choice!r}: choose jemalloc (the default, where it is "
              "installed) or glibc", file=sys.stderr)
        sys.exit(EXIT_BAD_CONFIG)
    preloaded = environ.get("LD_PRELOAD", "")
    if choice == "glibc" or any(name in preloaded for name in ALLOCATORS) or module_run(argv) != "trainloop":
        return None
    library = find()
    return None if library is None else ":".join(path for path in (library, preloaded) if path)


def with_trainloops_malloc(environ: dict) -> dict:
    """`environ` for a process that is not `python -m trainloop` (a benchmark's baseline: a raw loop, the HF
    Trainer, TRL), with the malloc that `python -m trainloop` takes in it, so that the two are compared alike."""
    preload = with_jemalloc([sys.executable, "-m", "trainloop"], environ)
    return environ if preload is None else {**environ, "LD_PRELOAD": preload}


def module_run(argv: list[str]) -> str | None:
    """The module an interpreter's command line (sys.orig_argv) runs with -m, None for a script or -c: its
    options come first, -W, -X and --check-hash-based-pycs each with a value."""
    args = iter(argv[1:])
    for arg in args:
        if arg == "-m":
            return next(args, None)
        if arg.startswith("-m"):
            return arg[2:]
        if arg in ("-W", "-X", "--check-hash-based-pycs"):
            next(args, None)
        elif not arg.startswith("-") or arg == "-" or arg.startswith("-c"):
            return None
    return None


def main() -> None:
    preload = with_jemalloc(sys.orig_argv, os.environ)  # None off Linux: jemalloc_library finds no .so there
    if preload is not None:  # the same process (pid) starts again, its malloc jemalloc's
        os.environ["LD_PRELOAD"] = preload
        os.execv(sys.executable, sys.orig_argv)
    sys.argv = [sys.argv[0]] + take_launcher_args(sys.argv[1:])
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and any(a in ("-m", "--multirun") for a in sys.argv[1:]):
        # A sweep runs its jobs one after another in this process, and each job's end tears
        # down the process group the launcher set up once: the next job would hang.
        print(f"trainloop: error: a sweep (-m) cannot run under a launcher (WORLD_SIZE={world_size}): "
              "sweep with plain `python -m trainloop -m ...`, or launch each job on its own",
              file=sys.stderr)
        sys.exit(EXIT_BAD_CONFIG)
    if not any(a.startswith("-") and a not in ("-m", "--multirun") for a in sys.argv[1:]):
        sys.argv += rank_overrides()

    import hydra
    from omegaconf import DictConfig

    from trainloop.config.compose import CONFIG_DIR, ConfigError, register_configs
    from trainloop.lifetime import register_forked_children, watch_launcher

    register_configs()
    watch_launcher()  # under a launcher: this rank ends when the launcher dies
    register_forked_children()  # and what it forks ends with it
    run_started = False

    @hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
    def app(cfg: DictConfig) -> float | None:
        from hydra.core.hydra_config import HydraConfig

        from trainloop.run import run
        from trainloop.rundir import LaunchRecord

        nonlocal run_started
        run_started = True
        try:
            return run(cfg, run_dir=HydraConfig.get().runtime.output_dir, record=LaunchRecord.from_hydra(cfg),
                       overrides=HydraConfig.get().overrides.task)
        except ConfigError as err:  # a known bad input: one message, no traceback (once, where every rank finds it)
            say(f"trainloop: error: {err}", to_console=not err.every_rank or int(os.environ.get("RANK", "0")) == 0)
            sys.exit(EXIT_BAD_CONFIG)
        except NonFiniteError as err:
            say(f"trainloop: error: {err}")
            sys.exit(EXIT_NONFINITE)
        except Preempted as stop:  # exit codes: trainloop/errors.py
            print(f"trainloop: {stop}", file=sys.stderr)
            sys.exit(EXIT_PREEMPTED)
        except KeyboardInterrupt:
            print("trainloop: interrupted", file=sys.stderr)
            sys.exit(EXIT_INTERRUPTED)

    code = 0
    try:
        app()
    except SystemExit as done:
        code = exit_code_of_hydra_failure(done.code, run_started)
    except Exception:  # HYDRA_FULL_ERROR=1: Hydra re-raises instead of exiting 1
        if run_started:
            raise
        import traceback

        traceback.print_exc()
        code = EXIT_BAD_CONFIG
    if code == EXIT_BAD_CONFIG and not run_started:
        from trainloop.config.compose import misspelt_keys

        for key in misspelt_keys(sys.argv[1:]):  # Hydra offers `+KEY=VALUE` for an unknown key, which adds nothing
            print(f"trainloop: error: no such key: {key}", file=sys.stderr)
    leave(code, under_launcher=world_size > 1)


def say(message: str, to_console: bool = True) -> None:
    """A run's reason to stop: on stderr, and under torchrun (or `accelerate launch`, which runs it) in the
    rank's error file too, so that the launcher's failure summary, the last thing it prints below its own
    traceback, names the reason instead of a link to its docs."""
    if to_console:
        print(message, file=sys.stderr)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # the format torch.distributed.elastic's ProcessFailure reads
        import json
        import time

        with open(error_file, "w") as out:
            json.dump({"message": message, "timestamp": int(time.time())}, out)


def leave(code, under_launcher: bool) -> None:
    """Exit with `code`. A rank under a launcher skips the interpreter's native teardown once
    Python's exit handlers have run and every stream is flushed: DDP keeps references to the gloo
    process group, so its native threads outlive destroy_process_group, and tearing them down at
    interpreter exit could abort a rank that had finished its work (SIGABRT, `terminate called
    without an active exception`), turning a finished run into a FAILED one."""
    code = 0 if code is None else code
    if not under_launcher or not isinstance(code, int):
        sys.exit(code)
    import atexit
    import logging

    atexit._run_exitfuncs()  # multiprocessing's and trainloop's own exit handlers
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
