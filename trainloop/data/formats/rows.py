"""Rows from data files (text, json, jsonl, csv, parquet): what every format that reads data.path reads
them with. Only the columns a format reads (its fields) are read: the others may differ from row to
row, and a row or file that is wrong is refused naming its file and line, never with a traceback.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from pathlib import Path

from trainloop.errors import ConfigError

BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
            ".csv": "csv", ".parquet": "parquet"}


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


def read_rows(path: str, columns: dict[str, str], json_keys=(), optional=()):
    """A `datasets.Dataset` with one row per record of the files of data.path, and only `columns`
    ({config key: column}); the columns of `json_keys` hold any JSON value (a conversation), the
    others text. A column of `optional` (config keys) that no file has is no error: json rows hold
    null there, other files' rows leave the column out."""
    builder, files = data_files(path)
    for file in files:
        if os.path.getsize(file) == 0:
            raise ConfigError(f"data.path={path!r}: {file} is empty; remove it or fill it")
    if builder == "json":
        return read_json_rows(path, files, columns, json_keys, optional)
    if builder != "text":
        headers = {}
        for file in files:
            try:
                headers[file] = file_columns(builder, file)
            except UNREADABLE as err:
                raise ConfigError(f"data.path={path!r}: {file} cannot be read as {builder} "
                                  f"({root_cause(err)}); fix or remove that file") from None
        columns = {key: column for key, column in columns.items()
                   if key not in optional or any(column in header for header in headers.values())}
        for file, header in headers.items():
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
                raise ConfigError(f"data.path={path!r}: {file} cannot be read as {builder} "
                                  f"({root_cause(err)}); fix or remove that file") from None
        raise ConfigError(f"data.path={path!r}: each file reads alone but not together ({root_cause(together)}): "
                          f"the column(s) {sorted(set(columns.values()))} hold different types in different "
                          "files; give them one type") from None
    for key, column in columns.items():
        if column not in ds.column_names:
            raise ConfigError(f"{key}={column!r} is not a column of {path}: its columns are "
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
    datasets_log.setLevel(logging.CRITICAL)  # it logs each failure at ERROR; read_rows says it once
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


def read_json_rows(path: str, files: list[str], columns: dict[str, str], json_keys=(), optional=()):
    """json and jsonl rows, keeping only the read columns: `datasets`' json builder infers every
    column's type from the first 10 MB and refuses later rows or files whose other fields differ.
    Each read column's values are checked here, where the file and line are known; the columns are
    cached as one Arrow file (memory-mapped), keyed by the files' paths, sizes and times."""
    import datasets

    features = datasets.Features({column: datasets.Json() if key in json_keys else datasets.Value("string")
                                  for key, column in columns.items()})
    stamps = [(os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files]
    key = hashlib.sha256(json.dumps([JSON_ROWS_FORMAT, stamps, features.to_dict()]).encode()).hexdigest()[:32]
    cached = Path(datasets.config.HF_DATASETS_CACHE) / "trainloop_json_rows" / f"{key}.arrow"
    if not cached.exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial_file = cached.with_name(f"{cached.stem}.{os.getpid()}.tmp")
        try:
            write_json_rows(path, files, columns, json_keys, features, str(partial_file), optional)
            os.replace(partial_file, cached)
        finally:
            partial_file.unlink(missing_ok=True)
    return datasets.Dataset.from_file(str(cached))


def write_json_rows(path: str, files: list[str], columns: dict[str, str], json_keys, features,
                    out: str, optional=()) -> None:
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
                    if key in json_keys:
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
            if column not in found and key not in optional:
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


def row_place(path: str, r: int) -> str:
    """Where row r (0-based, over all files in order) of read_rows' dataset comes from: FILE:LINE,
    1-based (FILE row K for parquet). Reads the files again: for messages only."""
    builder, files = data_files(path)
    for file in files:
        for place in file_places(path, builder, file):
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


def struct_columns_as_json(rows, columns):
    """`rows` with those of `columns` that `datasets` read as structs (parquet's lists of objects) made
    JSON values again. A struct has the keys of every row, null where a row lacks one (one tool's
    schema would list the other tools' parameters as null, one call the other calls' arguments):
    those nulls are dropped, so a null that means something is kept only in a JSON string (or json
    rows). Text and JSON columns are left as they are."""
    import datasets

    structs = [c for c in columns if c in rows.column_names
               and not isinstance(rows.features[c], (datasets.Json, datasets.Value))]
    if not structs:
        return rows

    def without_nulls(value):
        if isinstance(value, dict):
            return {key: without_nulls(item) for key, item in value.items() if item is not None}
        return [without_nulls(item) for item in value] if isinstance(value, list) else value

    features = rows.features.copy()
    features.update({column: datasets.Json() for column in structs})
    return rows.map(lambda batch: {c: [without_nulls(v) for v in batch[c]] for c in structs}, batched=True,
                    features=features, desc="read objects")
