"""final/ is a model to prompt as it was trained (issue 23): its tokenizer carries the chat
template the rows were rendered with (built-in, data.chat_template=FILE, or the one prepared chat
shards were made with), and its config keeps the KV cache on for `generate`.

Real parts only: runs of trainloop in this process, `datasets` reading jsonl, the tokenizer
written to final/ loaded back with `AutoTokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import compose, conversation, prepare, pretrained_llama, train, write_rows

ROWS = [conversation(i) for i in range(24)]


@pytest.fixture
def chat_jsonl(tmp_path) -> Path:
    return write_rows(tmp_path / "chat.jsonl", [{"messages": m} for m in ROWS])


def training_tokens(*overrides: str) -> list[list[int]]:
    """Each row's tokens as the run tokenizes it (trainloop.data.loaders's own row tokenizer)."""
    from trainloop.data.loaders import build_tokenizer, load_examples, tokenize_examples

    cfg = compose("+preset=smoke", *overrides)
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.model.name_or_path)
    return tokenize_examples(cfg.data, tokenizer, load_examples(cfg.data))["input_ids"]


def assert_prompted_as_trained(final: Path, trained: list[list[int]]) -> str:
    """final/'s tokenizer renders every training row to the very tokens training used; it opens
    a reply for a new prompt; config.json and generation_config.json keep the cache on."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(final)
    for messages, ids in zip(ROWS, trained):
        assert tokenizer.apply_chat_template(messages, tokenize=False) == tokenizer.decode(ids)
        assert tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)[
            "input_ids"] == ids
    for name in ("config.json", "generation_config.json"):
        assert json.loads((final / name).read_text())["use_cache"] is True, name
    return tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)


def test_the_built_in_template_is_saved_with_the_merged_lora_model(tmp_path, chat_jsonl):
    data = ["data=chat", f"data.path={chat_jsonl}"]
    run = train(tmp_path / "run", *data, "adapter=lora", "trainer.max_steps=2")
    prompt = assert_prompted_as_trained(run / "final", training_tokens(*data))
    # the format docs/fine-tuning.md's data=chat rules describe, byte for byte
    assert prompt == "<|user|>\nhi<|endoftext|>\n<|assistant|>\n"


def test_a_template_file_is_saved_with_the_merged_lora_model(tmp_path, chat_jsonl):

    base = pretrained_llama(tmp_path / "base")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    data = ["data=chat", f"data.path={chat_jsonl}", f"data.chat_template={template}", "model=hf",
            f"model.name_or_path={base}"]
    run = train(tmp_path / "run", *data, "adapter=lora", "trainer.max_steps=2")
    assert assert_prompted_as_trained(run / "final", training_tokens(*data)) == "[user] hi</s>\n[assistant] "


def test_prepared_chat_shards_hand_their_template_to_the_final_model(tmp_path, chat_jsonl):
    data = ["data=chat", f"data.path={chat_jsonl}"]
    manifest = prepare(tmp_path / "shards", *data)
    assert manifest["chat_template"].startswith("{% for message in messages %}")
    run = train(tmp_path / "run", "data=prepared", f"data.path={tmp_path / 'shards'}", "data.num_workers=0",
                "trainer.max_steps=2")
    assert_prompted_as_trained(run / "final", training_tokens(*data))


def test_text_data_leaves_the_tokenizer_without_a_template(tmp_path):
    from transformers import AutoTokenizer

    run = train(tmp_path / "run", "trainer.max_steps=2")
    assert not AutoTokenizer.from_pretrained(run / "final").chat_template
    assert json.loads((run / "final" / "config.json").read_text())["use_cache"] is True
