"""Prepared token shards, written once by `python -m trainloop.prepare` (the reader is the data=prepared
row, trainloop/data/formats/prepared.py, memory-mapping them for runs).

A prepared folder holds:
  prepare.json     written first: the tokenizer, data options and shard size it is being prepared with,
                   so that a re-run (after an interruption) can check it continues the same work
  validation.npy   the documents held out for validation (numbers across the shards, sorted), drawn
                   from trainer.seed and data.validation_fraction as a run that tokenizes draws them
  shard_00000/     documents [0, n): ids.npy (uint16 when the vocabulary has at most 65,536 tokens,
                   else uint32), offsets.npy (int64, where each document starts, and the end),
                   mask.npy (chat and prompt_completion only: 1 byte per token, true for a target;
                   text data has no mask, every token is a target) and meta.json (counts, sha256)
  manifest.json    written last: the tokenizer's vocabulary hash, the data options that shaped the
                   tokens, counts per shard, the dtype, content hashes and the format version

Each shard is written under a temporary name and renamed when complete, so a re-run keeps the
finished shards and tokenizes only the rest. The shards hold documents, not blocks: data.seq_len,
data.packing and data.overlong are chosen when training.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np

from trainloop.data.formats import FORMATS, data_format
from trainloop.data.formats.prepared import FORMAT, read_json
from trainloop.data.packing import Part, part_from_batches, split_documents, token_batches
from trainloop.data.tokenizer import build_tokenizer, tokenizer_record
from trainloop.errors import ConfigError

log = logging.getLogger("trainloop")

SHARD_DOCUMENTS = 100_000  # rows per shard, by default: a unit of work an interruption loses at most


def token_options(cfg) -> dict:
    """The options that shape the tokens of each document, and the validation split."""
    d = cfg.data
    fmt = data_format(d.name)
    template = None
    if "data.chat_template" in fmt.reads() and d.chat_template:
        template = hashlib.sha256(Path(d.chat_template).expanduser().read_bytes()).hexdigest()[:16]
    return {"data.name": d.name, "data.path": os.path.abspath(os.path.expanduser(d.path)) if d.path else None,
            **fmt.columns(d), "data.train_on": d.train_on, "data.chat_template sha256": template,
            "trainer.seed": cfg.trainer.seed, "data.validation_fraction": d.validation_fraction}


def write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


def check_folder(out: Path, plan: dict) -> None:
    """Refuse a folder prepared (or being prepared) with another tokenizer or other options."""
    before = read_json(out / "manifest.json") or read_json(out / "prepare.json")
    if before is None:
        if out.is_dir() and any(out.iterdir()):
            raise ConfigError(f"{out} is not empty and holds no prepared shards: choose an empty or new folder")
        return
    theirs, ours = before["tokenizer"], plan["tokenizer"]
    if theirs["vocabulary"] != ours["vocabulary"]:
        raise ConfigError(f"{out} was prepared with another tokenizer: {theirs['source']} "
                          f"({theirs['vocabulary']}), not {ours['source']} ({ours['vocabulary']}); "
                          "choose another folder, or prepare with that tokenizer")
    changed = [f"{key}: {before.get(key)!r} -> {value!r}" for key, value in plan.items()
               if key != "tokenizer" and before.get(key) != value]
    if changed:
        raise ConfigError(f"{out} was prepared with other options ({'; '.join(changed)}): prepare into another "
                          "folder, or repeat the options it was prepared with")


def prepare(cfg, out_dir: str, shard_documents: int = SHARD_DOCUMENTS, progress: bool = True) -> dict:
    """Tokenize and label the rows as a run does, and write them as shards into out_dir; the manifest.
    `progress`: the shards' bar (datasets' own bars are the caller's: trainloop.observe.metrics)."""
    from tqdm.auto import tqdm

    fmt = data_format(cfg.data.name)
    if not fmt.loads_rows:
        loaders = sorted((name for name, f in FORMATS.items()
                          if f.loads_rows and not (f.pairs or f.prompts or f.unpaired or f.images)),
                         key=lambda n: not FORMATS[n].path)
        raise ConfigError(f"data={cfg.data.name} reads shards; prepare from the data itself "
                          f"(data={', '.join(loaders[:-1])} or {loaders[-1]}, with data.path)")
    if fmt.pairs:
        raise ConfigError(f"data={cfg.data.name}: preference pairs are not prepared into shards yet; a run "
                          "tokenizes them itself (drop python -m trainloop.prepare)")
    if fmt.unpaired:
        raise ConfigError(f"data={cfg.data.name}: labelled completions are not prepared into shards yet; a run "
                          "tokenizes them itself (drop python -m trainloop.prepare)")
    if fmt.prompts:
        raise ConfigError(f"data={cfg.data.name}: prompts are not prepared into shards; a run tokenizes them "
                          "itself (drop python -m trainloop.prepare)")
    if fmt.images:
        raise ConfigError(f"data={cfg.data.name}: conversations with images are not prepared into shards; a run "
                          "tokenizes them itself and reads the images as batches are read (drop python -m "
                          "trainloop.prepare)")
    out = Path(out_dir).expanduser()
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.model.name_or_path)
    plan = {"format": FORMAT, "tokenizer": tokenizer_record(tokenizer), "data": token_options(cfg),
            "shard_documents": shard_documents}
    check_folder(out, plan)  # before the rows are read: a wrong tokenizer is said at once
    examples = fmt.load(cfg.data, tokenizer)
    plan["documents"] = count = len(examples)
    check_folder(out, plan)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "prepare.json", plan)
    held_out = split_documents(count, cfg.data.validation_fraction, cfg.trainer.seed)
    np.save(out / "validation.tmp.npy", held_out)
    os.replace(out / "validation.tmp.npy", out / "validation.npy")
    for stale in out.glob("shard_*.tmp"):  # an interrupted write
        shutil.rmtree(stale)
    dtype = np.uint16 if len(tokenizer) <= 2**16 else np.uint32
    masked = fmt.masked
    starts = range(0, count, shard_documents)
    shards, kept = [], 0
    for k, start in enumerate(tqdm(starts, desc="shards", unit="shard", disable=not progress)):
        folder = out / f"shard_{k:05d}"
        if (folder / "meta.json").is_file():
            kept += 1
        else:
            rows = examples.select(range(start, min(start + shard_documents, count)))
            tokens = fmt.tokenize(cfg.data, tokenizer, rows, desc=f"tokenize shard {k + 1}/{len(starts)}")
            write_shard(folder, part_from_batches(token_batches(tokens), masked, dtype))
        shards.append({"name": folder.name, **read_json(folder / "meta.json")})
    content = hashlib.sha256("".join(s["sha256"] for s in shards).encode() + held_out.tobytes()).hexdigest()
    manifest = {**plan, "dtype": np.dtype(dtype).name, "masked": masked,
                "tokens": sum(s["tokens"] for s in shards), "validation_documents": len(held_out),
                "sha256": content, "shards": shards}
    template = fmt.chat_template(cfg.data, tokenizer)
    if template is not None:  # a run from these shards hands it on to its final/ tokenizer
        manifest["chat_template"] = template
    write_json(out / "manifest.json", manifest)
    log.info("prepared %d documents, %d tokens (%s) in %d shards (%d kept from before) in %s",
             count, manifest["tokens"], manifest["dtype"], len(shards), kept, out)
    return manifest


def write_shard(folder: Path, part: Part) -> None:
    """Write under a temporary name, then rename: a shard folder that exists is complete."""
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir()
    ids, offsets, mask = part.arrays
    digest = hashlib.sha256()
    for name, array in (("ids", ids), ("offsets", offsets), ("mask", mask)):
        if array is not None:
            np.save(tmp / f"{name}.npy", array)
            digest.update(np.ascontiguousarray(array).tobytes())
    write_json(tmp / "meta.json", {"documents": len(offsets) - 1, "tokens": len(ids), "sha256": digest.hexdigest()})
    if folder.exists():  # a folder without meta.json is not ours to keep
        shutil.rmtree(folder)
    os.replace(tmp, folder)
