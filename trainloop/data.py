"""Text in, packed token blocks out: the tokenizer, the datasets and their DataLoaders."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from itertools import chain
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from trainloop.preemption import ignore_stop_signals
from trainloop.config import ConfigError, DataConfig

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


def load_texts(cfg: DataConfig):
    """A `datasets.Dataset` with one document per row in column cfg.text_field."""
    import datasets

    if cfg.name == "pydoc":
        from pydoc_data.topics import topics

        return datasets.Dataset.from_dict({cfg.text_field: [topics[k] for k in sorted(topics)]})
    builder, files = data_files(cfg.path)
    for file in files:
        if os.path.getsize(file) == 0:
            raise ConfigError(f"data.path={cfg.path!r}: {file} is empty; remove it or fill it")
    try:
        ds = read_files(builder, files)
    except UNREADABLE:  # find the file to name, reading each alone: only on this error path
        for file in files:
            try:
                read_files(builder, [file])
            except UNREADABLE as err:
                raise ConfigError(f"data.path={cfg.path!r}: {file} cannot be read as {builder} "
                                  f"({root_cause(err)}); fix or remove that file") from None
        raise
    if cfg.text_field not in ds.column_names:
        raise ConfigError(f"data.text_field={cfg.text_field!r} is not a column of {cfg.path}: "
                          f"its columns are {ds.column_names}; set data.text_field=ONE_OF_THEM")
    return ds


# What `datasets` raises for a file that is not what its extension says: DatasetGenerationError
# (wrapping e.g. UnicodeDecodeError, made a ValueError by read_files), pyarrow's ArrowInvalid (a
# ValueError), StopIteration (json with no rows); OSError for a file it may not open.
UNREADABLE = (ValueError, StopIteration, OSError)


def read_files(builder: str, files: list[str]):
    import datasets
    from datasets.exceptions import DatasetGenerationError

    extra = {"sample_by": "document"} if builder == "text" else {}
    datasets_log = logging.getLogger("datasets")
    level = datasets_log.level
    datasets_log.setLevel(logging.CRITICAL)  # it logs each failure at ERROR; load_texts says it once
    try:
        return datasets.load_dataset(builder, data_files=files, split="train", **extra)
    except DatasetGenerationError as err:
        raise ValueError(root_cause(err)) from err
    finally:
        datasets_log.setLevel(level)


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


class PackedBlocks(Dataset):
    """Rows of a [num_blocks, seq_len] LongTensor: each row is both input and label."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.blocks[i]


def build_datasets(cfg: DataConfig, tokenizer, seed: int) -> tuple[PackedBlocks, PackedBlocks]:
    """Tokenize (cached by `datasets` for files), append EOS per document, pack, split."""
    texts = drop_rows_without_text(load_texts(cfg), cfg.text_field, cfg.num_proc)
    field, eos, seq_len = cfg.text_field, tokenizer.eos_token_id, cfg.seq_len

    def tokenize(batch):
        ids = tokenizer(batch[field], add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + [eos] for x in ids]}

    def pack(batch):
        stream = list(chain.from_iterable(batch["input_ids"]))
        usable = len(stream) // seq_len * seq_len
        return {"input_ids": [stream[i:i + seq_len] for i in range(0, usable, seq_len)]}

    tokens = texts.map(tokenize, batched=True, remove_columns=texts.column_names,
                       num_proc=cfg.num_proc, desc="tokenize")
    packed = tokens.map(pack, batched=True, batch_size=10_000, num_proc=cfg.num_proc, desc="pack")
    if len(packed) < 2:
        raise ConfigError(f"the data holds {len(packed)} block(s) of data.seq_len={seq_len} tokens: "
                          "too little to train and validate; add data or lower data.seq_len")
    split = packed.train_test_split(test_size=cfg.validation_fraction, seed=seed)
    as_tensor = lambda d: PackedBlocks(torch.tensor(d["input_ids"], dtype=torch.long))  # noqa: E731
    return as_tensor(split["train"]), as_tensor(split["test"])


def data_fingerprint(tokenizer, train: PackedBlocks, valid: PackedBlocks) -> dict:
    """What identifies the data a run trains on, for the resume check: the tokenizer's vocabulary
    and the packed blocks themselves. Hashing the tokens is exact (any change of files, text
    field, tokenizer, packing or split shows) and cheap next to tokenizing them."""
    vocab = tokenizer.get_vocab()
    vocab_hash = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()
    blocks_hash = hashlib.sha256()
    for part in (train.blocks, valid.blocks):
        blocks_hash.update(part.contiguous().numpy())
    return {"tokenizer vocabulary": f"{len(vocab)} tokens, sha256 {vocab_hash[:16]}",
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


def build_dataloaders(cfg: DataConfig, train: Dataset, valid: Dataset, pin_memory: bool):
    """Shuffled, full-batch training loader and an ordered validation loader.

    Accelerate swaps the shuffling sampler for a seedable one (see accelerator.py), so the
    order is a function of (seed, epoch) on every rank and after every resume.
    """
    if len(train) < cfg.batch_size:
        raise ConfigError(f"data.batch_size={cfg.batch_size} is larger than the "
                          f"{len(train)} training blocks; lower it or add data")
    # Workers leave SIGTERM/Ctrl-C to the main process, which saves a checkpoint and stops them.
    workers = dict(num_workers=cfg.num_workers, pin_memory=pin_memory, worker_init_fn=ignore_stop_signals,
                   persistent_workers=cfg.persistent_workers, prefetch_factor=cfg.prefetch_factor)
    if cfg.num_workers:
        workers["multiprocessing_context"] = worker_context(cfg.multiprocessing_context)
    train_loader = DataLoader(train, batch_size=cfg.batch_size, shuffle=True, drop_last=True, **workers)
    valid_loader = DataLoader(valid, batch_size=cfg.batch_size, shuffle=False, **workers)
    return train_loader, valid_loader


def check_batch_fits(cfg, world_size: int, train_blocks: int) -> None:
    """Every rank needs a full micro-batch each step; with fewer blocks the loop would get none."""
    needed = cfg.data.batch_size * world_size
    if train_blocks < needed:
        raise ConfigError(
            f"data.batch_size={cfg.data.batch_size} x {world_size} processes needs {needed} training "
            f"blocks per step, but the data holds {train_blocks}: lower data.batch_size, use fewer "
            "processes, or add data"
        )
