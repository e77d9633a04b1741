"""data=chat: conversations, rows holding a list of {role, content} messages (json, jsonl, parquet),
rendered with a chat template: data.chat_template, else the tokenizer's own, else a built-in one.
A reply of the assistant is a target (data.train_on=assistant), or every token (all); a row that
cannot be used is refused naming its file and line, rows with nothing to learn are skipped.

Tool calling, as TRL's SFT reads it: an assistant message may carry `tool_calls` (its content then
null or missing), a `tool` message is a tool's reply, and a row's tools column (data.tools_field)
holds the JSON schemas of the tools it may call, handed to the template as `tools`."""

from __future__ import annotations

import json
import logging
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trainloop.config.sections import DataConfig
from trainloop.data.formats.base import DataFormat, ragged_table
from trainloop.data.formats.rows import json_kind, read_rows, root_cause, row_place, struct_columns_as_json
from trainloop.data.tokenizer import IGNORE
from trainloop.errors import ConfigError

log = logging.getLogger("trainloop")

ROLES = ("system", "user", "assistant", "tool")
# The shapes named in messages (OpenAI's, which transformers' templates and TRL read).
TOOL_CALL = '{"type": "function", "function": {"name": ..., "arguments": {...}}}'
TOOL_SCHEMA = '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}'


@dataclass
class TemplateConfig:
    """The key of every format that renders messages (data=chat, preference, prompts)."""

    chat_template: Optional[str] = None  # a Jinja template file; None: the tokenizer's, else the built-in one


@dataclass
class ChatConfig(TemplateConfig):
    messages_field: str = "messages"  # the column holding a list of {role, content} messages
    tools_field: str = "tools"  # the column of each row's tool schemas (TRL's name); optional at its default

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


def message_problem(messages) -> str | None:
    """What makes a conversation unusable whatever the template: None if it is a list of {role, content}
    messages, where an assistant's may carry `tool_calls` instead of (or after) its content."""
    if not isinstance(messages, list):
        return f"is {json_kind(messages)}, not a list of {{role, content}} messages"
    for m, message in enumerate(messages, 1):
        if not isinstance(message, dict):
            return f"message {m} is {json_kind(message)}, not a {{role, content}} object"
        role = message.get("role")
        if role not in ROLES:
            return f"message {m} has role {role!r}; the roles are {', '.join(ROLES)}"
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                return f"message {m} ({role}) has 'tool_calls'; only the assistant's messages call tools"
            if not isinstance(calls, list):
                return (f"message {m} (assistant) has 'tool_calls' that are {json_kind(calls)}, "
                        f"not a list of {TOOL_CALL}")
            for k, call in enumerate(calls, 1):
                problem = tool_call_problem(call)
                if problem:
                    return f"message {m} (assistant) tool call {k} {problem}; a tool call is {TOOL_CALL}"
        content = message.get("content")
        if content is None and not calls:
            return (f"message {m} ({role}) has no content; every message needs a text 'content' (an assistant's "
                    "may be null where it has 'tool_calls')")
        if content is not None and not isinstance(content, str):
            return f"message {m} ({role}) has a content that is {json_kind(content)}, not text"
    return None


def tool_call_problem(call) -> str | None:
    """What makes one of a message's tool calls unusable: OpenAI's {"type": "function", "function":
    {...}} or the flat {"name", "arguments"} (which Qwen's and most templates also read), with a name
    and arguments that are an object or a JSON string of one."""
    if not isinstance(call, dict):
        return f"is {json_kind(call)}"
    if call.get("type") not in (None, "function"):
        return f"has type {call['type']!r}; the only type is 'function'"
    function = call["function"] if "function" in call else call
    if not isinstance(function, dict):
        return f"has a 'function' that is {json_kind(function)}, not an object"
    if not isinstance(function.get("name"), str) or not function["name"].strip():
        return "has no function name"
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        decoded = decoded_json(arguments)
        if not isinstance(decoded, dict):
            return (f"of {function['name']!r} has 'arguments' text that is not a JSON object "
                    f"({arguments[:60]!r})")
    elif not isinstance(arguments, dict):
        return f"of {function['name']!r} has 'arguments' that are {json_kind(arguments)}, not an object"
    return None


def tools_problem(tools) -> str | None:
    """What makes a row's tools unusable: None if null, or a list of tool schemas (as OpenAI's
    {"type": "function", "function": {...}} or flat), or a JSON string of one (as TRL reads it)."""
    if isinstance(tools, str):
        decoded = decoded_json(tools)
        if decoded is None and tools.strip() != "null":
            return f"is text that is not JSON ({tools[:60]!r}); give a list of {TOOL_SCHEMA}"
        tools = decoded
    if tools is None:
        return None
    if not isinstance(tools, list):
        return f"is {json_kind(tools)}, not a list of {TOOL_SCHEMA}"
    for k, tool in enumerate(tools, 1):
        function = tool.get("function", tool) if isinstance(tool, dict) else tool
        if not isinstance(function, dict) or tool.get("type") not in (None, "function"):
            return f"tool {k} is not a tool schema; a tool is {TOOL_SCHEMA}"
        if not isinstance(function.get("name"), str) or not function["name"].strip():
            return f"tool {k} has no function name; a tool is {TOOL_SCHEMA}"
        if not isinstance(function.get("parameters", {}), dict):
            return f"tool {function['name']!r} has 'parameters' that are not an object (a JSON schema)"
    return None


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


def usable_conversations(rows, cfg: DataConfig, tokenizer=None):
    """The conversations to train on, by the rules docs/fine-tuning.md's data=chat list gives: a row that
    cannot be used is refused naming its file and line; rows with nothing to learn are skipped and
    counted; kept rows of unusual shape are counted too, in the same warning line."""
    from collections import Counter

    field, assistant_only = cfg.messages_field, cfg.train_on == "assistant"
    template = chat_template(cfg, tokenizer) if tokenizer is not None else None
    skipped, kept_as, keep, replies, empty = Counter(), Counter(), [], 0, 0
    tools_column = rows[cfg.tools_field] if cfg.tools_field in rows.column_names else [None] * len(rows)
    tools_shown = template is None  # whether the template was seen to render a row's tools
    for r, (messages, tools) in enumerate(zip(rows[field], tools_column)):
        if not messages:
            skipped["no messages (missing or empty)"] += 1
            continue
        problem = message_problem(messages)
        if problem:
            raise ConfigError(f"{row_place(cfg.path, r)}: data.messages_field={field!r} {problem}; "
                              "fix or remove that row")
        problem = tools_problem(tools)
        if problem:
            raise ConfigError(f"{row_place(cfg.path, r)}: data.tools_field={cfg.tools_field!r} {problem}; "
                              "fix or remove that row")
        tools = row_tools(tools)
        if template is not None:
            try:  # a template's own rule (e.g. raise_exception on roles that do not alternate) refuses the row
                text = tokenizer.apply_chat_template(template_messages(messages), chat_template=template,
                                                     tools=tools, tokenize=False)
            except Exception as err:  # noqa: BLE001 - whatever a template raises, name the row
                raise ConfigError(f"{row_place(cfg.path, r)}: the chat template cannot render this conversation "
                                  f"({root_cause(err)}); fix the row, or choose a template that accepts it "
                                  "(data.chat_template=FILE)") from None
            if tools and not tools_shown:  # once: a template without tool support renders none
                tools_shown = True
                if text == tokenizer.apply_chat_template(template_messages(messages), chat_template=template,
                                                         tokenize=False):
                    log.warning("data=chat: the chat template renders no tools (data.tools_field=%r): the model "
                                "is not shown the tools' schemas; choose a template with tool support "
                                "(data.chat_template=FILE)", cfg.tools_field)
        roles = [m["role"] for m in messages]
        if roles[0] == "assistant":
            skipped["the assistant's reply first (it answers no prompt)"] += 1
            continue
        if assistant_only and "assistant" not in roles:
            skipped["no assistant reply"] += 1
            continue
        keep.append(r)
        row_replies = [m for m in messages if m["role"] == "assistant"]
        row_empty = sum(not (m.get("content") or "").strip() and not m.get("tool_calls") for m in row_replies)
        replies, empty = replies + len(row_replies), empty + row_empty
        pairs = set(zip(roles, roles[1:]))
        notes = {"a trailing turn after the last reply (not trained)": assistant_only and roles[-1] != "assistant",
                 "two user turns in a row": ("user", "user") in pairs,
                 "two assistant replies in a row": ("assistant", "assistant") in pairs,
                 "a system turn after the first message": "system" in roles[1:],
                 "an empty reply (trained as its end of turn alone)": row_empty > 0}
        kept_as.update(note for note, holds in notes.items() if holds)
    if not keep:
        if set(skipped) == {"no assistant reply"}:
            raise ConfigError(f"data.train_on=assistant: no row of {cfg.path} has an assistant message, so "
                              "nothing would be learned; add replies, or set data.train_on=all")
        raise ConfigError(f"none of the {len(rows)} rows of {cfg.path} can be trained: "
                          + ", ".join(f"{n} with {why}" for why, n in skipped.items()))
    if assistant_only and replies == empty:
        raise ConfigError(f"every assistant reply in {cfg.path} is empty: the model would learn only to stop; "
                          "fill the replies, or remove those rows")
    parts = [f"skipped {sum(skipped.values())} of {len(rows)} rows (" + ", ".join(
        f"{n} with {why}" for why, n in skipped.items()) + ")"] if skipped else []
    parts += [f"kept {n} with {note}" for note, n in kept_as.items()]
    if parts:
        log.warning("data=chat rows of %s: %s", cfg.path, "; ".join(parts))
    return rows.select(keep) if len(keep) < len(rows) else rows


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


class Chat(DataFormat):
    name = "chat"
    keys = ChatConfig
    fields = {"data.messages_field": "json", "data.tools_field": "json"}
    train_on = ("assistant", "all")
    masked = True

    def rows(self, cfg: DataConfig):
        """The messages column, and the tools column where the files have one (it may be missing only
        under its default name, as TRL's SFT reads a "tools" column where there is one)."""
        columns = self.columns(cfg)
        optional = ["data.tools_field"] if cfg.tools_field == ChatConfig.tools_field else []
        rows = read_rows(cfg.path, columns, list(columns), optional)
        return struct_columns_as_json(rows, [cfg.messages_field, cfg.tools_field])

    def load(self, cfg: DataConfig, tokenizer=None):
        """Conversations kept, skipped or refused by the rules above (the template's own among them
        when the tokenizer is given)."""
        return usable_conversations(self.rows(cfg), cfg, tokenizer)

    def row_tokenizer(self, cfg: DataConfig, tokenizer):
        template = chat_template(cfg, tokenizer)

        def tokenize(batch):
            conversations = batch[cfg.messages_field]
            tools = batch.get(cfg.tools_field) or [None] * len(conversations)
            pairs = [chat_tokens(m, tokenizer, template, cfg.train_on, row_tools(t))
                     for m, t in zip(conversations, tools)]
            return ragged_table(input_ids=[p[0] for p in pairs], labels=[p[1] for p in pairs])
        return tokenize

    def chat_template(self, cfg: DataConfig, tokenizer) -> str:
        return chat_template(cfg, tokenizer)

