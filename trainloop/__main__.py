"""`python -m trainloop [overrides]`: compose the config with Hydra, check it, train.

Launchers: torchrun and `accelerate launch` pass the rank in the environment; the `deepspeed`
launcher passes `--local_rank=N` on the command line, which Hydra would reject, so it is taken
off sys.argv here. Heavy imports (torch, transformers, deepspeed) wait until a run starts, so
`--help` and `--cfg job` stay fast.
"""

from __future__ import annotations

import os
import sys


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


def main() -> None:
    sys.argv = [sys.argv[0]] + take_launcher_args(sys.argv[1:])
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and any(a in ("-m", "--multirun") for a in sys.argv[1:]):
        # A sweep runs its jobs one after another in this process, and each job's end tears
        # down the process group the launcher set up once: the next job would hang.
        print(f"trainloop: error: a sweep (-m) cannot run under a launcher (WORLD_SIZE={world_size}): "
              "sweep with plain `python -m trainloop -m ...`, or launch each job on its own",
              file=sys.stderr)
        sys.exit(2)
    if not any(a.startswith("-") and a not in ("-m", "--multirun") for a in sys.argv[1:]):
        sys.argv += rank_overrides()

    import hydra
    from omegaconf import DictConfig

    from trainloop.errors import EXIT_INTERRUPTED, EXIT_NONFINITE, EXIT_PREEMPTED, NonFiniteError, Preempted
    from trainloop.config import CONFIG_DIR, ConfigError, check_command_line, register_configs

    register_configs()

    @hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
    def app(cfg: DictConfig) -> float | None:
        from hydra.core.hydra_config import HydraConfig

        from trainloop.run import run

        try:
            check_command_line(cfg, HydraConfig.get().overrides.task)
            return run(cfg, run_dir=HydraConfig.get().runtime.output_dir)
        except ConfigError as err:  # a known bad input: one message, no traceback
            print(f"trainloop: error: {err}", file=sys.stderr)
            sys.exit(2)
        except NonFiniteError as err:
            print(f"trainloop: error: {err}", file=sys.stderr)
            sys.exit(EXIT_NONFINITE)
        except Preempted as stop:  # exit codes: trainloop/errors.py
            print(f"trainloop: {stop}", file=sys.stderr)
            sys.exit(EXIT_PREEMPTED)
        except KeyboardInterrupt:
            print("trainloop: interrupted", file=sys.stderr)
            sys.exit(EXIT_INTERRUPTED)

    app()


if __name__ == "__main__":
    main()
