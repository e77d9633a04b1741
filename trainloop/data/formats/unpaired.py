"""data=unpaired: TRL's unpaired preference format (json, jsonl, parquet) for objective=kto, one item per row.

A row holds `prompt`, `completion` and a boolean `label` (data.prompt_field, completion_field,
label_field): true where the completion is desirable (a thumbs up), false where it is not. Prompt and
completion are plain text, or conversations (the prompt's turns, then the assistant's turn) rendered
with the chat template as data=chat renders them (data.chat_template, else the tokenizer's, else the
built-in one). The completion starts where the tokenized prompt and prompt + completion part (TRL's
rule); a plain completion ends with the EOS token.

KTO estimates the KL term from mismatched pairs: each row also carries its prompt followed by the
completion of the row before it (the first row takes the last one's), in the file's order: TRL rotates
within each per-device batch of the file's order; the whole file's rotation keeps the pairs the same at
every batch size and number of processes.

A row without a completion, a label that is not true or false, a value that is neither text nor a
list of messages, an empty prompt, a row that mixes text and conversations, or a completion whose
last turn is not the assistant's is refused naming its FILE:LINE. A row longer than data.seq_len
keeps its prompt and has its completion truncated (counted); a row whose prompt alone fills
data.seq_len is skipped and counted (none left: refused). Items are padded on the right to
data.seq_len, labels IGNORE outside the completion: rows are not packed together.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from trainloop.config.sections import DataConfig
from trainloop.data.chat_template import TemplateConfig, chat_template, template_of
from trainloop.data.formats.base import ragged_table
from trainloop.data.formats.chat import message_problem
from trainloop.data.formats.preference import OneItemPerRow, common_prefix_length
from trainloop.data.formats.prompt_completion import PromptConfig
from trainloop.data.formats.rows import json_kind, read_rows
from trainloop.data.tokenizer import IGNORE
from trainloop.errors import ConfigError

log = logging.getLogger("trainloop")

LABEL = "label"  # the items' column of the rows' labels (1: desirable)
KL = "kl_"  # the prefix of the items' mismatched sequences (kl_input_ids, kl_labels)


@dataclass
class UnpairedConfig(PromptConfig, TemplateConfig):
    completion_field: str = "completion"  # the column holding the completion (text or messages)
    label_field: str = "label"  # the column holding true (a desirable completion) or false


class Unpaired(OneItemPerRow):
    name = "unpaired"
    keys = UnpairedConfig
    fields = {"data.prompt_field": "json", "data.completion_field": "json", "data.label_field": "json"}
    unpaired = True

    def rows(self, cfg: DataConfig):
        columns = self.columns(cfg)
        return read_rows(cfg.path, columns, list(columns))

    def load(self, cfg: DataConfig, tokenizer=None):
        """The rows, by the rules above: refused naming FILE:LINE."""
        rows = self.rows(cfg)
        for r, (prompt, completion, label) in enumerate(zip(rows[cfg.prompt_field], rows[cfg.completion_field],
                                                             rows[cfg.label_field])):
            problem = row_problem(cfg, prompt, completion, label)
            if problem:
                raise ConfigError(f"{self.place(cfg, r)}: {problem}; fix or remove that row")
        return rows

    def row_tokenizer(self, cfg: DataConfig, tokenizer):
        """A batch of rows -> prompt_ids and completion_ids (the completion, after the prompt)."""
        template = None

        def render(messages: list, prompt: bool = False) -> list[int]:
            text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=prompt)
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        def encode(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

        def tokenize(batch):
            nonlocal template
            out = {"prompt_ids": [], "completion_ids": []}
            for prompt, completion in zip(batch[cfg.prompt_field], batch[cfg.completion_field]):
                if isinstance(completion, list):
                    template = template or chat_template(cfg, tokenizer)
                    prompt_ids, full = render(prompt, prompt=True), render(prompt + completion)
                else:
                    prompt_ids, full = encode(prompt), encode(prompt + completion) + [tokenizer.eos_token_id]
                start = common_prefix_length(prompt_ids, full)  # TRL's rule, as data=preference's
                out["prompt_ids"].append(prompt_ids[:start])
                out["completion_ids"].append(full[start:])
            return ragged_table(**out)
        return tokenize

    def build(self, cfg: DataConfig, tokenizer, seed: int):
        """One item per row, prompt + completion padded to data.seq_len, with its label and its
        mismatched sequence; whole rows held out for validation (data.validation_fraction, drawn from the seed)."""
        import torch

        from trainloop.data.packing import split_documents
        from trainloop.data.sets import UnpairedRows
        from trainloop.data.tokenizer import pad_id

        rows = self.load(cfg, tokenizer)
        tokens = self.tokenize(cfg, tokenizer, rows)
        prompts, completions, labels = tokens["prompt_ids"], tokens["completion_ids"], rows[cfg.label_field]
        L, pad, n = cfg.seq_len, pad_id(tokenizer), len(prompts)
        kept = [i for i in range(n) if len(prompts[i]) < L]
        if not kept:
            raise ConfigError(f"data.seq_len={L}: the prompt of every one of the {n} rows fills it, leaving no room "
                              "for a completion; raise data.seq_len")
        truncated = sum(len(prompts[i]) + len(completions[i]) > L for i in kept)
        if truncated or len(kept) < n:
            say = log.warning if len(kept) < n or truncated == len(kept) else log.info
            say("data: of %d rows (data.seq_len=%d): %d with their completions truncated, %d skipped as their prompt "
                "alone fills data.seq_len", n, L, truncated, n - len(kept))
        tensors = {f"{prefix}{key}": torch.full((len(kept), L), fill, dtype=torch.int64)
                   for prefix in ("", KL) for key, fill in (("input_ids", pad), ("labels", IGNORE))}
        for row, i in enumerate(kept):
            for prefix, completion in (("", completions[i]), (KL, completions[kept[row - 1]])):
                prompt = prompts[i]
                completion = completion[:L - len(prompt)]
                end = len(prompt) + len(completion)
                tensors[f"{prefix}input_ids"][row, :end] = torch.tensor(prompt + completion)
                tensors[f"{prefix}labels"][row, len(prompt):end] = torch.tensor(completion, dtype=torch.int64)
        tensors[LABEL] = torch.tensor([bool(labels[i]) for i in kept])
        desirable = int(tensors[LABEL].sum())
        if desirable in (0, len(kept)):
            side, absent = ("desirable (true)", "rejected") if desirable else ("undesirable (false)", "chosen")
            log.warning("data: every one of the %d rows is labelled %s in data.label_field=%r: KTO then learns "
                        "from one side only, against its KL reference point, and rewards/%s and logps/%s are left "
                        "out of the log; give rows of both labels", len(kept), side, cfg.label_field, absent, absent)
        held_out = torch.zeros(len(kept), dtype=torch.bool)
        held_out[torch.from_numpy(split_documents(len(kept), cfg.validation_fraction, seed))] = True
        return (UnpairedRows({k: t[~held_out] for k, t in tensors.items()}),
                UnpairedRows({k: t[held_out] for k, t in tensors.items()}))

    def chat_template(self, cfg: DataConfig, tokenizer) -> str | None:
        """The template conversations are rendered with, which final/'s tokenizer then carries."""
        return template_of(cfg, tokenizer)


def row_problem(cfg: DataConfig, prompt, completion, label) -> str | None:
    """What makes a row unusable (named with its place), or None."""
    prompt_key = f"data.prompt_field={cfg.prompt_field!r}"
    completion_key = f"data.completion_field={cfg.completion_field!r}"
    if completion is None or completion == "" or completion == []:
        return f"{completion_key} is missing or empty; every row needs its completion"
    if not isinstance(label, bool):
        return (f"data.label_field={cfg.label_field!r} is {json_kind(label)}, not true or false: true marks a "
                "desirable completion, false an undesirable one")
    for key, value in ((prompt_key, prompt), (completion_key, completion)):
        if not isinstance(value, (str, list)):
            return f"{key} is {json_kind(value)}: give text, or a list of {{role, content}} messages"
    if prompt == "" or prompt == []:
        return f"{prompt_key} is empty: a row needs the prompt its completion answers"
    if type(prompt) is not type(completion):
        return (f"mixes text and conversations (prompt is {json_kind(prompt)}, completion is "
                f"{json_kind(completion)}); give both as text or both as lists of {{role, content}} messages")
    if isinstance(completion, list):
        for name, value in (("prompt", prompt), ("completion", completion)):
            problem = message_problem(value)
            if problem:
                return f"{name} {problem}"
        if completion[-1]["role"] != "assistant":
            return (f"completion's last turn is the {completion[-1]['role']}'s, not the assistant's: a completion is "
                    "its reply")
        if not completion[-1].get("content") and not completion[-1].get("tool_calls"):
            return ("completion's last turn, the assistant's, is empty: a completion needs its text (as a plain-text "
                    "completion of \"\" is refused)")
    return None
