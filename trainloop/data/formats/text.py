"""Text formats: every token a target. data=files reads a text column of your files; data=pydoc,
Python's bundled documentation topics (pydoc_data, ~465k characters, no download)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from trainloop.config.sections import DataConfig
from trainloop.data.formats.base import TOKENIZING, DataFormat, ragged_table
from trainloop.errors import ConfigError

log = logging.getLogger("trainloop")


def drop_rows_without_text(texts, field: str, num_proc: int | None):
    """Rows where the text field is missing or empty are skipped, and said so; none left is refused."""
    kept = texts.filter(lambda batch: [bool(t) for t in batch[field]], batched=True, num_proc=num_proc,
                        desc="drop rows without text")
    skipped = len(texts) - len(kept)
    if skipped == len(texts):
        raise ConfigError(f"none of the {len(texts)} rows has text in data.text_field={field!r}: "
                          "set data.text_field to the column that holds the text")
    if skipped:
        log.warning("skipped %d of %d rows with no text in data.text_field=%r (missing or empty)",
                    skipped, len(texts), field)
    return kept


@dataclass
class FilesConfig:
    text_field: str = "text"  # the column that holds the text


class Files(DataFormat):
    """Your own local data: text, json, jsonl, csv or parquet, one document per row."""

    name = "files"
    keys = FilesConfig
    fields = {"data.text_field": "text"}

    def load(self, cfg: DataConfig, tokenizer=None):
        """Rows without text are skipped."""
        return drop_rows_without_text(self.rows(cfg), cfg.text_field, cfg.num_proc)

    def row_tokenizer(self, cfg: DataConfig, tokenizer):
        eos = tokenizer.eos_token_id

        def tokenize(batch):  # every token a target: no labels column
            texts = tokenizer(batch[cfg.text_field], add_special_tokens=False)["input_ids"]
            return ragged_table(input_ids=[x + [eos] for x in texts])
        return tokenize


class Pydoc(Files):
    """The topics as text rows, in a column named as data=files names its own (data.text_field)."""

    name = "pydoc"
    path = ""

    def reads(self) -> tuple[str, ...]:
        return TOKENIZING  # no data.path, and the column is its own to name, not the user's

    def rows(self, cfg: DataConfig):
        from pydoc_data.topics import topics

        import datasets

        return datasets.Dataset.from_dict({cfg.text_field: [topics[k] for k in sorted(topics)]})

    def place(self, cfg: DataConfig, r: int) -> str:
        return f"pydoc topic {r + 1}"
