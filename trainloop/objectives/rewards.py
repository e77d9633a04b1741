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

Trained reward models (objective.reward_models: directories transformers loads as a sequence
classifier with one label, such as an objective=reward run's final/) are columns too, scored as
TRL scores them: each completion's text after its prompt's (a conversation rendered whole with the
model's own chat template, else the built-in one, as data=chat renders), tokenized by the model's
own tokenizer, padded on the right, the score at the last token that is not padding. Each rank
holds its own whole copy, in eval mode.

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


def transcript(messages: list[dict]) -> str:
    """A conversation as a person reads it, a line a turn: `role: content`, a tool call as
    `assistant calls NAME({...})`, a tool's reply as `tool NAME: content`."""
    import json

    lines = []
    for message in messages:
        role = message["role"] + (f" {message['name']}" if message["role"] == "tool" and message.get("name") else "")
        if message.get("content") or not message.get("tool_calls"):
            lines.append(f"{role}: {message.get('content') or ''}")
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            lines.append(f"{message['role']} calls {function['name']}({json.dumps(function.get('arguments', {}))})")
    return "\n".join(lines)


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


def load_reward(spec: str, what: str = "function") -> Callable:
    """The function (or, `what` "class", the class) `spec` names: `package.module:NAME` or
    `path/to/file.py:NAME`. Raises ConfigError naming what is wrong."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        example = "mypkg.rewards:exact_answer" if what == "function" else "mypkg.envs:Vault"
        raise ConfigError(f"{spec!r} names no {what}: give module:{what} ({example}) or path/to/file.py:{what}")
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
        raise ConfigError(f"{spec!r}: {where} has no {what} {name}")
    return function


def reward_name(spec: str) -> str:
    """A function's key in the metrics (rewards/NAME): the name after the colon."""
    return spec.rpartition(":")[2]


def model_name(directory: str) -> str:
    """A reward model's key in the metrics (rewards/NAME): its directory's name (the run's, for a run's final/)."""
    path = Path(directory).expanduser()
    return path.resolve().parent.name if path.name == "final" else path.name


def reward_model_problem(directory: str) -> str | None:
    """What keeps `directory` from being a reward model (objective.reward_models), or None: read from its
    config.json and tokenizer files, without loading weights."""
    from transformers import AutoConfig

    if not Path(directory).expanduser().is_dir():
        return f"{directory} is no directory: give a reward model's (an objective=reward run's RUN_DIR/final)"
    try:
        config = AutoConfig.from_pretrained(directory)
    except (OSError, ValueError) as err:
        return f"{directory} holds no model config ({err})"
    classes = config.architectures or []
    if not any(name.endswith("ForSequenceClassification") for name in classes):
        what = f"a {', '.join(classes)}" if classes else "a model of no architecture"
        return f"{directory} is {what}, not a sequence classifier with one score: train one with objective=reward"
    if config.num_labels != 1:
        return (f"{directory} is a {', '.join(classes)} with {config.num_labels} labels, not one score: train a "
                "reward model with objective=reward")
    if not any((Path(directory) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return f"{directory} has no tokenizer files: the completions are scored in its own tokens"
    return None


def saved_numel(directory: str) -> int:
    """The parameters a model directory's safetensors files hold, read from their headers alone."""
    import json
    import struct

    total = 0
    for file in sorted(Path(directory).expanduser().glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for key, entry in header.items():
            if key != "__metadata__":
                count = 1
                for size in entry["shape"]:
                    count *= size
                total += count
    return total


class RewardModel:
    """A reward model as a reward function (TRL's scoring, in the module docstring), on `device`."""

    def __init__(self, directory: str, device):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        if self.tokenizer.pad_token is None:  # as TRL pads a reward model's inputs
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(directory, num_labels=1, dtype=torch.float32)
        self.model.to(device).eval().requires_grad_(False)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = device

    def __call__(self, prompts, completions, **columns) -> list[float]:
        import torch

        if isinstance(prompts[0], list):  # its own template (a trainloop run's final/ carries it), else the built-in
            from trainloop.data.chat_template import BUILTIN_CHAT_TEMPLATE

            template = self.tokenizer.chat_template or BUILTIN_CHAT_TEMPLATE
            texts = [self.tokenizer.apply_chat_template(p + c, chat_template=template, tokenize=False)
                     for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        inputs = self.tokenizer(texts, return_tensors="pt", padding=True, padding_side="right",
                                add_special_tokens=False).to(self.device)
        with torch.no_grad():
            return self.model(**inputs).logits[:, 0].float().tolist()


def reward_problems(specs, weights, environment: str | None = None, models=()) -> list[str]:
    """objective.rewards, objective.reward_models and objective.reward_weights, checked when the config is:
    each function loads, each model directory is a reward model, the names are distinct, and the weights
    (if given) are one number per function, then per model (and, where objective.environment gives a reward
    column named `environment`, optionally one more, its weight: 1.0 where left out, as TRL weighs it)."""
    problems = []
    if not specs and not models and environment is None:
        return ["objective.rewards=[] names no reward function: give [module:function, ...] "
                "(e.g. trainloop.objectives.rewards:exact_answer, or path/to/file.py:function), "
                "objective.reward_models=[DIR], or an objective.environment with a get_reward method"]
    for i, spec in enumerate(specs):
        try:
            load_reward(spec)
        except ConfigError as err:
            problems.append(f"objective.rewards[{i}]={err}")
    for i, directory in enumerate(models):
        if (problem := reward_model_problem(directory)) is not None:
            problems.append(f"objective.reward_models[{i}]: {problem}")
    names = ([reward_name(s) for s in specs] + [model_name(d) for d in models]
             + ([environment] if environment is not None else []))
    if len(set(names)) < len(names):
        problems.append(f"objective.rewards and objective.reward_models name columns {names} that share a name: "
                        "their metrics (rewards/NAME) would mix; rename one")
    columns = len(specs) + len(models)
    allowed = (columns,) if environment is None else (columns, columns + 1)
    if weights is not None and len(weights) not in allowed:
        extra = f", then optionally the environment {environment}'s" if environment is not None else ""
        and_models, per_model = (f" and {len(models)} reward models", ", then per model") if models else ("", "")
        problems.append(f"objective.reward_weights has {len(weights)} weights for {len(specs)} reward functions"
                        f"{and_models}: give one per function{per_model}{extra}, or null (each 1.0)")
    return problems


class Rewards:
    """The reward functions of objective.rewards, loaded, with their weights; then the reward models of
    objective.reward_models (`models`: directories, loaded onto `device`); and, where objective.environment
    has get_reward, its column last (`environment`: (its name, the function), weight 1.0 unless given)."""

    def __init__(self, specs, weights=None, environment: tuple[str, Callable] | None = None, models=(),
                 device="cpu"):
        self.specs = list(specs)
        self.names = [reward_name(s) for s in self.specs]
        self.functions = [load_reward(s) for s in self.specs]
        for directory in models:
            self.specs.append(f"the reward model {directory}")
            self.names.append(model_name(directory))
            self.functions.append(RewardModel(directory, device))
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
