"""Data formats are rows of one table (issue 24, item 3): config's choices and "read only by" rows
come from it, a new format is one class and one row, and training sets answer one protocol.

Real parts only: the composed config, `datasets` reading jsonl, the built-in byte-level tokenizer.
"""

from __future__ import annotations

import logging

import pytest
from omegaconf import OmegaConf

from helpers import compose, conversation, write_rows
from trainloop.config.compose import ConfigError, check_command_line, choices, read_only_by, validate
from trainloop.data.formats import FORMATS
from trainloop.data.formats.text import Files


@pytest.mark.parametrize("name", FORMATS)
def test_a_formats_default_train_on_is_the_first_it_serves(name):
    paths = [] if name == "pydoc" else ["data.path=/some/data"]
    pairs = ["objective=dpo", "adapter=lora"] if FORMATS[name].pairs else []  # what trains on its pairs
    prompts = ["objective=grpo", "objective.rewards=[trainloop.objectives.rewards:exact_answer]"] if FORMATS[name].prompts else []
    rows = ["objective=kto", "adapter=lora"] if FORMATS[name].unpaired else []  # what trains on its labelled rows
    images = ["model.arch=llava"] if FORMATS[name].images else []  # a vision-language model
    cfg = compose(f"data={name}", *paths, *pairs, *prompts, *rows, *images)
    validate(cfg)
    assert cfg.data.train_on == FORMATS[name].train_on[0]


def test_choices_and_read_only_by_come_from_the_table():
    assert choices()["data.name"] == tuple(FORMATS)
    assert choices()["data.train_on"] == ("all", "assistant", "completion")
    table = read_only_by()
    assert table["data.messages_field"][1] == "data=chat or vision_chat"
    assert table["data.path"][1] == ("data=files, chat, vision_chat, prompt_completion, preference, unpaired, prompts "
                                     "or prepared")
    assert table["data.chosen_field"][1] == "data=preference"
    assert table["data.num_proc"][1] == ("data=pydoc, files, chat, prompt_completion, preference or unpaired "
                                         "(data=vision_chat: its rows are tokenized in the run's process; the images "
                                         "are decoded as batches are read, in data.num_workers loader workers) "
                                         "(data=prepared: give it to python -m trainloop.prepare)")


class Shouting(Files):
    """A format of one class and one row: text rows, upper-cased, read from data.text_field."""

    name = "shouting"

    def load(self, cfg, tokenizer=None):
        return super().load(cfg, tokenizer).map(lambda row: {cfg.text_field: row[cfg.text_field].upper()})


def test_a_new_format_is_one_class_and_one_row(monkeypatch, tiny_jsonl):
    from trainloop.data.loaders import build_datasets, byte_level_tokenizer, load_examples

    monkeypatch.setitem(FORMATS, "shouting", Shouting())
    assert "shouting" in choices()["data.name"]
    assert read_only_by()["data.text_field"][1] == "data=files or shouting"
    cfg = OmegaConf.merge(compose("data=files", f"data.path={tiny_jsonl}", "data.text_field=content",
                                  "+preset=smoke"), {"data": {"name": "shouting"}})
    validate(cfg)
    check_command_line(cfg, ["data.text_field=content"])
    rows = load_examples(cfg.data)
    assert rows[0]["content"] == rows[0]["content"].upper()
    train, valid = build_datasets(cfg.data, byte_level_tokenizer(), cfg.trainer.seed)
    assert len(train) and len(valid)
    with pytest.raises(ConfigError, match="data.messages_field=messages has no effect unless data=chat"):
        check_command_line(cfg, ["data.messages_field=x"])


def test_training_sets_answer_the_protocol_with_their_defaults(tiny_jsonl):
    from trainloop.data.loaders import build_datasets, byte_level_tokenizer
    from trainloop.data.mixture import MixtureBlocks
    from trainloop.data.sets import TrainingSet

    cfg = compose("data=files", f"data.path={tiny_jsonl}", "data.text_field=content", "+preset=smoke")
    train, valid = build_datasets(cfg.data, byte_level_tokenizer(), cfg.trainer.seed)
    assert isinstance(train, TrainingSet) and not train.orders_itself
    before = len(train)
    train.whole_batches(3)
    train.set_epoch(5)
    assert len(train) == before  # a plain set: the order drops the tail, reshuffles each epoch
    mix = MixtureBlocks([train, valid], [1.0, 1.0], seed=0)
    assert isinstance(mix, TrainingSet) and mix.orders_itself


def test_the_built_in_chat_template_is_announced_once(tmp_path, caplog):
    """The run's final/ tokenizer, the row checks and the row tokenizer each ask for the template."""
    from trainloop.data.loaders import build_datasets, byte_level_tokenizer, trained_chat_template

    chats = write_rows(tmp_path / "chat.jsonl", [{"messages": conversation(i)} for i in range(20)])
    cfg = compose("data=chat", f"data.path={chats}", "+preset=smoke", "data.seq_len=256")
    tokenizer = byte_level_tokenizer()
    with caplog.at_level(logging.INFO, logger="trainloop"):
        trained_chat_template(cfg.data, tokenizer)
        build_datasets(cfg.data, tokenizer, cfg.trainer.seed)
    assert caplog.text.count("the tokenizer has no chat template") == 1


def test_prepare_refuses_a_format_that_reads_no_rows(tmp_path):
    from trainloop.config.compose import compose_config
    from trainloop.data.shards import prepare

    cfg = compose_config(["data=prepared", f"data.path={tmp_path}"])
    with pytest.raises(ConfigError, match=r"^data=prepared reads shards; prepare from the data itself "
                                          r"\(data=files, chat, prompt_completion or pydoc, with data.path\)$"):
        prepare(cfg, str(tmp_path / "out"), progress=False)
