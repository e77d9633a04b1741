"""data=prompts: TRL's prompt-only rows (json, jsonl, parquet), for objectives that generate their
own completions (objective=grpo).

A row's `prompt` (data.prompt_field) is plain text, tokenized as it is (the tokenizer's special
tokens added, as TRL does), or a conversation, a list of {role, content} messages rendered with the
chat template and ending with the generation prompt, as data=chat and data=preference render
(data.chat_template, else the tokenizer's, else the built-in one). Every other column of the row
(an `answer`, a test) is kept as it is and handed to the reward functions (trainloop.objectives.rewards).

The rules for a row (docs/grpo.md): a row without a prompt, a prompt that is neither
text nor a list of messages, or a conversation whose last turn is the assistant's is refused naming
its FILE:LINE; a prompt longer than data.seq_len tokens is skipped and counted (none left:
refused). Each prompt is one item, padded on the left to data.seq_len (generation continues on the
right), with the whole row as JSON beside it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass

from trainloop.config.sections import DataConfig
from trainloop.data.chat_template import TemplateConfig, chat_template, template_of
from trainloop.data.formats.base import DataFormat
from trainloop.data.formats.chat import message_problem
from trainloop.data.formats.prompt_completion import PromptConfig
from trainloop.data.formats.rows import data_files, json_kind, json_records, root_cause
from trainloop.errors import ConfigError

log = logging.getLogger("trainloop")

KINDS = ("json", "parquet")  # rows whose other columns keep their JSON types


def read_all_columns(cfg: DataConfig) -> list[tuple[str, dict]]:
    """(FILE:LINE, row) for every row of data.path, every column kept."""
    builder, files = data_files(cfg.path)
    if builder not in KINDS:
        raise ConfigError(f"data.path={cfg.path!r}: data=prompts reads json, jsonl or parquet files, whose rows keep "
                          f"their columns' types for the reward functions; found {builder} files")
    rows = []
    for file in files:
        if builder == "json":
            rows += list(json_records(cfg.path, file))
            continue
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(file)
        except (OSError, ValueError) as err:
            raise ConfigError(f"data.path={cfg.path!r}: {file} cannot be read as parquet ({root_cause(err)}); "
                              "fix or remove that file") from None
        rows += [(f"{file} row {k + 1}", row) for k, row in enumerate(table.to_pylist())]
    if not rows:
        raise ConfigError(f"data.path={cfg.path!r} holds no rows")
    return rows


def prompt_problem(cfg: DataConfig, prompt) -> str | None:
    """What makes a row's prompt unusable (named with its place)."""
    key = f"data.prompt_field={cfg.prompt_field!r}"
    if prompt is None or prompt == "" or prompt == []:
        return f"{key} is missing or empty; every row needs a prompt"
    if isinstance(prompt, str):
        return None
    problem = message_problem(prompt)
    if problem:
        return f"{key} {problem}" if isinstance(prompt, list) else (
            f"{key} is {json_kind(prompt)}: give text, or a list of {{role, content}} messages")
    if prompt[-1]["role"] == "assistant":
        return f"{key}'s last turn is the assistant's: a prompt ends where the model's reply begins"
    return None


@dataclass
class PromptsConfig(PromptConfig, TemplateConfig):
    """A prompt column, its conversations rendered with a chat template."""


class Prompts(DataFormat):
    name = "prompts"
    keys = PromptsConfig
    fields = {"data.prompt_field": "json"}
    train_on = ("completion",)
    masked = True
    prompts = True

    def reads(self) -> tuple[str, ...]:
        """Not data.sources (a mixture of prompt sets is not in this slice), nor data.num_proc (no datasets.map)."""
        return tuple(key for key in super().reads() if key not in ("data.sources", "data.num_proc"))

    def problems(self, cfg) -> list[str]:
        d, problems = cfg.data, []
        if d.sources:
            problems.append("data=prompts reads data.path, not a mixture (data.sources): set data.sources=null")
        if d.overlong != "drop":
            problems.append(f"data.overlong={d.overlong}: data=prompts skips (and counts) a prompt longer than "
                            "data.seq_len, as a completion must follow it whole; set data.overlong=drop")
        if d.packing != "none":
            problems.append(f"data.packing={d.packing}: data=prompts makes one item of each prompt and packs none "
                            "together; set data.packing=none")
        return problems

    def load(self, cfg: DataConfig, tokenizer=None) -> list[tuple[str, dict]]:
        """(FILE:LINE, row) of every row, refused naming its place by the rules above."""
        rows = read_all_columns(cfg)
        for place, row in rows:
            problem = prompt_problem(cfg, row.get(cfg.prompt_field))
            if problem:
                raise ConfigError(f"{place}: {problem}; fix or remove that row")
        text = isinstance(rows[0][1][cfg.prompt_field], str)
        other = next((place for place, row in rows if isinstance(row[cfg.prompt_field], str) != text), None)
        if other is not None:
            raise ConfigError(f"{other}: mixes text and conversations with {rows[0][0]}: the reward functions get "
                              "one kind, all text or all lists of {role, content} messages; fix or remove that row")
        return rows

    def prompt_tokens(self, cfg: DataConfig, tokenizer, tools: list[dict] | None = None):
        """A prompt (text or messages) -> its token ids; a conversation rendered with the JSON schemas of
        the `tools` the objective lets the model call (objective.tools), as TRL renders it."""
        template = None

        def tokens(prompt) -> list[int]:
            nonlocal template
            if isinstance(prompt, str):
                if tools:
                    raise ConfigError("objective.tools: a text prompt has no place for the tools' schemas, which the "
                                      f"chat template renders: give conversations ({cfg.prompt_field}: [{{role, "
                                      "content}, ...]), or no tools")
                return tokenizer(prompt)["input_ids"]
            template = template or chat_template(cfg, tokenizer)
            text = tokenizer.apply_chat_template(prompt, chat_template=template, tokenize=False,
                                                 add_generation_prompt=True, tools=tools or None)
            return tokenizer(text, add_special_tokens=False)["input_ids"]
        return tokens

    def build(self, cfg: DataConfig, tokenizer, seed: int, tools: list[dict] | None = None):
        """One item per prompt, padded on the left to data.seq_len; whole rows held out for validation
        (data.validation_fraction, drawn from the seed). `tools`: prompt_tokens'."""
        import torch

        from trainloop.data.packing import split_documents
        from trainloop.data.sets import PromptRows
        from trainloop.data.tokenizer import pad_id

        rows, tokens = self.load(cfg, tokenizer), self.prompt_tokens(cfg, tokenizer, tools)
        L, kept, ids = cfg.seq_len, [], []
        for _, row in rows:
            prompt_ids = tokens(row[cfg.prompt_field])
            if len(prompt_ids) <= L:
                kept.append(json.dumps(row, default=str))
                ids.append(prompt_ids)
        if not kept:
            raise ConfigError(f"data.seq_len={L}: every one of the {len(rows)} prompts is longer; raise data.seq_len "
                              "(the longest prompt, in tokens)")
        if len(kept) < len(rows):
            log.warning("data=prompts rows of %s: skipped %d of %d, whose prompt is longer than data.seq_len=%d "
                        "tokens", cfg.path, len(rows) - len(kept), len(rows), L)
        tensors = {"prompt_ids": torch.full((len(kept), L), pad_id(tokenizer), dtype=torch.int64),
                   "prompt_mask": torch.zeros((len(kept), L), dtype=torch.int64),
                   "row_digest": torch.tensor([int.from_bytes(hashlib.sha256(r.encode()).digest()[:7], "big")
                                               for r in kept], dtype=torch.int64)}
        for i, prompt_ids in enumerate(ids):
            tensors["prompt_ids"][i, L - len(prompt_ids):] = torch.tensor(prompt_ids)
            tensors["prompt_mask"][i, L - len(prompt_ids):] = 1
        held_out = torch.zeros(len(kept), dtype=torch.bool)
        held_out[torch.from_numpy(split_documents(len(kept), cfg.validation_fraction, seed))] = True
        part = lambda keep: PromptRows({k: t[keep] for k, t in tensors.items()},  # noqa: E731
                                       [r for r, k in zip(kept, keep.tolist()) if k])
        return part(~held_out), part(held_out)

    def chat_template(self, cfg: DataConfig, tokenizer) -> str | None:
        """The template conversations are rendered with, which final/'s tokenizer then carries (also
        after plain-text prompts, which render none: said only where rows are rendered)."""
        return template_of(cfg, tokenizer)
