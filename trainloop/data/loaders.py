"""Text in, packed token blocks out: the datasets of the data format data.name names
(trainloop.data.formats), the tokenizer's chat template they were rendered with, and their DataLoaders."""

from __future__ import annotations

import hashlib
import os
from functools import partial

from torch.utils.data import DataLoader, Dataset, default_collate

from trainloop.config.sections import DataConfig
from trainloop.data.formats import data_format
from trainloop.data.formats.prepared import prepared_fingerprint
from trainloop.data.order import ValidationOrder
from trainloop.data.sets import PackedBlocks, restarting
from trainloop.data.tokenizer import build_tokenizer, byte_level_tokenizer, vocabulary_fingerprint
from trainloop.errors import ConfigError
from trainloop.lifetime import start_loader_worker
from trainloop.model.attention import documents_of

__all__ = ["PackedBlocks", "build_dataloaders", "build_datasets", "build_tokenizer", "byte_level_tokenizer",
           "carry_chat_template", "check_batch_fits", "data_fingerprint", "load_examples", "run_tokenizer",
           "tokenize_examples", "trained_chat_template", "worker_context"]


def run_tokenizer(cfg):
    """The tokenizer a run reads its data with: data.tokenizer's, the pretrained model's or the built-in bytes
    (build_tokenizer), or, where the data carries images (data=vision_chat), the vision-language model's processor's
    around it (trainloop.model.vision.vision_processor: the image token added, or model=hf's own), from which
    processor_of finds the processor."""
    from trainloop.model.vision import vision_processor

    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.model.name_or_path)
    return vision_processor(cfg.model, tokenizer).tokenizer if data_format(cfg.data.name).images else tokenizer


def load_examples(cfg: DataConfig, tokenizer=None):
    """The rows, checked by the format's rules: text rows without text skipped; conversations kept,
    skipped or refused by the data=chat rules (the template's own among them when the tokenizer is
    given); prompt/completion pairs validated."""
    return data_format(cfg.name).load(cfg, tokenizer)


def tokenize_examples(cfg: DataConfig, tokenizer, examples, desc: str = "tokenize"):
    """input_ids and labels for each row, by `datasets.map` over data.num_proc processes."""
    return data_format(cfg.name).tokenize(cfg, tokenizer, examples, desc)


def build_datasets(cfg: DataConfig, tokenizer, seed: int, tools: list[dict] | None = None):
    """The train and validation blocks of data.path (or the built-in corpus), as its format builds
    them: tokenized by the run and packed (DataFormat.build), or prepared shards memory-mapped.
    `tools`: the JSON schemas of the tools the objective lets the model call, which data=prompts
    renders into its conversations (None for every other objective and format)."""
    if tools:
        return data_format(cfg.name).build(cfg, tokenizer, seed, tools=tools)
    return data_format(cfg.name).build(cfg, tokenizer, seed)


def trained_chat_template(cfg: DataConfig, tokenizer) -> str | None:
    """The chat template the run's rows are rendered with, which final/'s tokenizer must carry so
    the model is prompted as it was trained: data=chat's (chat_template), or the one prepared chat
    shards were made with (their manifests). None for text data."""
    return data_format(cfg.name).chat_template(cfg, tokenizer)


def carry_chat_template(tokenizer, template: str | None) -> None:
    """Make `template` the tokenizer's default chat template (its save_pretrained writes it)."""
    if template is None:
        return
    if isinstance(tokenizer.chat_template, dict):  # named templates: the others are kept
        tokenizer.chat_template = {**tokenizer.chat_template, "default": template}
    else:
        tokenizer.chat_template = template


def data_fingerprint(tokenizer, train, valid) -> dict:
    """What identifies the data a run trains on, for the resume check: the tokenizer's vocabulary
    and the packed blocks themselves (ids, labels, positions). Hashing the tokens is exact (any
    change of files, fields, template, tokenizer, packing or split shows) and cheap next to tokenizing them.
    Prepared shards are not read whole for it: their manifest's content hashes and the packing stand in."""
    if not isinstance(train, PackedBlocks):
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

    A run passes `order`, a trainloop.data.order.GlobalOrder: this rank's share of one global order, a
    function of (seed, epoch) alone; the run does not let accelerate shard that loader again. The
    validation loader reads this rank's share of the split in the same layout, each item by one
    rank (trainloop.data.order.ValidationOrder; one process without `order`).
    """
    batch_size = cfg.batch_size if order is None else order.batch_size  # the order's: a batch size settled by the run
    if len(train) < batch_size:
        raise ConfigError(f"data.batch_size={batch_size} is larger than the "
                          f"{len(train)} training blocks; lower it or add data")
    # Workers leave SIGTERM/Ctrl-C to the main process, which saves a checkpoint and stops them,
    # and end as soon as it ends, however it ends (trainloop.lifetime).
    workers = dict(num_workers=cfg.num_workers, pin_memory=pin_memory,
                   worker_init_fn=partial(start_loader_worker, os.getpid()),
                   persistent_workers=cfg.persistent_workers, prefetch_factor=cfg.prefetch_factor)
    if cfg.num_workers:
        workers["multiprocessing_context"] = worker_context(cfg.multiprocessing_context)
    workers["collate_fn"] = collate
    if order is None:
        train_loader = DataLoader(train, batch_size=cfg.batch_size, shuffle=True, drop_last=True, **workers)
    else:
        train_loader = DataLoader(train, batch_sampler=order, **workers)
    layout = (1, 1, 0) if order is None else (order.accumulation, order.world_size, order.rank)
    valid_loader = DataLoader(valid, batch_sampler=ValidationOrder(len(valid), batch_size, *layout), **workers)
    return train_loader, valid_loader


def collate(items: list[dict] | dict) -> dict:
    """torch's default collate, less the position ids of a batch whose every row counts 0..seq-1 (one
    sequence a row, which the model counts itself): position ids reach the model only where a row
    restarts them, as this CPU check decides, and with them each token's document (`documents`, made here
    on the host, where it stays: trainloop.model.attention attends by it). A batch PackedBlocks gathered
    whole (its __getitems__, which decides the same from each block's positions) passes as it is."""
    if isinstance(items, dict):
        return items
    batch = default_collate(items)
    positions = batch.get("position_ids") if isinstance(batch, dict) else None
    if positions is None:
        return batch
    if restarting(positions).any():
        batch["documents"] = documents_of(positions)
    else:
        del batch["position_ids"]
    return batch


def check_batch_fits(cfg, dp_size: int, train_blocks: int) -> None:
    """An epoch holds whole global batches only (trainloop.data.order); with fewer blocks than one, none.
    `dp_size`: the data-parallel processes (trainloop.parallel's strategy)."""
    needed = cfg.data.batch_size * cfg.trainer.gradient_accumulation_steps * dp_size
    if train_blocks < needed:
        raise ConfigError(
            f"data.batch_size={cfg.data.batch_size} x {dp_size} processes needs {needed} training blocks "
            f"per step (with trainer.gradient_accumulation_steps={cfg.trainer.gradient_accumulation_steps}), "
            f"but the data holds {train_blocks}: lower data.batch_size or "
            "trainer.gradient_accumulation_steps, use fewer processes, or add data"
        )
