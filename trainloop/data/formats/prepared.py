"""data=prepared: token shards written by `python -m trainloop.prepare` (trainloop/data/shards.py, which
describes the layout), memory-mapped; the tokens, labels and validation split are the prepared ones,
data.seq_len, data.packing and data.overlong are chosen when training."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from trainloop.config.sections import DataConfig
from trainloop.data.formats.base import TOKENIZING, DataFormat
from trainloop.data.tokenizer import pad_id, tokenizer_record
from trainloop.errors import ConfigError

if TYPE_CHECKING:  # the table is read by config checks, which must not load numpy and torch
    from trainloop.data.packing import PlannedBlocks

log = logging.getLogger("trainloop")

FORMAT = 1  # of the prepared folders this reads (and trainloop.data.shards writes)


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def read_manifest(path: str) -> dict:
    manifest = read_json(Path(path).expanduser() / "manifest.json")
    if manifest is None:
        raise ConfigError(f"data.path={path!r} holds no manifest.json: prepare it with `python -m trainloop.prepare "
                          f"{path} ...` (run it again to finish an interrupted one)")
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"data.path={path!r} was prepared in format {manifest.get('format')}, this trainloop "
                          f"reads format {FORMAT}: prepare it again")
    return manifest


def check_tokenizer(path: str, manifest: dict, tokenizer) -> None:
    theirs, ours = manifest["tokenizer"], tokenizer_record(tokenizer)
    if theirs["vocabulary"] != ours["vocabulary"]:
        raise ConfigError(f"data.path={path!r} was prepared with tokenizer {theirs['source']} "
                          f"({theirs['vocabulary']}), but this run's tokenizer is {ours['source']} ({ours['vocabulary']}): set data.tokenizer "
                          "(or model.name_or_path) to the one the shards were made with, or prepare again")


def open_prepared(data_cfg, tokenizer) -> tuple[PlannedBlocks, PlannedBlocks]:
    """Train and validation blocks over memory-mapped shards: only the plan is in memory."""
    import numpy as np

    from trainloop.data.packing import Documents, Part, plan_blocks

    folder = Path(data_cfg.path).expanduser()
    manifest = read_manifest(data_cfg.path)
    check_tokenizer(data_cfg.path, manifest, tokenizer)
    documents = Documents([Part(folder=str(folder / s["name"]), masked=manifest["masked"]) for s in manifest["shards"]])
    held_out = np.load(folder / "validation.npy")
    train, valid = plan_blocks(data_cfg, documents, held_out, pad_id(tokenizer))
    for part in (train, valid):
        part.source = f"prepared shards sha256 {manifest['sha256'][:16]}"
    return train, valid


def prepared_fingerprint(train: PlannedBlocks, valid: PlannedBlocks) -> dict:
    """The resume check's view of prepared data: the manifest's content hash and how it is packed,
    so no token is read for it."""
    packing = f"packing={train.packing}" + (f", overlong={train.overlong}" if train.packing != "stream" else "")
    return {"data content": f"{len(train)} train + {len(valid)} valid blocks of {train.seq_len} tokens "
                            f"({packing}) from {train.source}"}


class Prepared(DataFormat):
    name = "prepared"
    train_on = ("all", "assistant", "completion")  # what the shards were prepared with
    loads_rows = False
    path = "a folder written by python -m trainloop.prepare"

    def unread_hint(self, key: str) -> str:
        return "give it to python -m trainloop.prepare" if key in TOKENIZING else ""

    def build(self, cfg: DataConfig, tokenizer, seed: int):
        return open_prepared(cfg, tokenizer)

    def chat_template(self, cfg: DataConfig, tokenizer) -> str | None:
        """The one the shards were made with (their manifests)."""
        paths = [source.path for source in cfg.sources] if cfg.sources else [cfg.path]
        templates = {read_manifest(path).get("chat_template") for path in paths} - {None}
        if len(templates) > 1:
            log.warning("the prepared sources were rendered with %d different chat templates: final/ keeps "
                        "the tokenizer's own", len(templates))
        return templates.pop() if len(templates) == 1 else None
