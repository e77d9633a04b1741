"""Prepared token shards (issue 15): `python -m trainloop.prepare` writes them once, `data=prepared`
memory-maps them, and the blocks are the ones a run that tokenizes for itself trains on.

Real parts only: `datasets` reading jsonl files, the built-in byte-level tokenizer (and one with an
extra token as "another tokenizer"), real runs of trainloop in this process.
"""

from __future__ import annotations

import json
import mmap
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import compose, conversation, prepare, read_metrics, train, warm, write_rows
from trainloop.config.compose import ConfigError, check_command_line


def blocks(*overrides: str):
    from trainloop.data.loaders import build_datasets, byte_level_tokenizer

    cfg = compose("+preset=smoke", *overrides)
    return build_datasets(cfg.data, byte_level_tokenizer(), cfg.trainer.seed)


@pytest.fixture
def chat_jsonl(tmp_path) -> Path:
    return write_rows(tmp_path / "chat.jsonl", [{"messages": conversation(i)} for i in range(40)])


@pytest.fixture
def other_tokenizer(tmp_path) -> Path:
    """The byte-level tokenizer with one token more: another vocabulary."""
    from trainloop.data.loaders import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    tokenizer.add_tokens(["<|extra|>"])
    tokenizer.save_pretrained(tmp_path / "other_tokenizer")
    return tmp_path / "other_tokenizer"


DATA = {"text": lambda paths: ["data=files", f"data.path={paths['text']}", "data.text_field=content"],
        "chat": lambda paths: ["data=chat", f"data.path={paths['chat']}", "data.train_on=assistant"]}
AT_TRAIN_TIME = [["data.packing=documents", "data.overlong=split"], ["data.packing=stream"],
                 ["data.packing=none", "data.overlong=truncate", "data.seq_len=256"],
                 ["data.packing=documents", "data.overlong=drop", "data.seq_len=1024"]]


@pytest.mark.parametrize("kind", DATA)
def test_prepared_shards_give_the_blocks_of_the_on_the_fly_path(tmp_path, tiny_jsonl, chat_jsonl, kind):
    """Acceptance 5: for each packing and overlong choice (made at train time), every train and
    validation block from the shards equals the on-the-fly one, item by item, dtype included."""
    data = DATA[kind]({"text": tiny_jsonl, "chat": chat_jsonl})
    manifest = prepare(tmp_path / "shards", *data)
    assert manifest["dtype"] == "uint16" and len(manifest["shards"]) == 4  # 40 rows, 10 per shard
    assert np.load(tmp_path / "shards" / "shard_00000" / "ids.npy", mmap_mode="r").dtype == np.uint16
    assert (tmp_path / "shards" / "shard_00000" / "mask.npy").is_file() == (kind == "chat")
    for choice in AT_TRAIN_TIME:
        if kind == "chat" and "data.overlong=drop" in choice:
            continue  # the conversations are short: nothing to drop
        on_the_fly = blocks(*data, *choice)
        prepared = blocks("data=prepared", f"data.path={tmp_path / 'shards'}", *choice)
        for fly, shard in zip(on_the_fly, prepared, strict=True):
            assert len(fly) == len(shard) > 0, choice
            for b in range(len(fly)):
                a, p = fly[b], shard[b]
                assert a.keys() == p.keys(), choice
                for key in a:
                    assert a[key].dtype == p[key].dtype == torch.long and torch.equal(a[key], p[key]), (choice, b, key)
    if kind == "chat":  # the mask made it: some tokens of the prepared blocks carry no loss
        assert (prepared[0][0]["labels"][1:] == -100).any()


def test_train_from_shards_maps_them_and_reads_blocks_on_demand(tmp_path, tiny_jsonl):
    from trainloop.data.loaders import build_datasets, byte_level_tokenizer, data_fingerprint

    prepare(tmp_path / "shards", "data=files", f"data.path={tiny_jsonl}", "data.text_field=content")
    cfg = compose("+preset=smoke", "data=prepared", f"data.path={tmp_path / 'shards'}")
    train_set, valid_set = build_datasets(cfg.data, byte_level_tokenizer(), cfg.trainer.seed)
    ids = train_set.documents.parts[0].arrays[0]
    assert isinstance(ids.base.obj, mmap.mmap) and not ids.flags.writeable  # a view of the file, not a copy
    corpus_bytes = sum(p.arrays[0].nbytes for p in train_set.documents.parts)
    assert len(pickle.dumps(train_set)) < corpus_bytes / 4  # a DataLoader worker gets paths, not tokens
    fingerprint = data_fingerprint(byte_level_tokenizer(), train_set, valid_set)["data content"]
    assert "prepared shards sha256" in fingerprint and "packing=documents, overlong=split" in fingerprint

    run_dir = train(tmp_path / "run", "data=prepared", f"data.path={tmp_path / 'shards'}", "data.num_workers=1")
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [1, 2, 3, 4]
    assert (run_dir / "final" / "config.json").is_file()


def test_an_interrupted_prepare_keeps_its_finished_shards(tmp_path, tiny_jsonl):
    data = ["data=files", f"data.path={tiny_jsonl}", "data.text_field=content"]
    first = prepare(tmp_path / "shards", *data)
    shards = sorted((tmp_path / "shards").glob("shard_*"))
    mtimes = {s.name: (s / "ids.npy").stat().st_mtime_ns for s in shards}
    # As if stopped while writing shard 2: no manifest, shard 2 half-written under its temporary name.
    (tmp_path / "shards" / "manifest.json").unlink()
    (tmp_path / "shards" / "shard_00002").rename(tmp_path / "shards" / "shard_00002.tmp")
    (tmp_path / "shards" / "shard_00002.tmp" / "meta.json").unlink()
    with pytest.raises(ConfigError, match="holds no manifest.json"):
        blocks("data=prepared", f"data.path={tmp_path / 'shards'}")
    again = prepare(tmp_path / "shards", *data)
    assert again == first
    assert not list((tmp_path / "shards").glob("*.tmp"))
    for s in shards:
        kept = (s / "ids.npy").stat().st_mtime_ns == mtimes[s.name]
        assert kept == (s.name != "shard_00002"), s.name


def test_another_tokenizer_is_refused_when_preparing_and_when_training(tmp_path, tiny_jsonl, other_tokenizer):
    data = ["data=files", f"data.path={tiny_jsonl}", "data.text_field=content"]
    manifest = prepare(tmp_path / "shards", *data)
    ours = manifest["tokenizer"]["vocabulary"]
    proc = warm(1, [str(tmp_path / "shards"), "--no-progress", *data,
                   f"data.tokenizer={other_tokenizer}"], module="trainloop.prepare", check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("trainloop: error:")]
    assert len(error) == 1 and ours in error[0] and "258 tokens" in error[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert json.loads((tmp_path / "shards" / "manifest.json").read_text()) == manifest  # untouched

    with pytest.raises(ConfigError, match=rf"prepared with tokenizer .*\({ours}\).* this run's tokenizer is .*258 tokens"):
        train(tmp_path / "run", "data=prepared", f"data.path={tmp_path / 'shards'}", f"data.tokenizer={other_tokenizer}")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_no_progress_draws_no_bar(tmp_path, chat_jsonl):
    proc = warm(1, [str(tmp_path / "shards"), "--no-progress", "data=chat",
                   f"data.path={chat_jsonl}"], module="trainloop.prepare", timeout=300)
    assert "it/s]" not in proc.stderr and "examples/s]" not in proc.stderr, proc.stderr[-3000:]  # tqdm's rates
    assert "documents" in proc.stdout and (tmp_path / "shards" / "manifest.json").is_file()


@pytest.mark.parametrize("key", ["data.text_field=content", "data.train_on=all", "data.validation_fraction=0.2"])
def test_keys_prepare_fixed_are_refused_under_data_prepared(key):
    overrides = ["data=prepared", "data.path=/some/shards", key]
    with pytest.raises(ConfigError, match=f"{key.split('=')[0]}=.* has no effect unless data=.*files"):
        check_command_line(compose(*overrides), overrides)


def test_prepare_refuses_a_key_it_does_not_read(tmp_path):
    proc = warm(1, [str(tmp_path / "out"), "data.seq_len=256"], module="trainloop.prepare",
                  cwd=tmp_path, check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "data.seq_len" in proc.stderr and "data=prepared" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_mixture_of_prepared_folders_trains_and_counts_tokens_per_source(tmp_path, tiny_jsonl, chat_jsonl):
    """data.sources over two prepared folders (text and chat), weights 3:1: each source's share of
    the training tokens follows its weight."""
    prepare(tmp_path / "text", "data=files", f"data.path={tiny_jsonl}", "data.text_field=content")
    prepare(tmp_path / "chat", "data=chat", f"data.path={chat_jsonl}")
    sources = f"data.sources=[{{path: {tmp_path / 'text'}, weight: 3, name: text}},{{path: {tmp_path / 'chat'}, name: chat}}]"
    run = train(tmp_path / "run", "data=prepared", sources, "data.batch_size=2", "trainer.max_steps=8")
    counts = [r["tokens_per_source"] for r in read_metrics(run) if "tokens_per_source" in r][-1]
    assert set(counts) == {"text", "chat"} and counts["text"] == 3 * counts["chat"], counts
