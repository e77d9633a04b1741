"""data=preference: TRL's preference pairs (json, jsonl, parquet), one training item per pair.

A row holds `prompt`, `chosen` and `rejected` (data.prompt_field, chosen_field, rejected_field) as
plain text, or as conversations: the prompt's turns, then the assistant's turn for each completion,
rendered with the chat template as data=chat renders (data.chat_template, else the tokenizer's,
else the built-in one). Without a prompt column, chosen and rejected are whole conversations and
their shared leading turns are the prompt (TRL's implicit prompt). The completion starts where the
tokenized prompt and prompt + completion part (TRL's rule); plain completions end with the EOS token.

The rules for a row (docs/preferences.md): a row without chosen or rejected, a value that
is neither text nor a list of messages (a number), an empty prompt, a row that mixes text and
conversations, a plain-text row without a prompt, or a conversation whose last turn is not the
assistant's is refused naming its FILE:LINE; a row whose chosen equals its rejected teaches nothing
and is skipped and counted. A pair longer than data.seq_len keeps its prompt and has its completions
truncated (counted; a warning when every pair is); a pair whose prompt alone fills data.seq_len, or
whose truncated chosen and rejected are the same, is skipped and counted (none left: refused). Each
pair is one item, chosen and rejected each padded on the right to data.seq_len with labels IGNORE
outside the completion: pairs are not packed together.

A `margin` column (TRL's: how much better chosen is, a number in every row) is carried with each
pair, for objective=reward's loss; the other objectives do not read it, as TRL's trainers do not.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

from trainloop.config.sections import DataConfig
from trainloop.data.chat_template import TemplateConfig, chat_template, template_of
from trainloop.data.formats.base import DataFormat, ragged_table
from trainloop.data.formats.chat import message_problem
from trainloop.data.formats.prompt_completion import PromptConfig
from trainloop.data.formats.rows import json_kind, read_rows
from trainloop.data.tokenizer import IGNORE
from trainloop.errors import ConfigError

log = logging.getLogger("trainloop")

SIDES = ("chosen", "rejected")
MARGIN = "margin"  # the optional column of per-pair margins, by TRL's name (objective=reward reads it)


def shared_turns(chosen: list, rejected: list) -> int:
    """How many leading messages two conversations share (the implicit prompt)."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    return n


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@dataclass
class PreferenceConfig(PromptConfig, TemplateConfig):
    chosen_field: str = "chosen"  # the column holding the preferred completion (text or messages)
    rejected_field: str = "rejected"  # the column holding the other completion (text or messages)


class OneItemPerRow(DataFormat):
    """A format whose every row is one item padded to data.seq_len, never packed, a long row's prompt kept
    and its completions truncated, read from data.path alone (data=preference, unpaired). `item` names a row."""

    item = "row"
    train_on = ("completion",)
    masked = True

    def reads(self) -> tuple[str, ...]:
        """Not data.sources: a mixture of such sets is not in this slice."""
        return tuple(key for key in super().reads() if key != "data.sources")

    def problems(self, cfg) -> list[str]:
        d, problems, name = cfg.data, [], f"data={self.name}"
        if d.sources:
            problems.append(f"{name} reads data.path, not a mixture (data.sources): set data.sources=null")
        if d.packing != "none":
            problems.append(f"data.packing={d.packing}: {name} makes one item of each {self.item}, padded to "
                            "data.seq_len, and packs none together; set data.packing=none")
        if d.overlong != "truncate":
            problems.append(f"data.overlong={d.overlong}: {name} keeps a long {self.item}'s prompt and truncates "
                            "its completions; set data.overlong=truncate")
        return problems


class Preference(OneItemPerRow):
    name = "preference"
    keys = PreferenceConfig
    fields = {"data.prompt_field": "json", "data.chosen_field": "json", "data.rejected_field": "json"}
    item = "pair"
    pairs = True

    def rows(self, cfg: DataConfig):
        """The prompt, chosen and rejected columns; without a prompt column, chosen and rejected alone
        (the implicit-prompt form: whole conversations)."""
        columns = {**self.columns(cfg), MARGIN: MARGIN}
        try:
            return read_rows(cfg.path, columns, list(columns), optional=(MARGIN,))
        except ConfigError as err:
            if not str(err).startswith(f"data.prompt_field={cfg.prompt_field!r} is not a column"):
                raise
        del columns["data.prompt_field"]
        return read_rows(cfg.path, columns, list(columns), optional=(MARGIN,))

    def load(self, cfg: DataConfig, tokenizer=None):
        """The pairs, by the rules above: refused naming FILE:LINE, or skipped and counted."""
        rows = self.rows(cfg)
        prompts = rows[cfg.prompt_field] if cfg.prompt_field in rows.column_names else [None] * len(rows)
        margins = rows[MARGIN] if MARGIN in rows.column_names else None
        if margins is not None and all(m is None for m in margins):  # a json file without the column
            rows, margins = rows.remove_columns(MARGIN), None
        keep, skipped = [], Counter()
        for r, (prompt, chosen, rejected) in enumerate(zip(prompts, rows[cfg.chosen_field],
                                                           rows[cfg.rejected_field])):
            problem = pair_problem(cfg, prompt, chosen, rejected) or (margin_problem(margins[r]) if margins else None)
            if problem:
                raise ConfigError(f"{self.place(cfg, r)}: {problem}; fix or remove that row")
            if chosen == rejected:
                skipped["chosen identical to rejected"] += 1
                continue
            keep.append(r)
        if not keep:
            raise ConfigError(f"none of the {len(rows)} rows of {cfg.path} is a pair to learn from: "
                              "each has chosen identical to rejected")
        if skipped:
            log.warning("data=preference rows of %s: skipped %d of %d (%s)", cfg.path, sum(skipped.values()),
                        len(rows), ", ".join(f"{n} with {why}" for why, n in skipped.items()))
        return rows.select(keep) if len(keep) < len(rows) else rows

    def row_tokenizer(self, cfg: DataConfig, tokenizer):
        """A batch of pairs -> prompt_ids, chosen_ids, rejected_ids (the completions, after the prompt)."""
        template = None

        def render(messages: list, prompt: bool = False) -> list[int]:
            text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=prompt) if messages or prompt else ""
            return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

        def encode(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

        def tokenize(batch):
            nonlocal template
            prompts = batch[cfg.prompt_field] if cfg.prompt_field in batch else [None] * len(batch[cfg.chosen_field])
            out = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
            for prompt, chosen, rejected in zip(prompts, batch[cfg.chosen_field], batch[cfg.rejected_field]):
                if isinstance(chosen, list):
                    if prompt is None:  # implicit prompt: the turns both conversations share
                        n = shared_turns(chosen, rejected)
                        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
                    template = template or chat_template(cfg, tokenizer)
                    prompt_ids = render(prompt, prompt=True)
                    full = [render(prompt + chosen), render(prompt + rejected)]
                else:
                    prompt_ids = encode(prompt)
                    full = [encode(prompt + chosen) + [tokenizer.eos_token_id],
                            encode(prompt + rejected) + [tokenizer.eos_token_id]]
                # the completion starts where the prompt alone and prompt + completion part (TRL's rule)
                start = min(common_prefix_length(prompt_ids, ids) for ids in full)
                out["prompt_ids"].append(prompt_ids[:start])
                out["chosen_ids"].append(full[0][start:])
                out["rejected_ids"].append(full[1][start:])
            return ragged_table(**out)
        return tokenize

    def build(self, cfg: DataConfig, tokenizer, seed: int):
        """One item per pair, prompt + completion padded to data.seq_len; whole pairs held out for
        validation (data.validation_fraction, drawn from the seed)."""
        import torch

        from trainloop.data.packing import split_documents
        from trainloop.data.sets import PairBlocks
        from trainloop.data.tokenizer import pad_id

        rows = self.load(cfg, tokenizer)
        tokens = self.tokenize(cfg, tokenizer, rows)
        margins = rows[MARGIN] if MARGIN in rows.column_names else None
        L, pad = cfg.seq_len, pad_id(tokenizer)
        pairs, kept, truncated, full, alike, longest = [], [], 0, 0, 0, 0
        for i, (prompt, chosen, rejected) in enumerate(zip(tokens["prompt_ids"], tokens["chosen_ids"],
                                                           tokens["rejected_ids"])):
            room, longest = L - len(prompt), max(longest, len(prompt) + max(len(chosen), len(rejected)))
            if room <= 0:
                full += 1
                continue
            cut = chosen[:room], rejected[:room]
            if max(len(chosen), len(rejected)) > room:
                truncated += 1
                if cut[0] == cut[1]:  # what tells chosen from rejected was cut off: nothing to learn
                    alike += 1
                    continue
            pairs.append((prompt, *cut))
            kept.append(i)
        if full == len(tokens):
            raise ConfigError(f"data.seq_len={L}: the prompt of every one of the {len(tokens)} pairs fills it, "
                              "leaving no room for a completion; raise data.seq_len")
        if not pairs:
            raise ConfigError(f"data.seq_len={L}: no pair keeps a part of its completions that tells chosen from "
                              f"rejected (the longest pair is {longest} tokens); raise data.seq_len")
        if truncated or full:  # losing every pair's ends, or whole pairs, is worth more than a note
            say = log.warning if full or alike or truncated == len(tokens) else log.info
            say("data: of %d pairs (data.seq_len=%d, the longest %d tokens): %d with their completions truncated, "
                "%d skipped as their prompt alone fills data.seq_len, %d skipped as truncated chosen and rejected "
                "are the same", len(tokens), L, longest, truncated, full, alike)
        tensors = {f"{side}_{key}": torch.full((len(pairs), L), fill, dtype=torch.int64)
                   for side in SIDES for key, fill in (("input_ids", pad), ("labels", IGNORE))}
        for i, (prompt, *completions) in enumerate(pairs):
            for side, completion in zip(SIDES, completions):
                n = len(prompt) + len(completion)
                tensors[f"{side}_input_ids"][i, :n] = torch.tensor(prompt + completion)
                tensors[f"{side}_labels"][i, len(prompt):n] = torch.tensor(completion, dtype=torch.int64)
        if margins is not None:
            tensors[MARGIN] = torch.tensor([float(margins[i]) for i in kept])
        held_out = torch.zeros(len(pairs), dtype=torch.bool)
        held_out[torch.from_numpy(split_documents(len(pairs), cfg.validation_fraction, seed))] = True
        return (PairBlocks({k: t[~held_out] for k, t in tensors.items()}),
                PairBlocks({k: t[held_out] for k, t in tensors.items()}))

    def chat_template(self, cfg: DataConfig, tokenizer) -> str | None:
        """The template conversations are rendered with, which final/'s tokenizer then carries; for
        plain-text pairs none is used, but final/ carries it as for data=chat (read without the rows)."""
        return template_of(cfg, tokenizer)


def margin_problem(margin) -> str | None:
    """What is wrong with a row's margin (a number: how much better chosen is), or None."""
    import math

    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
        return (f"margin={margin!r} is not a number (the {MARGIN} column, read by objective=reward, holds how much "
                "better chosen is than rejected, in every row)")
    return None


def pair_problem(cfg: DataConfig, prompt, chosen, rejected) -> str | None:
    """What makes a row unusable (named with its place); None for a pair, even an identical one."""
    named = {f"data.{side}_field={getattr(cfg, f'{side}_field')!r}": value
             for side, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected))}
    prompt_key, chosen_key, rejected_key = named
    for key in (chosen_key, rejected_key):
        if named[key] is None or named[key] == "" or named[key] == []:
            return f"{key} is missing or empty; every row needs chosen and rejected"
    for key, value in named.items():
        if value is not None and not isinstance(value, (str, list)):
            return f"{key} is {json_kind(value)}: give text, or a list of {{role, content}} messages"
    if prompt == "" or prompt == []:
        return (f"{prompt_key} is empty: a pair needs its prompt (or no prompt column: conversations sharing "
                "their first turns)")
    kinds = {type(v) for v in (prompt, chosen, rejected) if v is not None}
    if kinds == {str}:
        if prompt is None:
            return (f"{prompt_key} is missing: a plain-text pair needs its prompt "
                    "(only conversations may leave it out, sharing their first turns)")
        return None
    if kinds != {list}:
        return ("mixes text and conversations ("
                + ", ".join(f"{name} is {json_kind(v)}" for name, v in zip(("prompt", *SIDES), (prompt, chosen, rejected))
                            if v is not None) + "); give all text or all lists of {role, content} messages")
    for name, value in zip(("prompt", *SIDES), (prompt, chosen, rejected)):
        problem = message_problem(value) if value is not None else None
        if problem:
            return f"{name} {problem}"
        if name != "prompt" and value[-1]["role"] != "assistant":
            return f"{name}'s last turn is the {value[-1]['role']}'s, not the assistant's: a completion is its reply"
        if name != "prompt" and not value[-1].get("content") and not value[-1].get("tool_calls"):
            return (f"{name}'s last turn, the assistant's, is empty: a completion needs its text (as a plain-text "
                    f"{name} of \"\" is refused)")
    if prompt is None and shared_turns(chosen, rejected) == 0 and chosen != rejected:
        return "has no prompt column and chosen and rejected share no first turn: give a prompt"
    return None
