"""Text in, packed token blocks out: the tokenizer, the datasets and their DataLoaders."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
from functools import partial
from itertools import chain
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from trainloop.errors import ConfigError
from trainloop.lifetime import start_loader_worker
from trainloop.schema import DataConfig
from trainloop.packing import IGNORE

log = logging.getLogger("trainloop")

EOS = "<|endoftext|>"
BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
            ".csv": "csv", ".parquet": "parquet"}


def byte_level_tokenizer():
    """256 byte tokens plus an end-of-text token: no training, no download, any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    vocab[EOS] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS, bos_token=EOS, pad_token=EOS, unk_token=EOS
    )


def build_tokenizer(tokenizer_path: str | None, model_path: str | None):
    """data.tokenizer if given, else the pretrained model's own, else the built-in bytes."""
    from transformers import AutoTokenizer

    path, key = (tokenizer_path, "data.tokenizer") if tokenizer_path else (model_path, "model.name_or_path")
    if path is None:
        return byte_level_tokenizer()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{key}={path!r}: no tokenizer could be loaded from it ({err}). Give a local "
            "directory with tokenizer files, or a hub id with HF_HUB_OFFLINE=0 and network access"
        ) from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"{key}={path!r}: the tokenizer has no eos_token to separate documents")
    return tokenizer


def data_files(path: str) -> tuple[str, list[str]]:
    """Expand data.path (file, directory or glob) into a `datasets` builder name and files."""
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(str(f) for f in p.rglob("*") if f.suffix in BUILDERS)
    else:
        files = sorted(glob.glob(str(p))) if any(c in path for c in "*?[") else [str(p)]
        files = [f for f in files if os.path.isfile(f)]
    if not files:
        raise ConfigError(f"data.path={path!r}: no such file, or no data files in it "
                          f"(extensions read: {', '.join(sorted(BUILDERS))})")
    builders = {BUILDERS.get(Path(f).suffix) for f in files}
    if None in builders or len(builders) > 1:
        raise ConfigError(f"data.path={path!r}: the files must all be one of the kinds "
                          f"{', '.join(sorted(BUILDERS))}; found {sorted({Path(f).suffix for f in files})}")
    return builders.pop(), files


# The columns each data option reads: the config key that names each, with its value.
def columns_read(cfg: DataConfig) -> dict[str, str]:
    if cfg.name == "chat":
        return {"data.messages_field": cfg.messages_field}
    if cfg.name == "prompt_completion":
        return {"data.prompt_field": cfg.prompt_field, "data.completion_field": cfg.completion_field}
    return {"data.text_field": cfg.text_field}


def load_rows(cfg: DataConfig):
    """A `datasets.Dataset` with one document (text, conversation or prompt/completion) per row, and
    only the columns the data option reads (columns_read): the others may differ from row to row."""
    import datasets

    if cfg.name == "pydoc":
        from pydoc_data.topics import topics

        return datasets.Dataset.from_dict({cfg.text_field: [topics[k] for k in sorted(topics)]})
    builder, files = data_files(cfg.path)
    for file in files:
        if os.path.getsize(file) == 0:
            raise ConfigError(f"data.path={cfg.path!r}: {file} is empty; remove it or fill it")
    columns = columns_read(cfg)
    if builder == "json":
        return read_json_rows(cfg.path, files, columns)
    if builder != "text":
        for file in files:
            try:
                header = file_columns(builder, file)
            except UNREADABLE as err:
                raise ConfigError(f"data.path={cfg.path!r}: {file} cannot be read as {builder} "
                                  f"({root_cause(err)}); fix or remove that file") from None
            for key, column in columns.items():
                if column not in header:
                    raise ConfigError(f"{key}={column!r} is not a column of {file}: its columns are "
                                      f"{header}; set {key}=ONE_OF_THEM")
    try:
        ds = read_files(builder, files, sorted(set(columns.values())))
    except UNREADABLE as together:  # find the file to name, reading each alone: only on this error path
        for file in files:
            try:
                read_files(builder, [file], sorted(set(columns.values())))
            except UNREADABLE as err:
                raise ConfigError(f"data.path={cfg.path!r}: {file} cannot be read as {builder} "
                                  f"({root_cause(err)}); fix or remove that file") from None
        raise ConfigError(f"data.path={cfg.path!r}: each file reads alone but not together ({root_cause(together)}): "
                          f"the column(s) {sorted(set(columns.values()))} hold different types in different "
                          "files; give them one type") from None
    for key, column in columns.items():
        if column not in ds.column_names:
            raise ConfigError(f"{key}={column!r} is not a column of {cfg.path}: its columns are "
                              f"{ds.column_names}; set {key}=ONE_OF_THEM")
    return ds


# What `datasets` raises for a file that is not what its extension says: DatasetGenerationError
# (wrapping e.g. UnicodeDecodeError, made a ValueError by read_files), pyarrow's ArrowInvalid (a
# ValueError), StopIteration (json with no rows); OSError for a file it may not open.
UNREADABLE = (ValueError, StopIteration, OSError)


def read_files(builder: str, files: list[str], columns: list[str]):
    """csv, parquet and text files through `datasets` (cached by it), csv and parquet reading only `columns`."""
    import datasets
    from datasets.exceptions import DatasetGenerationError

    extra = {"text": {"sample_by": "document"}, "csv": {"usecols": columns},
             "parquet": {"columns": columns}}.get(builder, {})
    datasets_log = logging.getLogger("datasets")
    level = datasets_log.level
    datasets_log.setLevel(logging.CRITICAL)  # it logs each failure at ERROR; load_rows says it once
    try:
        return datasets.load_dataset(builder, data_files=files, split="train", **extra)
    except DatasetGenerationError as err:
        raise ValueError(root_cause(err)) from err
    finally:
        datasets_log.setLevel(level)


def file_columns(builder: str, file: str) -> list[str]:
    """The column names of a csv or parquet file, from its header or schema."""
    if builder == "parquet":
        import pyarrow.parquet as pq

        return pq.read_schema(file).names
    import csv

    with open(file, newline="", encoding="utf-8") as f:
        return next(csv.reader(f), [])


JSON_ROWS_FORMAT = 1  # the cache below is keyed by this: change it when what read_json_rows stores changes


def read_json_rows(path: str, files: list[str], columns: dict[str, str]):
    """json and jsonl rows, keeping only the read columns: `datasets`' json builder infers every
    column's type from the first 10 MB and refuses later rows or files whose other fields differ.
    Each read column's values are checked here, where the file and line are known; the columns are
    cached as one Arrow file (memory-mapped), keyed by the files' paths, sizes and times."""
    import datasets

    features = datasets.Features({column: datasets.Json() if key == "data.messages_field" else datasets.Value("string")
                                  for key, column in columns.items()})
    stamps = [(os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files]
    key = hashlib.sha256(json.dumps([JSON_ROWS_FORMAT, stamps, features.to_dict()]).encode()).hexdigest()[:32]
    cached = Path(datasets.config.HF_DATASETS_CACHE) / "trainloop_json_rows" / f"{key}.arrow"
    if not cached.exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial_file = cached.with_name(f"{cached.stem}.{os.getpid()}.tmp")
        try:
            write_json_rows(path, files, columns, features, str(partial_file))
            os.replace(partial_file, cached)
        finally:
            partial_file.unlink(missing_ok=True)
    return datasets.Dataset.from_file(str(cached))


def write_json_rows(path: str, files: list[str], columns: dict[str, str], features, out: str) -> None:
    from datasets.arrow_writer import ArrowWriter

    names = list(features)
    batch = {column: [] for column in names}
    found, first_keys = set(), None
    with ArrowWriter(features=features, path=out) as writer:
        for file in files:
            for place, row in json_records(path, file):
                first_keys = first_keys or list(row)
                found.update(column for column in names if column in row)
                for key, column in columns.items():
                    value = row.get(column)
                    if key == "data.messages_field":
                        value = None if value is None else json.dumps(value)  # Json keeps it as it is
                    elif value is not None and not isinstance(value, str):
                        raise ConfigError(f"{place}: {key}={column!r} holds {json_kind(value)}, not text; "
                                          "fix or remove that row")
                    batch[column].append(value)
                if len(batch[names[0]]) == 10_000:
                    writer.write_batch(batch)
                    batch = {column: [] for column in names}
        if first_keys is None:
            raise ConfigError(f"data.path={path!r} holds no rows: its json files have only blank lines or empty arrays")
        for key, column in columns.items():
            if column not in found:
                raise ConfigError(f"{key}={column!r} is not a column of {path}: its columns are "
                                  f"{first_keys}; set {key}=ONE_OF_THEM")
        if batch[names[0]]:
            writer.write_batch(batch)
        writer.finalize()


def json_kind(value) -> str:
    return {str: "text", bool: "true or false", int: "a number", float: "a number", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def json_records(path: str, file: str):
    """(FILE:LINE, row) for each row of a json file: one object per line (JSON lines), or an array of
    objects (the line is where the object starts). Blank lines are no rows."""
    def unreadable(err: BaseException) -> ConfigError:
        return ConfigError(f"data.path={path!r}: {file} cannot be read as json ({root_cause(err)}); "
                           "fix or remove that file")

    def row(value, line: int):
        if not isinstance(value, dict):
            raise ConfigError(f"{file}:{line}: a row is an object of named fields, and this is {json_kind(value)}")
        return f"{file}:{line}", value

    try:
        with open(file, encoding="utf-8-sig") as f:
            start = f.read(4096).lstrip()[:1]
            f.seek(0)
            if start == "[":
                text = f.read()
            else:
                for line, text in enumerate(f, 1):
                    if text.strip():
                        try:
                            value = json.loads(text)
                        except ValueError as err:
                            raise ConfigError(f"{file}:{line} is not valid JSON ({err}): a json file holds one "
                                              "row object per line, or one array of them") from None
                        yield row(value, line)
                return
    except UnicodeDecodeError as err:
        raise unreadable(err) from None
    decoder = json.JSONDecoder()
    at = text.index("[") + 1
    line = 1 + text.count("\n", 0, at)
    while True:
        start = at
        while at < len(text) and text[at] in " \t\r\n,":  # the commas between objects, leniently
            at += 1
        line += text.count("\n", start, at)
        if at == len(text):
            raise unreadable(ValueError("the array has no closing ]"))
        if text[at] == "]":
            return
        try:
            value, end = decoder.raw_decode(text, at)
        except ValueError as err:
            raise ConfigError(f"{file}:{line} is not valid JSON ({err})") from None
        yield row(value, line)
        line += text.count("\n", at, end)
        at = end


def row_place(cfg: DataConfig, r: int) -> str:
    """Where row r (0-based, over all files in order) of load_rows' dataset comes from: FILE:LINE,
    1-based (FILE row K for parquet). Reads the files again: for messages only."""
    if cfg.name == "pydoc":
        return f"pydoc topic {r + 1}"
    builder, files = data_files(cfg.path)
    for file in files:
        for place in file_places(cfg.path, builder, file):
            if r == 0:
                return place
            r -= 1
    raise IndexError(r)


def file_places(path: str, builder: str, file: str):
    if builder == "json":
        yield from (place for place, _ in json_records(path, file))
    elif builder == "csv":
        import csv

        with open(file, newline="", encoding="utf-8") as f:
            reader, line = csv.reader(f), 0
            for row in reader:  # the header first; a row may span lines (quoted newlines)
                if row and line:
                    yield f"{file}:{line + 1}"
                line = reader.line_num
    elif builder == "parquet":
        import pyarrow.parquet as pq

        yield from (f"{file} row {k + 1}" for k in range(pq.ParquetFile(file).metadata.num_rows))
    else:
        yield file


def root_cause(err: BaseException) -> str:
    """The innermost exception of a chain, in one short line."""
    while err.__cause__ or err.__context__:
        err = err.__cause__ or err.__context__
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {text[:200]}" if text else type(err).__name__


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


ROLES = ("system", "user", "assistant", "tool")

# For tokenizers without a chat template (the built-in byte-level one included): each message
# is a role line, its content and the end-of-text token, so a reply ends where the model learns to stop.
BUILTIN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class PackedBlocks(Dataset):
    """Training blocks: rows of [num_blocks, seq_len] tensors, one dict of them per block.

    labels are the input ids with IGNORE where no loss is taken; position_ids restart at 0 at
    each packed row (the model then keeps attention inside the row); attention_mask only for
    data.packing=none, where rows are padded on the right.
    """

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None):
        if labels is None:
            labels = input_ids
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        self.tensors = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
        if attention_mask is not None:
            self.tensors["attention_mask"] = attention_mask

    @property
    def blocks(self) -> torch.Tensor:
        return self.tensors["input_ids"]

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {key: tensor[i] for key, tensor in self.tensors.items()}


def chat_template(cfg: DataConfig, tokenizer) -> str:
    """data.chat_template if given, else the tokenizer's own, else the built-in one."""
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
    log.info("the tokenizer has no chat template: using trainloop's built-in one (data.chat_template=FILE to choose)")
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


def trained_chat_template(cfg: DataConfig, tokenizer) -> str | None:
    """The chat template the run's rows are rendered with, which final/'s tokenizer must carry so
    the model is prompted as it was trained: data=chat's (chat_template), or the one prepared chat
    shards were made with (their manifests). None for text data."""
    if cfg.name == "chat":
        return chat_template(cfg, tokenizer)
    if cfg.name != "prepared":
        return None
    from trainloop.shards import read_manifest

    paths = [source.path for source in cfg.sources] if cfg.sources else [cfg.path]
    templates = {read_manifest(path).get("chat_template") for path in paths} - {None}
    if len(templates) > 1:
        log.warning("the prepared sources were rendered with %d different chat templates: final/ keeps "
                    "the tokenizer's own", len(templates))
    return templates.pop() if len(templates) == 1 else None


def carry_chat_template(tokenizer, template: str | None) -> None:
    """Make `template` the tokenizer's default chat template (its save_pretrained writes it)."""
    if template is None:
        return
    if isinstance(tokenizer.chat_template, dict):  # named templates: the others are kept
        tokenizer.chat_template = {**tokenizer.chat_template, "default": template}
    else:
        tokenizer.chat_template = template


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
    """The conversations to train on, by the rules README's data=chat section lists: a row that
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
            raise ConfigError(f"{row_place(cfg, r)}: data.messages_field={field!r} {problem}; fix or remove that row")
        if template is not None:
            try:  # a template's own rule (e.g. raise_exception on roles that do not alternate) refuses the row
                tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
            except Exception as err:  # noqa: BLE001 - whatever a template raises, name the row
                raise ConfigError(f"{row_place(cfg, r)}: the chat template cannot render this conversation "
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


def row_tokenizer(cfg: DataConfig, tokenizer):
    """A `datasets.map` function: a batch of rows -> their input_ids, and labels (IGNORE where no loss)
    unless every token is a target."""
    eos = tokenizer.eos_token_id
    encode = lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]  # noqa: E731

    if cfg.name == "chat":
        template = chat_template(cfg, tokenizer)

        def tokenize(batch):
            pairs = [chat_tokens(m, tokenizer, template, cfg.train_on) for m in batch[cfg.messages_field]]
            return ragged_table(input_ids=[p[0] for p in pairs], labels=[p[1] for p in pairs])
    elif cfg.name == "prompt_completion":
        def tokenize(batch):
            prompts = encode(batch[cfg.prompt_field])
            completions = [c + [eos] for c in encode(batch[cfg.completion_field])]
            hide = cfg.train_on == "completion"
            return ragged_table(input_ids=[p + c for p, c in zip(prompts, completions)],
                                labels=[([IGNORE] * len(p) if hide else p) + c for p, c in zip(prompts, completions)])
    else:
        def tokenize(batch):  # every token a target: no labels column
            return ragged_table(input_ids=[x + [eos] for x in encode(batch[cfg.text_field])])
    return tokenize


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


def load_examples(cfg: DataConfig, tokenizer=None):
    """The rows, checked: text rows without text skipped; conversations kept, skipped or refused by
    the data=chat rules (the template's own among them when the tokenizer is given); prompt/completion
    pairs validated."""
    rows = load_rows(cfg)
    if cfg.name in ("pydoc", "files"):
        return drop_rows_without_text(rows, cfg.text_field, cfg.num_proc)
    if cfg.name == "chat":
        return usable_conversations(rows, cfg, tokenizer)
    for key, column in columns_read(cfg).items():
        missing = [r for r, value in enumerate(rows[column]) if not isinstance(value, str)]
        if missing:
            raise ConfigError(f"{row_place(cfg, missing[0])}: {key}={column!r} has no text there (nor in "
                              f"{len(missing) - 1} more rows); fix or remove those rows")
    return rows


def build_datasets(cfg: DataConfig, tokenizer, seed: int):
    """Tokenize (cached by `datasets` for files) and label; hold whole documents out for validation
    (data.validation_fraction, drawn from the seed); fit to data.seq_len and pack as data.packing says.

    The blocks are planned and gathered by trainloop.packing, the code that serves prepared shards
    (data=prepared: memory-mapped, gathered block by block), so both give the same blocks.
    """
    from trainloop.packing import Documents, part_from_batches, plan_blocks, split_documents, token_batches

    if cfg.name == "prepared":
        from trainloop.shards import open_prepared

        return open_prepared(cfg, tokenizer)
    tokens = tokenize_examples(cfg, tokenizer, load_examples(cfg, tokenizer))
    documents = Documents([part_from_batches(token_batches(tokens), masked=cfg.name in MASKED)])
    held_out = split_documents(len(documents), cfg.validation_fraction, seed)
    train, valid = plan_blocks(cfg, documents, held_out, pad_id(tokenizer))
    return materialize(train), materialize(valid)


MASKED = ("chat", "prompt_completion")  # the data options whose labels hide some tokens


def tokenize_examples(cfg: DataConfig, tokenizer, examples, desc: str = "tokenize"):
    """input_ids and labels for each row, by `datasets.map` over data.num_proc processes."""
    return examples.map(row_tokenizer(cfg, tokenizer), batched=True, remove_columns=examples.column_names,
                        num_proc=cfg.num_proc, desc=desc)


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def materialize(blocks) -> PackedBlocks:
    """Planned blocks gathered into tensors: data the run tokenized itself fits in memory."""
    items = [blocks[b] for b in range(len(blocks))]
    return PackedBlocks(**{key: torch.stack([item[key] for item in items]) for key in items[0]})


def vocabulary_fingerprint(tokenizer) -> str:
    """The tokenizer's vocabulary, hashed: what a run's resume check and prepared shards compare."""
    vocab = tokenizer.get_vocab()
    vocab_hash = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()
    return f"{len(vocab)} tokens, sha256 {vocab_hash[:16]}"


def data_fingerprint(tokenizer, train, valid) -> dict:
    """What identifies the data a run trains on, for the resume check: the tokenizer's vocabulary
    and the packed blocks themselves (ids, labels, positions). Hashing the tokens is exact (any
    change of files, fields, template, tokenizer, packing or split shows) and cheap next to tokenizing them.
    Prepared shards are not read whole for it: their manifest's content hashes and the packing stand in."""
    if not isinstance(train, PackedBlocks):
        from trainloop.shards import prepared_fingerprint

        return {"tokenizer vocabulary": vocabulary_fingerprint(tokenizer), **prepared_fingerprint(train, valid)}
    blocks_hash = hashlib.sha256()
    for part in (train, valid):
        for key in sorted(part.tensors):
            blocks_hash.update(part.tensors[key].contiguous().numpy())
    return {"tokenizer vocabulary": vocabulary_fingerprint(tokenizer),
            "data content": f"{len(train)} train + {len(valid)} valid blocks of {train.blocks.shape[1]} "
                            f"tokens, sha256 {blocks_hash.hexdigest()[:16]}"}


def worker_context(method: str):
    """Where DataLoader workers start from (data.multiprocessing_context).

    forkserver, the default: each worker is forked from a small server process that started
    clean, not from the training process, which by then runs other threads (gloo or NCCL, OpenMP,
    CUDA) whose locks a forked child can inherit held and wait on forever (the reason Python 3.14
    made forkserver the default on Linux). The server imports torch and this module once, so a
    worker still starts in a fraction of a second; the datasets reach it through shared memory.
    """
    import multiprocessing

    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(["torch", __name__])
    return context


def build_dataloaders(cfg: DataConfig, train: Dataset, valid: Dataset, pin_memory: bool, order=None):
    """Shuffled, full-batch training loader and an ordered validation loader.

    A run passes `order`, a trainloop.order.GlobalOrder: this rank's share of one global order, a
    function of (seed, epoch) alone; the run does not let accelerate shard that loader again.
    """
    if len(train) < cfg.batch_size:
        raise ConfigError(f"data.batch_size={cfg.batch_size} is larger than the "
                          f"{len(train)} training blocks; lower it or add data")
    # Workers leave SIGTERM/Ctrl-C to the main process, which saves a checkpoint and stops them,
    # and end as soon as it ends, however it ends (trainloop.lifetime).
    workers = dict(num_workers=cfg.num_workers, pin_memory=pin_memory,
                   worker_init_fn=partial(start_loader_worker, os.getpid()),
                   persistent_workers=cfg.persistent_workers, prefetch_factor=cfg.prefetch_factor)
    if cfg.num_workers:
        workers["multiprocessing_context"] = worker_context(cfg.multiprocessing_context)
    if order is None:
        train_loader = DataLoader(train, batch_size=cfg.batch_size, shuffle=True, drop_last=True, **workers)
    else:
        train_loader = DataLoader(train, batch_sampler=order, **workers)
    valid_loader = DataLoader(valid, batch_size=cfg.batch_size, shuffle=False, **workers)
    return train_loader, valid_loader


def check_batch_fits(cfg, world_size: int, train_blocks: int) -> None:
    """An epoch holds whole global batches only (trainloop.order); with fewer blocks than one, none."""
    needed = cfg.data.batch_size * cfg.trainer.gradient_accumulation_steps * world_size
    if train_blocks < needed:
        raise ConfigError(
            f"data.batch_size={cfg.data.batch_size} x {world_size} processes needs {needed} training blocks "
            f"per step (with trainer.gradient_accumulation_steps={cfg.trainer.gradient_accumulation_steps}), "
            f"but the data holds {train_blocks}: lower data.batch_size or "
            "trainer.gradient_accumulation_steps, use fewer processes, or add data"
        )
