"""`python -m trainloop.evaluate RUN_DIR_OR_MODEL --tasks TASK[,TASK...]`: lm-evaluation-harness on a saved model.

RUN_DIR_OR_MODEL is a run directory (its final/ is scored), a model directory (a config.json beside
the weights: final/, or any model transformers loads), or one of a run's checkpoints
(RUN_DIR/checkpoints/step_N) whose model.safetensors holds the whole model (a run on one process or
DDP, without an adapter: under DeepSpeed, FSDP2 or LoRA a checkpoint holds shards or an adapter, and
eval.harness scores the live model instead). The model is loaded as the harness's command line loads
it, `lm_eval --model hf --model_args pretrained=DIR,dtype=float32`, and the harness's table printed:
the same numbers as that command, and as eval.harness logs for the same weights at the end of a run.
Tasks are found as eval.harness finds them (trainloop/observe/harness.py): the shipped ones in
examples/harness, --include_path, then the harness's registry. Exit 0, or 2 for input it cannot score.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from trainloop.errors import ConfigError


def model_dir(path: Path, scratch: Path) -> Path:
    """The directory HFLM loads for `path`: itself, its final/, or a checkpoint made loadable in `scratch`."""
    if not path.exists():
        raise ConfigError(f"{path} does not exist: give a run directory, its final/, or a checkpoint")
    for directory in (path, path / "final"):
        if (directory / "config.json").is_file():
            return language_model(directory)
    if (path / "trainer_state.json").is_file():  # a checkpoint (trainloop/checkpoint/commit.py writes it)
        return checkpoint_model(path, scratch)
    hint = " (the run has not finished: name one of its checkpoints/step_N)" if (path / "checkpoints").is_dir() else ""
    raise ConfigError(f"{path} holds no model: give a run directory with a final/, a model directory "
                      f"(with a config.json), or a checkpoint{hint}")


def language_model(directory: Path) -> Path:
    """`directory`, if its config.json describes a model with a language-model head (the harness
    scores next-token log-probabilities); a reward model's score head is refused, named."""
    config = json.loads((directory / "config.json").read_text())
    heads = [name for name in config.get("architectures") or [] if name.endswith("ForSequenceClassification")]
    if heads:
        raise ConfigError(f"{directory} is a reward model ({heads[0]}: a score head, no language-model head), "
                          "and lm-evaluation-harness scores a language model's next-token log-probabilities: "
                          "read a reward model's accuracy from its run's eval lines (rewards/accuracy in "
                          "metrics.jsonl), or evaluate a language model's run")
    return directory


def checkpoint_model(checkpoint: Path, scratch: Path) -> Path:
    """A checkpoint's whole model as a directory transformers loads: the config and tokenizer the run built
    from its config.yaml, beside the checkpoint's own model.safetensors (linked, not copied)."""
    from omegaconf import OmegaConf

    from trainloop.data.tokenizer import build_tokenizer
    from trainloop.model.builder import build_model_config, special_token_ids

    from trainloop.objectives import OBJECTIVES

    cfg = OmegaConf.load(checkpoint / "config.yaml")
    weights = checkpoint / "model.safetensors"
    if OBJECTIVES[cfg.objective.name].head != "lm":  # the row's head: objective=reward ends in a score
        raise ConfigError(f"{checkpoint} is a checkpoint of a reward model (objective=reward: a score head, no "
                          "language-model head), and lm-evaluation-harness scores a language model's next-token "
                          "log-probabilities: read its accuracy from the run's eval lines (rewards/accuracy in "
                          "metrics.jsonl)")
    if cfg.adapter.name != "none" or not weights.is_file():
        why = "an adapter" if cfg.adapter.name != "none" else "its model in shards"
        raise ConfigError(f"{checkpoint} holds {why}, not a whole model: evaluate the run's final/, or score "
                          "checkpoints as they are written with eval.harness.tasks=[...] and eval.harness.every=N")
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.model.name_or_path)
    build_model_config(cfg.model, len(tokenizer), special_token_ids(tokenizer)).save_pretrained(scratch)
    tokenizer.save_pretrained(scratch)
    (scratch / "model.safetensors").symlink_to(weights.resolve())
    return scratch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainloop.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a run directory, a model directory, or a checkpoint")
    parser.add_argument("--tasks", required=True, help="comma-separated tasks or groups, e.g. pydoc_order,pydoc_words")
    parser.add_argument("--include_path", help="a folder of your own task YAMLs (eval.harness.include_path)")
    parser.add_argument("--limit", type=float, help="documents per task: N, or a fraction of them below 1")
    parser.add_argument("--num_fewshot", type=int, help="examples in each prompt (default: each task's own)")
    parser.add_argument("--batch_size", type=int, default=8, help="requests per forward (default 8)")
    parser.add_argument("--device", help="cuda, cpu, ... (default: cuda where there is one)")
    parser.add_argument("--dtype", default="float32", help="the weights' dtype for scoring (default float32)")
    parser.add_argument("--output", type=Path, help="also write the harness's results here as JSON")
    args = parser.parse_args(argv)
    try:
        results = score(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    from lm_eval.utils import make_table

    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    if args.output is not None:
        args.output.write_text(json.dumps(results, indent=2, default=str))


def score(args) -> dict:
    """The harness's results for the model `args` names (ConfigError for input it cannot score)."""
    import importlib.util

    from trainloop.observe import harness

    tasks = [task for task in args.tasks.split(",") if task]
    with tempfile.TemporaryDirectory() as scratch:
        directory = model_dir(args.model, Path(scratch))  # before the tasks: indexing the registry takes a minute
        if importlib.util.find_spec("lm_eval") is None:
            raise ConfigError(f"python -m trainloop.evaluate needs lm-evaluation-harness, which is not installed: "
                              f"{harness.INSTALL}")
        if args.include_path is not None and not Path(args.include_path).is_dir():
            raise ConfigError(f"--include_path {args.include_path} is not a folder: give the folder that holds "
                              "your task YAML files")
        manager = harness.task_manager(tasks, args.include_path, keys=("--tasks", "--include_path"))
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        return harness.evaluate("hf", tasks, manager, limit=args.limit, num_fewshot=args.num_fewshot,
                                batch_size=args.batch_size, pretrained=str(directory), dtype=args.dtype, device=device)
