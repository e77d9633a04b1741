"""A chat template's `{% generation %}` markers decide the trained tokens (issue 23, item 7), as
transformers' `apply_chat_template(return_assistant_tokens_mask=True)` and TRL's
`assistant_only_loss=True` do; with data.train_on=all every token is still a target.

Real parts only: trainloop's own row tokenizer over `datasets` reading jsonl, transformers'
assistant mask, TRL's SFTTrainer preparing its dataset with its own llama3 and qwen2.5 training
templates, and an in-process run of trainloop.
"""

from __future__ import annotations

import logging
from pathlib import Path


from helpers import compose, read_metrics, train, write_rows

# The built-in format with markers that cover a reply and its end-of-text but not the newline after
# it (the rule for unmarked templates trains that newline too), and that leave out a reply whose
# `weight` is 0, as OpenAI's fine-tuning rows mark one.
MARKED_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['role'] == 'assistant' and message.get('weight', 1) %}"
    "{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def conversation(i: int) -> list[dict]:
    """Multi-turn rows: a system message in some, one to three turns, replies with surrounding
    spaces, newlines and non-ASCII text."""
    messages = [{"role": "system", "content": f"You are terse ({i})."}] if i % 3 != 1 else []
    for turn in range(1 + i % 3):
        messages += [{"role": "user", "content": f"Question {turn} of row {i}: what is {i} * {turn + 2}?"},
                     {"role": "assistant", "content": (" " if turn % 2 else "") + f"It is {i * (turn + 2)}."
                      + "\nSo: ñ é 中文 " * (i % 2) + ("  " if i % 4 == 0 else "")}]
    return messages


ROWS = [conversation(i) for i in range(20)]


def weighted(messages: list[dict], zero: set[int]) -> list[dict]:
    """Every message with a `weight`: 0 for the replies numbered in `zero` (and the prompts), else 1."""
    replies = iter(range(len(messages)))
    return [{**m, "weight": int(m["role"] == "assistant" and next(replies) not in zero)} for m in messages]


def trainloop_tokens(*overrides: str) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's input_ids and labels as a run tokenizes them (trainloop.data.loaders's own row tokenizer)."""
    from trainloop.data.loaders import build_tokenizer, load_examples, tokenize_examples

    cfg = compose("+preset=smoke", "data=chat", *overrides)
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.model.name_or_path)
    rows = tokenize_examples(cfg.data, tokenizer, load_examples(cfg.data))
    return rows["input_ids"], rows["labels"]


def targets(labels: list[int]) -> list[int]:
    return [int(label != -100) for label in labels]


def test_marked_templates_train_the_tokens_of_transformers_assistant_mask(tmp_path):
    """20 multi-turn rows, some replies weighted 0: trainloop's tokens are transformers' tokens, its
    targets are exactly the assistant mask; with data.train_on=all every token is a target."""
    from trainloop.data.loaders import byte_level_tokenizer

    rows = [weighted(m, zero={0} if i % 5 == 2 else set()) for i, m in enumerate(ROWS)]
    data = [f"data.path={write_rows(tmp_path / 'chat.jsonl', [{'messages': m} for m in rows])}",
            f"data.chat_template={tmp_path / 'marked.jinja'}"]
    (tmp_path / "marked.jinja").write_text(MARKED_TEMPLATE)
    tokenizer = byte_level_tokenizer()
    expected = [tokenizer.apply_chat_template(m, chat_template=MARKED_TEMPLATE, return_dict=True,
                                              return_assistant_tokens_mask=True) for m in rows]
    assert sum(sum(e["assistant_masks"]) for e in expected) > 0

    ids, labels = trainloop_tokens(*data)
    assert ids == [e["input_ids"] for e in expected]
    assert [targets(row) for row in labels] == [e["assistant_masks"] for e in expected]
    assert all(label in (-100, token) for row, tokens in zip(labels, ids) for label, token in zip(row, tokens))

    ids, labels = trainloop_tokens(*data, "data.train_on=all")
    assert ids == labels == [e["input_ids"] for e in expected]


def trl_tokenizer(path: Path, special: dict, template: str):
    """The built-in byte-level tokenizer with the model family's special tokens and its chat
    template, saved and loaded back as a run loads data.tokenizer."""
    from transformers import AutoTokenizer

    from trainloop.data.loaders import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    tokenizer.add_special_tokens(special)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def test_trl_sft_trains_the_tokens_trainloop_trains_with_trls_llama3_and_qwen2_5_templates(tmp_path):
    """TRL's SFTTrainer with assistant_only_loss=True swaps each family's template for its own
    training template (with markers) and labels its dataset; trainloop, given that template file,
    yields the same input_ids and labels, token for token. (Qwen2.5's marks start at the newline
    after the reply's header, which the rule for unmarked templates leaves to the prompt.)"""
    import trl
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer
    from trl import chat_template_utils as templates

    jsonl = write_rows(tmp_path / "chat.jsonl", [{"messages": m} for m in ROWS])
    families = {
        "llama3": ({"bos_token": "<|begin_of_text|>",
                    "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]},
                   templates.llama3_chat_template, templates.llama3_training_chat_template),
        "qwen2_5": ({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}, templates.qwen2_5_chat_template,
                    templates.qwen2_5_training_chat_template),
    }
    for name, (special, template, training_template) in families.items():
        tokenizer = trl_tokenizer(tmp_path / name, special, template)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
        args = SFTConfig(output_dir=str(tmp_path / f"trl_{name}"), assistant_only_loss=True, max_length=None,
                         packing=False, report_to="none", use_cpu=True)
        trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer,
                             train_dataset=Dataset.from_list([{"messages": m} for m in ROWS]))
        assert trainer.chat_template == training_template, name
        template_file = Path(trl.__file__).parent / "chat_templates" / f"{name}_training.jinja"
        assert template_file.read_text() == training_template

        ids, labels = trainloop_tokens(f"data.path={jsonl}", f"data.tokenizer={tmp_path / name}",
                                       f"data.chat_template={template_file}")
        assert ids == trainer.train_dataset["input_ids"], name
        assert labels == trainer.train_dataset["labels"], name
        assert all(any(targets(row)) for row in labels), name


def test_a_marked_template_trains_and_rows_it_marks_nothing_in_are_dropped(tmp_path, caplog):
    """A short run with data.chat_template=FILE carrying markers: rows whose every reply has weight 0
    have no target token, so they are counted and left out; the others train."""
    rows = [weighted(m, zero=set(range(3)) if i % 4 == 0 else set()) for i, m in enumerate(ROWS * 4)]
    (tmp_path / "marked.jinja").write_text(MARKED_TEMPLATE)
    data = ["data=chat", f"data.path={write_rows(tmp_path / 'chat.jsonl', [{'messages': m} for m in rows])}",
            f"data.chat_template={tmp_path / 'marked.jinja'}", "data.seq_len=320"]
    with caplog.at_level(logging.INFO, logger="trainloop"):
        run = train(tmp_path / "run", *data, "trainer.max_steps=2")
    assert "20 dropped with no target token" in caplog.text
    losses = [m["loss"] for m in read_metrics(run) if "loss" in m]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)
