"""data=chat: conversations, rows holding a list of {role, content} messages (json, jsonl, parquet),
rendered with a chat template: data.chat_template, else the tokenizer's own, else a built-in one.
A reply of the assistant is a target (data.train_on=assistant), or every token (all); a row that
cannot be used is refused naming its file and line, rows with nothing to learn are skipped."""

from __future__ import annotations

import logging
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trainloop.config.sections import DataConfig
from trainloop.data.formats.base import DataFormat, ragged_table
from trainloop.data.formats.rows import json_kind, root_cause, row_place
from trainloop.data.tokenizer import IGNORE
from trainloop.errors import ConfigError

log = logging.getLogger("trainloop")

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class TemplateConfig:
    """The key of every format that renders messages (data=chat, preference, prompts)."""

    chat_template: Optional[str] = None  # a Jinja template file; None: the tokenizer's, else the built-in one


@dataclass
class ChatConfig(TemplateConfig):
    messages_field: str = "messages"  # the column holding a list of {role, content} messages

# For tokenizers without a chat template (the built-in byte-level one included): each message
# is a role line, its content and the end-of-text token, so a reply ends where the model learns to stop.
BUILTIN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


# The tokenizers already told that they have no chat template: said once per run (one tokenizer),
# not once per caller (the run's final/ tokenizer, the row checks, the row tokenizer).
TOLD_BUILTIN = weakref.WeakSet()


def chat_template(cfg: DataConfig, tokenizer) -> str:
    """The template rows are rendered with (template_of); the built-in one is said once, as rows are
    rendered with it."""
    template = template_of(cfg, tokenizer)
    if template is BUILTIN_CHAT_TEMPLATE and tokenizer not in TOLD_BUILTIN:
        TOLD_BUILTIN.add(tokenizer)
        log.info("the tokenizer has no chat template: using trainloop's built-in one (data.chat_template=FILE to choose)")
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
    """What makes a conversation unusable whatever the template: None if it is a list of {role, content}."""
    if not isinstance(messages, list):
        return f"is {json_kind(messages)}, not a list of {{role, content}} messages"
    for m, message in enumerate(messages, 1):
        if not isinstance(message, dict):
            return f"message {m} is {json_kind(message)}, not a {{role, content}} object"
        role = message.get("role")
        if role not in ROLES:
            return f"message {m} has role {role!r}; the roles are {', '.join(ROLES)}"
        if not isinstance(message.get("content"), str):
            return f"message {m} ({role}) has no content; every message needs a text 'content'"
    return None


def usable_conversations(rows, cfg: DataConfig, tokenizer=None):
    """The conversations to train on, by the rules docs/fine-tuning.md's data=chat list gives: a row that
    cannot be used is refused naming its file and line; rows with nothing to learn are skipped and
    counted; kept rows of unusual shape are counted too, in the same warning line."""
    from collections import Counter

    field, assistant_only = cfg.messages_field, cfg.train_on == "assistant"
    template = chat_template(cfg, tokenizer) if tokenizer is not None else None
    skipped, kept_as, keep, replies, empty = Counter(), Counter(), [], 0, 0
    for r, messages in enumerate(rows[field]):
        if not messages:
            skipped["no messages (missing or empty)"] += 1
            continue
        problem = message_problem(messages)
        if problem:
            raise ConfigError(f"{row_place(cfg.path, r)}: data.messages_field={field!r} {problem}; fix or remove that row")
        if template is not None:
            try:  # a template's own rule (e.g. raise_exception on roles that do not alternate) refuses the row
                tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
            except Exception as err:  # noqa: BLE001 - whatever a template raises, name the row
                raise ConfigError(f"{row_place(cfg.path, r)}: the chat template cannot render this conversation "
                                  f"({root_cause(err)}); fix the row, or choose a template that accepts it "
                                  "(data.chat_template=FILE)") from None
        roles = [m["role"] for m in messages]
        if roles[0] == "assistant":
            skipped["the assistant's reply first (it answers no prompt)"] += 1
            continue
        if assistant_only and "assistant" not in roles:
            skipped["no assistant reply"] += 1
            continue
        keep.append(r)
        row_replies = [m["content"] for m in messages if m["role"] == "assistant"]
        replies, empty = replies + len(row_replies), empty + sum(not c.strip() for c in row_replies)
        pairs = set(zip(roles, roles[1:]))
        notes = {"a trailing turn after the last reply (not trained)": assistant_only and roles[-1] != "assistant",
                 "two user turns in a row": ("user", "user") in pairs,
                 "two assistant replies in a row": ("assistant", "assistant") in pairs,
                 "a system turn after the first message": "system" in roles[1:],
                 "an empty reply (trained as its end of turn alone)": any(not c.strip() for c in row_replies)}
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


def chat_tokens(messages: list[dict], tokenizer, template: str, train_on: str) -> tuple[list[int], list[int]]:
    """The conversation rendered with the template, tokenized piece by piece so each piece's labels
    are known: an assistant reply (after its header) is a target; with train_on=all, everything is.
    A template with {% generation %} markers decides the targets itself (marked_chat_tokens)."""
    if GENERATION_MARKER.search(template):
        return marked_chat_tokens(messages, tokenizer, template, train_on)

    def render(upto: list[dict], prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(upto, chat_template=template, tokenize=False,
                                             add_generation_prompt=prompt) if upto or prompt else ""

    ids, labels, done = [], [], ""

    def add(text: str, target: bool) -> None:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        ids.extend(piece)
        labels.extend(piece if target else [IGNORE] * len(piece))

    for i, message in enumerate(messages):
        reply = message["role"] == "assistant"
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


def marked_chat_tokens(messages: list[dict], tokenizer, template: str, train_on: str) -> tuple[list[int], list[int]]:
    """The whole conversation rendered and tokenized at once; the targets are the tokens that the
    template's {% generation %} blocks cover, exactly transformers' assistant mask (which TRL's
    assistant_only_loss uses). A row whose blocks cover no token has no target (packing drops it)."""
    if train_on == "all":
        ids = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=False)
        return ids, ids
    out = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    ids = out["input_ids"]
    return ids, [token if marked else IGNORE for token, marked in zip(ids, out["assistant_masks"])]


class Chat(DataFormat):
    name = "chat"
    keys = ChatConfig
    fields = {"data.messages_field": "json"}
    train_on = ("assistant", "all")
    masked = True

    def load(self, cfg: DataConfig, tokenizer=None):
        """Conversations kept, skipped or refused by the rules above (the template's own among them
        when the tokenizer is given)."""
        return usable_conversations(self.rows(cfg), cfg, tokenizer)

    def row_tokenizer(self, cfg: DataConfig, tokenizer):
        template = chat_template(cfg, tokenizer)

        def tokenize(batch):
            pairs = [chat_tokens(m, tokenizer, template, cfg.train_on) for m in batch[cfg.messages_field]]
            return ragged_table(input_ids=[p[0] for p in pairs], labels=[p[1] for p in pairs])
        return tokenize

    def chat_template(self, cfg: DataConfig, tokenizer) -> str:
        return chat_template(cfg, tokenizer)

