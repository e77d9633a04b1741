"""EleutherAI's lm-evaluation-harness on the model: as it trains (eval.harness) and once it is saved
(`python -m trainloop.evaluate`, trainloop/tools/evaluate.py).

The harness (`lm_eval`, the `trainloop[eval]` extra) scores a model on tasks written as its own
YAML files: the two shipped in examples/harness, a folder of yours (eval.harness.include_path), or
its registry's thousands where the hub is at hand. It is imported only when eval.harness.tasks is
set; a task it cannot find or load, or the extra not installed, stops the run before training.

During training the live model is scored, not a copy: the harness's own HFLM over the module the
strategy holds (trainloop/observe/live_lm.py), at the scheduled steps (eval.harness.every, and the
last). Every rank scores every request of every task, in the same batches: under ZeRO-3 and FSDP2,
where each forward gathers the weights from all ranks, no rank runs a forward the others do not, and
generation keeps them in step (synced_gpus). The main process logs the scores (event=harness, a key
TASK/METRIC each) to metrics.jsonl and the trackers. With LoRA the adapted model is scored, which is
what the merged export in final/ computes. The harness seeds Python's, NumPy's and torch's generators
as its command line does; the run's own streams are put back after, so a run trains the same with
the harness as without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import sys
import tempfile
from pathlib import Path

from trainloop.errors import ConfigError

KEY = "eval.harness"
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # trainloop/
SHIPPED = PACKAGE_DIR / "examples" / "harness"  # an installed wheel's copy
if not SHIPPED.is_dir():  # a source checkout or editable install: examples/ beside the package
    SHIPPED = PACKAGE_DIR.parent / "examples" / "harness"
INSTALL = "pip install 'trainloop[eval]' (in a checkout: .venv/bin/pip install -c constraints.txt -e '.[eval]')"
TORCH_SEED = 1234  # lm_eval's own (its command line's --seed 0,1234,1234,1234)
QUIET_LINE = re.compile(r"\d+%\||^fatal: not a git repository")  # a tqdm frame; git outside a repository
# lines the harness writes for any model handed to it as an object, or any task that loads its own data
# (the shipped ones): they say nothing about this run
NOISE = {"lm_eval.models.huggingface": ("`pretrained` model kwarg is not of type `str`",
                                        "Passed an already-initialized model"),
         "lm_eval.api.task": ("Custom kwargs can be passed",)}


def problems(cfg) -> list[str]:
    """The eval.harness keys that cannot work together with the rest of the config (no import of the harness)."""
    import importlib.util

    from trainloop.objectives import OBJECTIVES
    from trainloop.parallel.degrees import splits

    h, out = cfg.eval.harness, []
    if h.num_fewshot is not None and h.num_fewshot < 0:
        out.append(f"{KEY}.num_fewshot={h.num_fewshot} must be 0 or more, or null")
    if not h.tasks:
        return out
    if importlib.util.find_spec("lm_eval") is None:
        out.append(f"{KEY}.tasks needs lm-evaluation-harness, which is not installed: {INSTALL}")
    if h.include_path is not None and not Path(h.include_path).is_dir():
        out.append(f"{KEY}.include_path={h.include_path} is not a folder: give the folder that holds your task "
                   "YAML files")
    if OBJECTIVES[cfg.objective.name].head != "lm":
        out.append(f"{KEY} scores a language model's next-token probabilities, and objective={cfg.objective.name} "
                   f"trains a model that ends in a scalar score: drop {KEY}.tasks")
    if split := splits(cfg):
        out.append(f"{KEY} runs the model's whole forward in every process, and {', '.join(split)} splits it: "
                   "score final/ after training instead (python -m trainloop.evaluate RUN_DIR --tasks ...), "
                   f"or drop {KEY}.tasks")
    return out


def task_manager(tasks: list[str], include_path: str | None = None, keys: tuple[str, str] = (f"{KEY}.tasks",
                 f"{KEY}.include_path")):
    """lm_eval's TaskManager, knowing every one of `tasks`: the shipped tasks' folder and include_path are
    indexed first (milliseconds); the harness's registry (some 15,000 YAML files, 15 s) only when a task is
    in neither. A task found nowhere: ConfigError naming `keys` (the tasks' and the folder's)."""
    quiet_harness()
    from lm_eval.tasks import TaskManager

    paths = [str(SHIPPED)]
    if include_path is not None and Path(include_path).resolve() != SHIPPED.resolve():
        paths.append(str(include_path))
    manager = TaskManager(include_path=paths, include_defaults=False)
    if _unknown(manager, tasks):
        manager = TaskManager(include_path=paths)
    unknown = _unknown(manager, tasks)
    if unknown:
        shipped = sorted(re.search(r"^task:\s*(\S+)", f.read_text(), re.MULTILINE).group(1)
                         for f in SHIPPED.glob("*.yaml"))
        raise ConfigError(
            f"{keys[0]}: no task {', '.join(unknown)} in the shipped tasks ({SHIPPED}: {', '.join(shipped)}), "
            f"{include_path if include_path is not None else keys[1] + ' (not set)'} or the harness's registry; "
            "`lm_eval ls tasks --include_path DIR` lists the tasks a folder holds")
    return manager


def local(manager, tasks: list[str], include_path: str | None) -> bool:
    """Every one of `tasks` is a YAML file of the shipped tasks' folder or of include_path."""
    roots = [SHIPPED.resolve(), *([Path(include_path).resolve()] if include_path is not None else [])]
    paths = [getattr(manager.task_index.get(task), "yaml_path", None) for task in tasks]
    return all(path is not None and any(Path(path).resolve().is_relative_to(root) for root in roots) for path in paths)


def _unknown(manager, tasks: list[str]) -> list[str]:
    return [task for task in tasks if not manager.match_tasks([task])]


def quiet_harness() -> None:
    """The harness's INFO lines off the run's log (its warnings stay), and NOISE dropped."""
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    for name, parts in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(parts))


class _Drop(logging.Filter):
    def __init__(self, parts: tuple[str, ...]):
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(part in str(record.msg) for part in self.parts)


def evaluate(model, tasks: list[str], manager, *, limit: float | None = None, num_fewshot: int | None = None,
             batch_size: int = 1, bootstrap_iters: int = 100_000, **model_args) -> dict:
    """lm_eval.simple_evaluate, as its command line calls it: `model` an LM instance, or "hf" with
    `model_args` (pretrained=DIR, dtype=...). Returns its results."""
    import lm_eval

    return lm_eval.simple_evaluate(model=model, model_args=model_args or None, tasks=list(tasks), task_manager=manager,
                                   limit=limit, num_fewshot=num_fewshot, batch_size=batch_size,
                                   bootstrap_iters=bootstrap_iters, log_samples=False)


def scores(results: dict) -> dict[str, float]:
    """The harness's results as flat keys: TASK/METRIC (TASK/METRIC,FILTER for a filter other than `none`,
    as its tables name them), TASK/METRIC_stderr beside each where it computed one."""
    flat = {}
    for task, metrics in results["results"].items():
        for name, value in metrics.items():
            # the alias, "N/A" for no stderr, and sample_len (the documents scored, which limit sets)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or name == "sample_len":
                continue
            metric, _, applied = name.partition(",")
            flat[f"{task}/{metric}" + ("" if applied in ("", "none") else f",{applied}")] = float(value)
    return flat


@contextlib.contextmanager
def without_bars():
    """What the harness writes to stderr (file descriptor 2: its subprocesses' too), passed on after the
    block less its progress bars (the run's own is on screen; the harness builds one per task that no
    argument turns off) and git's complaint when it asks for a commit outside a repository."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines = re.split(r"[\r\n]", capture.read().decode(errors="replace"))
            kept = [line for line in lines if line.strip() and not QUIET_LINE.search(line)]
            if kept:
                sys.stderr.write("\n".join(kept) + "\n")


@contextlib.contextmanager
def own_random_streams():
    """Python's and NumPy's generators as they were before the block (the harness seeds both)."""
    import numpy as np

    python, numpy = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


class Harness:
    """eval.harness: the live model scored on the harness's tasks at the scheduled steps, on every rank."""

    def __init__(self, cfg_harness, tokenizer, manager):
        self.cfg = cfg_harness
        self.tokenizer = tokenizer
        self.manager = manager

    @classmethod
    def for_config(cls, cfg, tokenizer) -> Harness | None:
        """None without eval.harness.tasks. Finds every task and loads its documents now, before the model
        is built: a task that cannot be found or loaded (a registry task's dataset offline) stops the run."""
        import copy

        h = cfg.eval.harness
        if not h.tasks:
            return None
        manager = task_manager(list(h.tasks), h.include_path)
        from lm_eval.tasks import get_task_dict

        try:
            with without_bars():
                get_task_dict(list(h.tasks), manager)
        except Exception as err:  # noqa: BLE001 - the harness raises what its datasets raise
            hint = ("fix the task's YAML file or its data" if local(manager, list(h.tasks), h.include_path) else
                    f"a registry task downloads its data from the hub: without one, score local tasks ({KEY}.include_path)")
            raise ConfigError(f"{KEY}.tasks: the harness could not load {', '.join(h.tasks)}: "
                              f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}; {hint}") from err
        # the harness may give a tokenizer without one a pad token: the run's own (saved in final/) stays as it is
        return cls(h, copy.deepcopy(tokenizer), manager)

    def due(self, step: int, last: bool) -> bool:
        return last or (self.cfg.every is not None and step % self.cfg.every == 0)

    def score(self, strategy, model) -> dict[str, float]:
        """TASK/METRIC -> value on the main process ({} on the others, which take part in every forward);
        every rank must call it."""
        from trainloop.objectives.generation import sampling
        from trainloop.observe.live_lm import LiveLM

        quiet_harness()
        with sampling(strategy, model, seed=TORCH_SEED) as module, own_random_streams(), without_bars():
            lm = LiveLM(module, self.tokenizer, self.cfg.batch_size, strategy.device, synced=strategy.world_size > 1)
            # stderr of a mean in closed form; of another aggregate from 100 resamples, not the command line's 100,000
            results = evaluate(lm, list(self.cfg.tasks), self.manager, limit=self.cfg.limit,
                               num_fewshot=self.cfg.num_fewshot, batch_size=self.cfg.batch_size, bootstrap_iters=100)
        return scores(results) if results is not None else {}  # the harness returns them where LOCAL_RANK is 0
