"""data=chat: conversations, rows holding a list of {role, content} messages (json, jsonl, parquet),
rendered with a chat template: data.chat_template, else the tokenizer's own, else a built-in one.
A reply of the assistant is a target (data.train_on=assistant), or every token (all); a row that
cannot be used is refused naming its file and line, rows with nothing to learn are skipped.

Tool calling, as TRL's SFT reads it: an assistant message may carry `tool_calls` (its content then
null or missing), a `tool` message is a tool's reply, and a row's tools column (data.tools_field)
holds the JSON schemas of the tools it may call, handed to the template as `tools`. The templates themselves, and
how a rendered conversation becomes labelled tokens: trainloop.data.chat_template."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from trainloop.config.sections import DataConfig
from trainloop.data.chat_template import (
    TemplateConfig, chat_template, chat_tokens, decoded_json, row_tools, template_messages,
)
from trainloop.data.formats.base import DataFormat, ragged_table
from trainloop.data.formats.rows import json_kind, read_rows, root_cause, row_place, struct_columns_as_json
from trainloop.errors import ConfigError

log = logging.getLogger("trainloop")

ROLES = ("system", "user", "assistant", "tool")
# The shapes named in messages (OpenAI's, which transformers' templates and TRL read).
TOOL_CALL = '{"type": "function", "function": {"name": ..., "arguments": {...}}}'
TOOL_SCHEMA = '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}'


@dataclass
class ChatConfig(TemplateConfig):
    messages_field: str = "messages"  # the column holding a list of {role, content} messages
    tools_field: str = "tools"  # the column of each row's tool schemas (TRL's name); optional at its default


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

