"""Reward functions in plain Python, named by objective.rewards, called as TRL calls them:

    f(prompts=[...], completions=[...], **columns) -> [float | None, ...]

one value per completion; None where the function does not apply to that row (a completion that
no function scores gets no advantage, and is counted on the train line as `unscored`; a step in
which no completion is scored stops the run). `prompts` and `completions` are text, or, for
conversational prompts (data=prompts), lists of messages and [{"role": "assistant", "content":
TEXT}]. `columns` are the rows' other columns (data=prompts keeps them all), one value per
completion; a function takes the ones it needs and **kwargs for the rest. With
objective.environment, `environments` is one of them: each completion's instance, as TRL passes it.

A function is named `module:function` (importable, e.g. `trainloop.objectives.rewards:exact_answer`) or
`path/to/file.py:function` (a file of your own, loaded by its path). A name that cannot be loaded
is refused when the config is checked, before anything is built. A function that raises, returns
the wrong number of values, something other than a number or None, or a NaN or infinite number (a
broken verifier, not "does not apply") stops the run with one line naming it and the row.

The two functions below are examples to start from (docs/grpo.md); copy one into a
file of your own to change it. This module imports nothing heavy: config checks load it.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import re
import sys
from pathlib import Path
from typing import Callable

from trainloop.errors import ConfigError


def text_of(completion) -> str:
    """A completion's text: itself, or the content of its last message (a conversational one)."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def exact_answer(prompts, completions, answer=None, **columns) -> list[float | None]:
    """1.0 where the completion, stripped of surrounding white space, is the row's `answer` column
    (compared as text), else 0.0; None for rows without an answer."""
    answers = answer if answer is not None else [None] * len(completions)
    return [None if a is None else float(text_of(c).strip() == str(a).strip()) for c, a in zip(completions, answers)]


# The reasoning-then-answer layout DeepSeek-R1 was trained to write (and TRL's think_format_reward checks).
FORMAT = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)


def format_match(prompts, completions, **columns) -> list[float]:
    """1.0 where the whole completion matches FORMAT (<think>...</think> then <answer>...</answer>), else 0.0."""
    return [float(FORMAT.fullmatch(text_of(c)) is not None) for c in completions]


def load_reward(spec: str) -> Callable:
    """The function `spec` names: `package.module:function` or `path/to/file.py:function`.
    Raises ConfigError naming what is wrong."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(f"{spec!r} names no function: give module:function (mypkg.rewards:exact_answer) "
                          "or path/to/file.py:function")
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise ConfigError(f"{spec!r}: no such file {where}")
        module_name = f"trainloop_reward_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(module_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader_spec)
            try:
                loader_spec.loader.exec_module(module)
            except Exception as err:  # noqa: BLE001 - whatever the user's file raises, name it in one line
                raise ConfigError(f"{spec!r}: {where} cannot be loaded ({type(err).__name__}: {err})") from None
            sys.modules[module_name] = module
    else:
        try:
            module = importlib.import_module(where)
        except Exception as err:  # noqa: BLE001 - a missing module, or one that fails while importing
            raise ConfigError(f"{spec!r}: module {where} cannot be imported ({type(err).__name__}: {err})") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ConfigError(f"{spec!r}: {where} has no function {name}")
    return function


def reward_name(spec: str) -> str:
    """A function's key in the metrics (rewards/NAME): the name after the colon."""
    return spec.rpartition(":")[2]


def reward_problems(specs, weights, environment: str | None = None) -> list[str]:
    """objective.rewards and objective.reward_weights, checked when the config is: each function
    loads, the names are distinct, and the weights (if given) are one number per function (and, where
    objective.environment gives a reward column named `environment`, optionally one more, its weight:
    1.0 where left out, as TRL weighs it)."""
    problems = []
    if not specs and environment is None:
        return ["objective.rewards=[] names no reward function: give [module:function, ...] "
                "(e.g. trainloop.objectives.rewards:exact_answer, or path/to/file.py:function), or an "
                "objective.environment with a get_reward method"]
    for i, spec in enumerate(specs):
        try:
            load_reward(spec)
        except ConfigError as err:
            problems.append(f"objective.rewards[{i}]={err}")
    names = [reward_name(s) for s in specs] + ([environment] if environment is not None else [])
    if len(set(names)) < len(names):
        problems.append(f"objective.rewards names functions {names} that share a name: their metrics "
                        "(rewards/NAME) would mix; rename one")
    allowed = (len(specs),) if environment is None else (len(specs), len(specs) + 1)
    if weights is not None and len(weights) not in allowed:
        extra = f", then optionally the environment {environment}'s" if environment is not None else ""
        problems.append(f"objective.reward_weights has {len(weights)} weights for {len(specs)} reward functions: "
                        f"give one per function{extra}, or null (each 1.0)")
    return problems


class Rewards:
    """The reward functions of objective.rewards, loaded, with their weights; and, where objective.environment
    has get_reward, its column last (`environment`: (its name, the function), weight 1.0 unless given)."""

    def __init__(self, specs, weights=None, environment: tuple[str, Callable] | None = None):
        self.specs = list(specs)
        self.names = [reward_name(s) for s in self.specs]
        self.functions = [load_reward(s) for s in self.specs]
        if environment is not None:
            name, function = environment
            self.specs.append(f"{name}.get_reward")
            self.names.append(name)
            self.functions.append(function)
        weights = list(weights) if weights is not None else []
        self.weights = weights + [1.0] * (len(self.specs) - len(weights))

    def score(self, prompts: list, completions: list, columns: dict[str, list]) -> list[list[float]]:
        """Each function's values for the completions ([functions][completions], NaN for None).
        Raises ConfigError naming the function and the row of a bad value (NaN and infinities too)."""
        scores = []
        for spec, function in zip(self.specs, self.functions):
            try:
                values = function(prompts=prompts, completions=completions, **columns)
            except Exception as err:  # noqa: BLE001 - the user's code: name it and the row, in one line
                raise ConfigError(f"the reward function {spec} raised {type(err).__name__}: {err} "
                                  f"(on {self.failing_row(function, prompts, completions, columns)})") from None
            if not isinstance(values, (list, tuple)) or len(values) != len(completions):
                got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
                raise ConfigError(f"the reward function {spec} returned {got} for {len(completions)} completions: "
                                  "it must return a list with one number (or None) per completion")
            for i, value in enumerate(values):
                if value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, numbers.Real):
                    raise ConfigError(f"the reward function {spec} returned {value!r} ({type(value).__name__}) "
                                      f"for {row_of(prompts, completions, i)}: give a number, or None where it "
                                      "does not apply")
                if not math.isfinite(value):  # None says "does not apply"; a NaN says the verifier broke
                    raise ConfigError(f"the reward function {spec} returned {value} for "
                                      f"{row_of(prompts, completions, i)}: give a finite number, or None where it "
                                      "does not apply")
            scores.append([math.nan if v is None else float(v) for v in values])
        return scores

    @staticmethod
    def failing_row(function, prompts, completions, columns) -> str:
        """The first row the function raises on alone, to name it (only on the error path)."""
        for i in range(len(completions)):
            try:
                function(prompts=prompts[i:i + 1], completions=completions[i:i + 1],
                         **{key: values[i:i + 1] for key, values in columns.items()})
            except Exception:  # noqa: BLE001
                return row_of(prompts, completions, i)
        return f"a batch of {len(completions)} completions, though on no row alone"


def row_of(prompts, completions, i: int) -> str:
    """Row i of a reward call, in a short phrase for a message."""
    prompt, completion = text_of(prompts[i]), text_of(completions[i])
    return f"completion {i} of the batch, prompt {prompt[:60]!r}, completion {completion[:60]!r}"
