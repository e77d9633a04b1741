"""What a data format answers: the keys it reads, what it trains on, how its rows become blocks."""

from __future__ import annotations

import dataclasses
from itertools import chain

from trainloop.config.sections import DataConfig
from trainloop.data.formats.rows import read_rows, row_place

# The keys that shape the tokens and the validation split of a format that reads rows; a format
# that reads tokens made elsewhere (data=prepared) had them given where its tokens were made.
TOKENIZING = ("data.train_on", "data.validation_fraction", "data.num_proc")


class DataFormat:
    """A data format: a row of trainloop.data.formats.FORMATS, chosen by `data=NAME` (conf/data/NAME.yaml).

    What config checks, the prepare command and the shards read without building anything:
    - name: its data.name.
    - keys: the dataclass of the data.* keys it reads beyond those every format reads (trainloop/config/
      sections.py's DataConfig), declared beside it; trainloop/config/schema.py composes them.
    - fields: {config key: "text" or "json"}, those of its keys that name the columns it reads from
      each row (data.text_field...), a "json" one holding any JSON value (a conversation); nothing
      else of a row is read.
    - train_on: the data.train_on values it serves; the first is its default (its YAML sets it).
    - masked: whether its labels hide some tokens, so its tokens carry a target mask (and shards a mask.npy).
    - loads_rows: whether it reads rows and tokenizes them itself (data=prepared reads tokens).
    - pairs: whether its items are preference pairs (for objective=dpo) rather than token blocks.
    - prompts: whether its items are prompts alone (for objective=grpo, which generates the completions).
    - unpaired: whether its items are single completions labelled desirable or not (for objective=kto).
    - images: whether its rows carry images beside their tokens (a vision-language model's, data=vision_chat).
    - path: what data.path holds for it, in a message; "" where it reads no data.path.

    How it builds (the run's data, `python -m trainloop.prepare`): rows(cfg) reads the fields;
    load(cfg, tokenizer) checks the rows by its rules; row_tokenizer(cfg, tokenizer) tokenizes a batch
    of them; build(cfg, tokenizer, seed) gives the train and validation blocks; chat_template(cfg,
    tokenizer) is the template its rows are rendered with, if any.
    """

    name = ""
    keys: type | None = None
    fields: dict[str, str] = {}
    train_on: tuple[str, ...] = ("all",)
    masked = False
    loads_rows = True
    pairs = False  # its items are preference pairs (objective=dpo), not blocks of target tokens
    prompts = False  # its items are prompts alone, whose completions the objective generates (objective=grpo)
    unpaired = False  # its items are single completions labelled desirable or not (objective=kto)
    images = False  # its rows carry images beside their tokens (data=vision_chat): a vision-language model's
    path = "a file, directory or glob of your data"

    def reads(self) -> tuple[str, ...]:
        """The data.* keys it reads of those that not every format reads (config.read_only_by)."""
        own = tuple(f"data.{key.name}" for key in dataclasses.fields(self.keys)) if self.keys else ()
        return (*(("data.path", "data.sources") if self.path else ()), *own, *(TOKENIZING if self.loads_rows else ()))

    def unread_hint(self, key: str) -> str:
        """Where a key it does not read goes instead, said when the key is refused ("" : nowhere)."""
        return ""

    def problems(self, cfg) -> list[str]:
        """Its own config checks (the whole config), beyond the ones every format has."""
        return []

    def columns(self, cfg: DataConfig) -> dict[str, str]:
        """The columns it reads: the config key that names each, with its value."""
        return {key: getattr(cfg, key.removeprefix("data.")) for key in self.fields}

    def rows(self, cfg: DataConfig):
        """A `datasets.Dataset` with one document per row, and only the columns it reads."""
        return read_rows(cfg.path, self.columns(cfg), [key for key, kind in self.fields.items() if kind == "json"])

    def place(self, cfg: DataConfig, r: int) -> str:
        """Where row r of rows(cfg) comes from (FILE:LINE): for messages only."""
        return row_place(cfg.path, r)

    def load(self, cfg: DataConfig, tokenizer=None):
        """The rows, checked by its rules (with the tokenizer's, where it is given)."""
        return self.rows(cfg)

    def row_tokenizer(self, cfg: DataConfig, tokenizer):
        """A `datasets.map` function: a batch of rows -> their input_ids, and labels (IGNORE where no
        loss) unless every token is a target (ragged_table)."""
        raise NotImplementedError

    def tokenize(self, cfg: DataConfig, tokenizer, examples, desc: str = "tokenize"):
        """input_ids and labels for each row, by `datasets.map` over data.num_proc processes."""
        return examples.map(self.row_tokenizer(cfg, tokenizer), batched=True, remove_columns=examples.column_names,
                            num_proc=cfg.num_proc, desc=desc)

    def build(self, cfg: DataConfig, tokenizer, seed: int):
        """Tokenize (cached by `datasets` for files) and label; hold whole documents out for validation
        (data.validation_fraction, drawn from the seed); fit to data.seq_len and pack as data.packing says.

        The blocks are planned and gathered by trainloop.data.packing, the code that serves prepared shards
        (data=prepared: memory-mapped, gathered block by block), so both give the same blocks.
        """
        from trainloop.data.packing import Documents, part_from_batches, plan_blocks, split_documents, token_batches
        from trainloop.data.sets import materialize
        from trainloop.data.tokenizer import pad_id

        tokens = self.tokenize(cfg, tokenizer, self.load(cfg, tokenizer))
        documents = Documents([part_from_batches(token_batches(tokens), masked=self.masked)])
        held_out = split_documents(len(documents), cfg.validation_fraction, seed)
        train, valid = plan_blocks(cfg, documents, held_out, pad_id(tokenizer))
        return materialize(train), materialize(valid)

    def chat_template(self, cfg: DataConfig, tokenizer) -> str | None:
        """The chat template its rows are rendered with, which final/'s tokenizer must carry so the
        model is prompted as it was trained; None for text."""
        return None


def ragged_table(**columns: list[list[int]]):
    """Rows of token lists as an Arrow table of int32 lists, built from flat arrays: handing
    `datasets` Python lists costs it a type check and a conversion per token (most of map's time)."""
    import numpy as np
    import pyarrow as pa

    arrays = {}
    for name, rows in columns.items():
        offsets = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(np.fromiter(map(len, rows), dtype=np.int64, count=len(rows)), out=offsets[1:])
        values = np.fromiter(chain.from_iterable(rows), dtype=np.int32, count=int(offsets[-1]))
        arrays[name] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    return pa.table(arrays)

