"""Chat templates: which one renders a conversation (data.chat_template, else the tokenizer's own, else trainloop's
built-in one), how a rendered conversation becomes token ids and labels (an assistant's reply a target, turn by turn,
or as a template's {% generation %} markers say), and the built-in template's tool calls read back from a reply.
Every format that renders messages (data=chat, preference, prompts, unpaired) and the objectives that write or read
turns (grpo's tool rounds, rewards) use these."""

from __future__ import annotations

import json
import logging
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trainloop.config.sections import DataConfig
from trainloop.data.tokenizer import IGNORE
from trainloop.errors import ConfigError

log = logging.getLogger("trainloop")


@dataclass
class TemplateConfig:
    """The key of every format that renders messages (data=chat, preference, prompts)."""

    chat_template: Optional[str] = None  # a Jinja template file; None: the tokenizer's, else the built-in one


# For tokenizers without a chat template (the built-in byte-level one included): each message
# is a role line, its content and the end-of-text token, so a reply ends where the model learns to stop.
# Tools, Hermes/Qwen style: a leading <|tools|> line lists their schemas, one JSON a line, inside
# <tools>...</tools>; a call is <tool_call>{"name": ..., "arguments": {...}}</tool_call> after the
# content (parse_tool_calls reads it back); a tool's reply is a <|tool|> message. Without tools or
# calls it renders what it rendered before them, byte for byte.
BUILTIN_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and tools %}<|tools|>\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>{{ eos_token }}\n{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% set function = call['function'] if call['function'] is defined else call %}"
    "<tool_call>{\"name\": {{ function['name'] | tojson }}, \"arguments\": {{ function['arguments'] | tojson }}}"
    "</tool_call>{% endfor %}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


# The same model turns read back by transformers' tokenizer.parse_response (a tokenizer's
# `response_template`, in the form of TRL's qwen3_template): what TRL's GRPOTrainer needs to parse
# the built-in template's tool calls (tests/test_tool_loop_trl.py, scripts/bench_grpo.py --tools).
BUILTIN_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|endoftext\|>\s*", "content": "text"},
    },
}


TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """The calls a reply rendered by the built-in template makes: (its text with each parsed
    <tool_call>...</tool_call> block cut out, [{"name": ..., "arguments": {...}}, ...] in order).
    A block that is not a JSON object with a text "name" and an object "arguments" (a JSON string of
    one is decoded), and an unclosed <tool_call>, is no call: it stays in the returned text as
    written, where a reward can find it; nothing raises."""
    calls, kept, at = [], [], 0
    for block in TOOL_CALL_BLOCK.finditer(text):
        call = decoded_json(block.group(1))
        arguments = call.get("arguments") if isinstance(call, dict) else None
        if isinstance(arguments, str):
            arguments = decoded_json(arguments)
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(arguments, dict)):
            continue
        calls.append({"name": call["name"], "arguments": arguments})
        kept.append(text[at:block.start()])
        at = block.end()
    return "".join(kept) + text[at:], calls


def decoded_json(text: str):
    """The JSON value `text` holds, or None where it holds none."""
    try:
        return json.loads(text)
    except ValueError:
        return None


# The tokenizers already told that they have no chat template: said once per run (one tokenizer),
# not once per caller (the run's final/ tokenizer, the row checks, the row tokenizer).
TOLD_BUILTIN = weakref.WeakSet()


def chat_template(cfg: DataConfig, tokenizer) -> str:
    """The template rows are rendered with (template_of); the built-in one is said once, as rows are
    rendered with it."""
    template = template_of(cfg, tokenizer)
    if template is BUILTIN_CHAT_TEMPLATE and tokenizer not in TOLD_BUILTIN:
        TOLD_BUILTIN.add(tokenizer)
        log.info("the tokenizer has no chat template: using trainloop's built-in one "
                 "(data.chat_template=FILE to choose)")
    return template


def template_of(cfg: DataConfig, tokenizer) -> str:
    """data.chat_template if given, else the tokenizer's own, else the built-in one. Said nothing:
    final/'s tokenizer carries it also after plain-text pairs or prompts, which render none."""
    if cfg.chat_template:
        path = Path(cfg.chat_template).expanduser()
        if not path.is_file():
            raise ConfigError(f"data.chat_template={cfg.chat_template!r}: no such file; give a Jinja template file")
        return check_generation_markers(cfg, tokenizer, path.read_text())
    own = tokenizer.chat_template
    if isinstance(own, dict):  # named templates: the default one
        own = own.get("default")
    if own:
        return check_generation_markers(cfg, tokenizer, own)
    return BUILTIN_CHAT_TEMPLATE


# transformers' own test for a template that marks the assistant's tokens (render_jinja_template)
GENERATION_MARKER = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


def check_generation_markers(cfg: DataConfig, tokenizer, template: str) -> str:
    """A template with {% generation %} markers picks the trained tokens by their characters' offsets,
    which only a fast tokenizer reports."""
    if GENERATION_MARKER.search(template) and cfg.train_on != "all" and not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"data.chat_template: the template marks the trained tokens with {{% generation %}}, which "
                          f"needs a fast tokenizer (character offsets), and {type(tokenizer).__name__} is not one; "
                          "use a tokenizer with a tokenizer.json (data.tokenizer=DIR), or set data.train_on=all")
    return template


def row_tools(tools) -> list | None:
    """A row's tools (checked by tools_problem) as the template gets them: a JSON string decoded, and
    None for none (null or []: some templates render their tool preamble for an empty list)."""
    if isinstance(tools, str):
        tools = json.loads(tools)
    return tools or None


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as templates render them: a tool call's arguments given as a JSON string (OpenAI's
    form) decoded into the object templates write with tojson (they would write the string quoted)."""
    def decoded(call: dict) -> dict:
        function = call["function"] if "function" in call else call
        if not isinstance(function.get("arguments"), str):
            return call
        function = {**function, "arguments": json.loads(function["arguments"])}
        return {**call, "function": function} if "function" in call else function

    return [{**m, "tool_calls": [decoded(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in messages]


def chat_tokens(messages: list[dict], tokenizer, template: str, train_on: str,
                tools: list | None = None) -> tuple[list[int], list[int]]:
    """The conversation (with its tools) rendered with the template, tokenized piece by piece so each
    piece's labels are known: an assistant reply (after its header), its tool calls included, is a
    target; with train_on=all, everything is. A template with {% generation %} markers decides the
    targets itself (marked_chat_tokens)."""
    messages = template_messages(messages)
    if GENERATION_MARKER.search(template):
        return marked_chat_tokens(messages, tokenizer, template, train_on, tools)

    def render(upto: list[dict], prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(upto, chat_template=template, tools=tools, tokenize=False,
                                             add_generation_prompt=prompt) if upto or prompt else ""

    ids, labels, done = [], [], ""

    def add(text: str, target: bool) -> None:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        ids.extend(piece)
        labels.extend(piece if target else [IGNORE] * len(piece))

    for i, message in enumerate(messages):
        reply = message["role"] == "assistant"
        if message["role"] == "tool" and messages[i + 1:i + 2] and messages[i + 1]["role"] == "tool":
            continue  # a template may close a run of tool replies only after its last (Qwen2.5's does)
        if reply:  # the header that opens a reply is the prompt's, not the model's to learn
            header = render(messages[:i], prompt=True)
            if header.startswith(done):
                add(header[len(done):], train_on == "all")
                done = header
        text = render(messages[:i + 1])
        if not text.startswith(done):
            raise ConfigError(f"data.chat_template: the template renders the first {i + 1} messages as text that "
                              f"does not continue the first {i}'s, so the turns cannot be labelled; use a template "
                              "that renders a conversation turn by turn (data.chat_template=FILE)")
        add(text[len(done):], reply or train_on == "all")
        done = text
    return ids, labels


def marked_chat_tokens(messages: list[dict], tokenizer, template: str, train_on: str,
                       tools: list | None = None) -> tuple[list[int], list[int]]:
    """The whole conversation rendered and tokenized at once; the targets are the tokens that the
    template's {% generation %} blocks cover, exactly transformers' assistant mask (which TRL's
    assistant_only_loss uses). A row whose blocks cover no token has no target (packing drops it)."""
    if train_on == "all":
        ids = tokenizer.apply_chat_template(messages, chat_template=template, tools=tools, tokenize=True,
                                            return_dict=False)
        return ids, ids
    out = tokenizer.apply_chat_template(messages, chat_template=template, tools=tools, tokenize=True,
                                        return_dict=True, return_assistant_tokens_mask=True)
    ids = out["input_ids"]
    return ids, [token if marked else IGNORE for token, marked in zip(ids, out["assistant_masks"])]
