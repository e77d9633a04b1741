"""Tools a GRPO rollout calls (objective.tools), as TRL 1.16's GRPOTrainer(tools=...) calls them.

A tool is a plain Python function with type hints and a docstring (its JSON schema, made as
transformers makes it, goes into the prompt through the chat template), named as a reward
function is: `module:function` or `path/to/file.py:function`. A rollout generates; where the
model's turn ends with tool calls (parse_tool_calls: `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`, the built-in template's and Hermes/Qwen's form), each call is run and its
reply appended, rendered by the template (a tool turn, then the header of the model's next turn),
and the model generates again: until a turn makes no call, objective.max_tool_calls rounds, or
the completion's budget (objective.max_new_tokens, for the model's turns and the replies
together). A call that raises, names no tool, takes other arguments, or runs past
objective.tool_timeout_s is answered with {'error': ...}: a reply, never a crash. The replies are
no one's target: no loss and no advantage on their tokens (TRL's tool_mask).

An environment (objective.environment=module:Class, TRL's environment_factory) is a class whose
instances keep a rollout's state: one instance per rollout (made once, reused by later steps),
`reset(**row)` before the rollout (a text it returns is appended to the prompt's last message), its
public methods the rollout's tools beside objective.tools, and `get_reward()` (if it has one) a
reward column named after the class, read once the rollout is done.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from typing import Callable

from trainloop.errors import ConfigError


def tool_problems(specs, functions_out: list | None = None) -> list[str]:
    """objective.tools, checked when the config is: each loads, the names are distinct, and each has
    the type hints and docstring its JSON schema is made from."""
    from trainloop.objectives.rewards import load_reward

    problems, names = [], {}
    for i, spec in enumerate(specs):
        try:
            function = load_reward(spec)
        except ConfigError as err:
            problems.append(f"objective.tools[{i}]={err}")
            continue
        try:
            schema(function)
        except ConfigError as err:
            problems.append(f"objective.tools[{i}]={spec!r}: {err}")
            continue
        if function.__name__ in names:
            problems.append(f"objective.tools[{i}]={spec!r}: a second tool named {function.__name__} "
                            f"(objective.tools[{names[function.__name__]}]); the model calls tools by name")
        names[function.__name__] = i
        if functions_out is not None:
            functions_out.append(function)
    return problems


def load_tools(specs) -> dict[str, Callable]:
    """{name: function} of objective.tools (checked by tool_problems)."""
    functions: list = []
    problems = tool_problems(specs, functions)
    if problems:
        raise ConfigError("; ".join(problems))
    return {f.__name__: f for f in functions}


def schema(function: Callable) -> dict:
    """The function's JSON schema, as transformers makes it for a chat template's `tools`."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as err:  # noqa: BLE001 - transformers' parsing errors, named with the tool
        raise ConfigError(f"no JSON schema can be made of {function.__name__} ({err}); give it type hints and a "
                          "docstring with an Args: line per argument") from None


def call_tool(functions: dict[str, Callable], call: dict, timeout_s: float) -> tuple[str, bool]:
    """The reply to one call, as text, and whether the call failed: str() of what the tool returned, or
    of {'error': ...} where it raised, is not one of the tools, or ran past `timeout_s` (then it is left
    to finish on its own, in a daemon thread: a hung tool costs its thread, not the run), as TRL's
    replies read and its tools/failure_frequency counts them."""
    function = functions.get(call["name"])
    if function is None:
        return str({"error": f"Tool {call['name']} not found."}), True
    done: dict = {}

    def run() -> None:
        try:
            done["value"] = function(**call["arguments"])
        except Exception as err:  # noqa: BLE001 - whatever the tool raises is its reply
            done["error"] = str(err)

    worker = threading.Thread(target=run, name=f"tool {call['name']}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        late = f"Tool {call['name']} did not answer within objective.tool_timeout_s={timeout_s} s."
        return str({"error": late}), True
    return (str({"error": done["error"]}), True) if "error" in done else (str(done["value"]), False)


def reply_ids(tokenizer, template: str, replies: list[dict]) -> list[int]:
    """The tokens that follow a model's turn ending in tool calls: the replies as the template renders
    them, and the header of the model's next turn (TRL's _get_tool_suffix_ids: the difference of two
    renderings of a stand-in conversation, cut after the turn's end-of-text)."""
    calls = [{"type": "function", "function": {"name": replies[0]["name"], "arguments": {}}}]
    before = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    prefix = tokenizer.apply_chat_template(before, chat_template=template, tokenize=True, return_dict=False)
    whole = tokenizer.apply_chat_template(before + replies, chat_template=template, tokenize=True,
                                          add_generation_prompt=True, return_dict=False)
    ends = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    if ends:
        prefix = prefix[:ends[-1] + 1]
    if whole[:len(prefix)] != prefix:
        raise ConfigError("the chat template renders a tool's reply by changing the turn before it, so the reply "
                          "cannot follow the model's tokens as they are: choose a template that renders a "
                          "conversation turn by turn (data.chat_template=FILE)")
    return whole[len(prefix):]


@dataclass
class Turns:
    """One rollout's completion: the model's turns and the tools' replies between them."""

    ids: list[int]  # every token after the prompt
    trained: list[int]  # 1 on the model's tokens, 0 on the replies' (no loss, no advantage)
    messages: list[dict] = field(default_factory=list)  # as TRL hands them to the reward functions
    calls: int = 0  # tool calls run (also those whose replies did not fit)
    failed: int = 0  # of them answered with an error
    ended: bool = False  # no room left for the replies to its last calls: the completion is cut after them

    def add_model_turn(self, ids: list[int], tokenizer, eos: int) -> None:
        from trainloop.data.chat_template import parse_tool_calls

        self.ids += ids
        self.trained += [1] * len(ids)
        text = tokenizer.decode([t for t in ids if t != eos], skip_special_tokens=True)
        content, calls = parse_tool_calls(text)
        message = {"role": "assistant", "content": content.strip()}  # as TRL's parse_response gives it
        if calls and ids and ids[-1] == eos:  # a turn cut short makes no call
            message["tool_calls"] = [{"type": "function", "function": call} for call in calls]
        self.messages.append(message)

    def pending(self) -> list[dict]:
        """The calls the last turn made (and left unanswered)."""
        last = self.messages[-1]
        return [c["function"] for c in last.get("tool_calls", [])] if not self.ended and last["role"] == "assistant" \
            else []


def take_turns(prompts: list[list[int]], first: list[list[int]], generate, agree, tokenizer, template: str,
               functions: list[dict[str, Callable]], max_rounds: int | None, timeout_s: float,
               budget: int) -> list[Turns]:
    """Each rollout's turns, from the model's first turns (`first`, one per prompt): its calls
    answered from its own tools (`functions[i]`: objective.tools and its environment's methods) and
    the model asked again, until no call, `max_rounds` rounds (None: no limit but the budget) or the
    `budget` of completion tokens. `generate(which, rows, room)`: the model's next turn for each row
    (prompt + completion so far; `which`: the rows' places in `prompts`), at most `room` tokens each,
    with every rank taking part (empty lists where this rank has none left); `agree(n)`: whether any
    rank has rows left."""
    eos = tokenizer.eos_token_id
    turns = []
    for ids in first:
        turns.append(Turns([], []))
        turns[-1].add_model_turn(ids, tokenizer, eos)
    rounds = 0
    while max_rounds is None or rounds < max_rounds:
        going = []
        for i, turn in enumerate(turns):
            calls = turn.pending()
            if not calls:
                continue
            answers = [call_tool(functions[i], c, timeout_s) for c in calls]
            replies = [{"role": "tool", "name": c["name"], "content": text} for c, (text, _) in zip(calls, answers)]
            turn.calls += len(calls)  # run, whether or not their replies fit (as TRL counts them)
            turn.failed += sum(failed for _, failed in answers)
            after = reply_ids(tokenizer, template, replies)
            if len(turn.ids) + len(after) >= budget:  # no room for the replies and a token more: it ends here,
                turn.ended = True  # cut (truncated), its tools' replies in the messages the reward functions get
                turn.messages += replies
                continue
            turn.messages += replies
            turn.ids += after
            turn.trained += [0] * len(after)
            going.append(i)
        if not agree(len(going)):
            break
        for i, ids in zip(going, generate(going, [prompts[i] + turns[i].ids for i in going],
                                          [budget - len(turns[i].ids) for i in going])):
            turns[i].add_model_turn(ids, tokenizer, eos)
        rounds += 1
    return turns


def tool_schemas(functions: dict[str, Callable], environments: "Environments | None") -> list[dict] | None:
    """The prompts' tools: objective.tools' JSON schemas, then the environment's methods' (None for none)."""
    schemas = [schema(f) for f in functions.values()] + (environments.schemas() if environments else [])
    return schemas or None


class Environments:
    """objective.environment's instances, one per rollout of a step, made as they are first needed and
    reused (TRL's "construct once, reset often"). The constructor checks the class as TRL does: it makes
    an instance, which must have `reset`; its public methods (not reset, get_reward or _private) must
    each give a JSON schema and be named unlike objective.tools (`tools`); a ConfigError lists what is wrong."""

    def __init__(self, spec: str, tools=()):
        from trainloop.objectives.rewards import load_reward

        self.spec = spec
        try:
            self.factory = load_reward(spec, "class")
        except ConfigError as err:
            raise ConfigError(f"objective.environment={err}") from None
        where = f"objective.environment={spec!r}"
        try:
            probe = self.factory()
        except Exception as err:  # noqa: BLE001 - the user's constructor: name it in one line
            raise ConfigError(f"{where}: making an instance raised {type(err).__name__}: {err}") from None
        kind = type(probe)
        self.name = kind.__name__
        self.methods = [name for name, _ in inspect.getmembers(kind, inspect.isfunction)
                        if name not in ("reset", "get_reward") and not name.startswith("_")]
        problems = []
        if not callable(getattr(probe, "reset", None)):
            problems.append(f"{where}: {self.name} has no reset method; give it reset(self, **row) -> str | None")
        for name in self.methods:
            try:
                schema(getattr(probe, name))
            except ConfigError as err:
                problems.append(f"{where}: method {name}: {err}")
            if name in {tool.rpartition(":")[2] for tool in tools}:  # objective.tools' names
                problems.append(f"{where}: its method {name} has the name of a tool of objective.tools; the model "
                                "calls tools by name: rename one")
        self.rewarded = callable(getattr(probe, "get_reward", None))  # the environment gives a reward column
        if problems:
            raise ConfigError("; ".join(problems))
        self.pool, self.used = [probe], 0

    def schemas(self) -> list[dict]:
        """The methods' JSON schemas, for the prompts' chat template (after objective.tools')."""
        return [schema(getattr(self.pool[0], name)) for name in self.methods]

    def start(self) -> None:
        """A step (or an evaluation batch) begins: its rollouts draw the pool from the start again."""
        self.used = 0

    def draw(self, n: int) -> list:
        """Instances for the next `n` rollouts, none shared with another rollout of the step."""
        while len(self.pool) < self.used + n:
            self.pool.append(self.factory())
        self.used += n
        return self.pool[self.used - n:self.used]

    def tools(self, instance) -> dict[str, Callable]:
        """{name: bound method} of an instance's tools."""
        return {name: getattr(instance, name) for name in self.methods}

    def reward(self, prompts, completions, environments, **columns) -> list:
        """The reward column of an environment with get_reward: one call per finished rollout."""
        return [environment.get_reward() for environment in environments]
