"""Data for fine-tuning (issue #14): chat and prompt/completion rows, which tokens carry a loss,
rows packed into blocks without attention crossing between them, and bad input refused.

Real parts only: the built-in byte-level tokenizer (which has no chat template, so the built-in
template renders), `datasets` reading jsonl files, tiny Llama and GPT-2 models.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import compose, conversation, reset_accelerate, warm, write_rows
from trainloop.config.compose import ConfigError, validate

EOS = "<|endoftext|>"


@pytest.fixture
def chat_jsonl(tmp_path) -> Path:
    return write_rows(tmp_path / "chat.jsonl", [{"messages": conversation(i)} for i in range(40)])


@pytest.fixture
def pairs_jsonl(tmp_path) -> Path:
    rows = [{"prompt": f"Q: what is {i} times three?" + " Think." * (i % 3), "completion": f" A: {3 * i}."}
            for i in range(40)]
    return write_rows(tmp_path / "pairs.jsonl", rows)


def build(*overrides: str):
    from trainloop.data.loaders import build_datasets, byte_level_tokenizer

    cfg = compose(*overrides)
    validate(cfg)
    tokenizer = byte_level_tokenizer()
    train, valid = build_datasets(cfg.data, tokenizer, seed=0)
    return cfg, tokenizer, train, valid


def rows_of(block: dict) -> list[slice]:
    """The packed rows of one block, from where its position ids restart (padding included)."""
    starts = [i for i, p in enumerate(block["position_ids"].tolist()) if p == 0] + [len(block["position_ids"])]
    return [slice(a, b) for a, b in zip(starts, starts[1:])]


def targets_text(tokenizer, block: dict) -> str:
    labels = block["labels"]
    return tokenizer.decode(labels[labels != -100].tolist())


# --- which tokens carry a loss (acceptance 2) ---------------------------------------------------

def test_chat_loss_is_on_assistant_replies_only(chat_jsonl):
    """With packing=none every block is one conversation: its target tokens are exactly its
    assistant replies, each with the end-of-text the built-in template closes it with."""
    _, tokenizer, train, valid = build("data=chat", f"data.path={chat_jsonl}", "data.packing=none",
                                       "data.seq_len=256", "data.validation_fraction=0.25")
    replies = {"".join(m["content"] + EOS + "\n" for m in conversation(i) if m["role"] == "assistant")
               for i in range(40)}
    for part in (train, valid):
        for b in range(len(part)):
            block = part[b]
            assert targets_text(tokenizer, block) in replies
            text = tokenizer.decode(block["input_ids"][block["attention_mask"].bool()].tolist())
            assert text.startswith("<|system|>" if "Be brief" in text else "<|user|>")
    assert len(train) + len(valid) == 40


def test_chat_train_on_all_takes_every_token_but_the_first(chat_jsonl):
    _, _, train, _ = build("data=chat", f"data.path={chat_jsonl}", "data.packing=none", "data.seq_len=256",
                           "data.train_on=all")
    block = train[0]
    real = block["attention_mask"].bool()
    assert block["labels"][0] == -100 and (block["labels"][1:][real[1:]] == block["input_ids"][1:][real[1:]]).all()


def test_prompt_completion_loss_is_on_the_completion_only(pairs_jsonl):
    _, tokenizer, train, valid = build("data=prompt_completion", f"data.path={pairs_jsonl}",
                                       "data.seq_len=64", "data.validation_fraction=0.25")
    completions = {f" A: {3 * i}.{EOS}" for i in range(40)}
    found = []
    for part in (train, valid):
        for b in range(len(part)):
            block = part[b]
            for row in rows_of(block):
                text = targets_text(tokenizer, {"labels": block["labels"][row]})
                if text:
                    found.append(text)
    assert sorted(found) == sorted(completions)  # every completion once, nothing else


def test_eval_loss_counts_only_target_tokens(chat_jsonl):
    """evaluate() on packed blocks equals the mean loss over assistant tokens, each conversation
    run alone through the model: masked tokens and packing change nothing."""
    from accelerate import Accelerator

    from trainloop.data.loaders import build_dataloaders
    from trainloop.model.builder import build_model, build_model_config
    from trainloop.objectives import build_objective
    from trainloop.parallel import build_strategy

    cfg, tokenizer, train, valid = build("+preset=smoke", "data=chat", f"data.path={chat_jsonl}",
                                         "data.seq_len=256", "data.batch_size=2", "data.validation_fraction=0.3")
    assert any(len(rows_of(valid[b])) > 2 for b in range(len(valid)))  # some blocks hold several rows
    torch.manual_seed(0)
    model = build_model(cfg.model, build_model_config(cfg.model, len(tokenizer)))
    reset_accelerate()
    accelerator = Accelerator(cpu=True)
    _, valid_loader = build_dataloaders(cfg.data, train, valid, pin_memory=False)
    got = build_objective(cfg, "cpu").evaluate(build_strategy(cfg, accelerator), model, valid_loader,
                                               max_batches=None)["eval_loss"]

    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for b in range(len(valid)):
            block = valid[b]
            for row in rows_of(block):
                ids, labels = block["input_ids"][row], block["labels"][row]
                logits = model(input_ids=ids[None]).logits[0]
                logp = torch.log_softmax(logits[:-1].double(), -1)
                keep = labels[1:] != -100
                total -= logp[keep].gather(1, labels[1:][keep][:, None]).sum().item()
                count += int(keep.sum())
    assert count > 0
    assert got == pytest.approx(total / count, rel=1e-5)


# --- packing: attention stays inside each row (acceptance 3) ------------------------------------

@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_row_packed_after_others_has_the_logits_it_has_alone(chat_jsonl, attn, arch):
    """A block built by the data pipeline, through the loop's forward: each row's logits equal
    that row alone, in training and in evaluation mode, even with a model whose config asks for
    a cache (the packed mask needs use_cache=False)."""
    from trainloop.model.builder import build_model, build_model_config
    from trainloop.objectives.causal_lm import model_inputs

    cfg, tokenizer, train, _ = build("+preset=smoke", "data=chat", f"data.path={chat_jsonl}", "data.seq_len=256",
                                     f"model.arch={arch}", f"model.attn_implementation={attn}")
    block = next(train[b] for b in range(len(train)) if len(rows_of(train[b])) > 2)
    torch.manual_seed(0)
    model = build_model(cfg.model, build_model_config(cfg.model, len(tokenizer)))
    model.config.use_cache = True
    for mode in (model.train, model.eval):
        mode()
        packed = model(**model_inputs({k: v[None] for k, v in block.items()})).logits[0]
        for row in rows_of(block):
            alone = model(input_ids=block["input_ids"][row][None], use_cache=False).logits[0]
            assert torch.allclose(packed[row], alone, atol=1e-5), (mode.__name__, (packed[row] - alone).abs().max())


def test_pydoc_documents_packing_keeps_every_token_and_restarts_positions():
    """The default run: long documents split into seq_len pieces (data.overlong=split), so about
    as many blocks as streaming gives; each piece starts at position 0."""
    _, _, stream_train, stream_valid = build("+preset=smoke", "data.packing=stream")
    cfg, _, train, valid = build("+preset=smoke")
    assert (cfg.data.packing, cfg.data.overlong) == ("documents", "split")
    stream = len(stream_train) + len(stream_valid)
    assert stream <= len(train) + len(valid) <= stream * 1.02
    assert int((train.tensors["position_ids"] == 0).sum()) > len(train)  # more rows than blocks: restarts


def test_overlong_rows_are_truncated_or_dropped_and_counted(pairs_jsonl, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="trainloop"):
        _, _, train, valid = build("data=prompt_completion", f"data.path={pairs_jsonl}", "data.seq_len=40",
                                   "data.overlong=drop")
    dropped = int(caplog.text.split(" dropped as overlong")[0].rsplit(" ", 1)[1])
    assert dropped > 0
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainloop"):
        build("data=prompt_completion", f"data.path={pairs_jsonl}", "data.seq_len=40")
    assert f"{dropped} truncated" in caplog.text


# --- bad input: one line naming the key (acceptance 6) ------------------------------------------

BAD_ROWS = {
    "no messages field": ([{"conversation": conversation(1)}], "data.messages_field='messages' is not a column"),
    "unknown role": ([{"messages": [{"role": "bot", "content": "hi"}]}], "bad.jsonl:1: data.messages_field='messages' "
                                                                          "message 1 has role 'bot'"),
    "no content": ([{"messages": [{"role": "user"}]}], "bad.jsonl:1: data.messages_field='messages' message 1 "
                                                       r"\(user\) has no content"),
    "no assistant turn": ([{"messages": [{"role": "user", "content": "hi"}]}], "data.train_on=assistant: no row"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_chat_rows_are_refused_naming_the_key(tmp_path, case):
    rows, message = BAD_ROWS[case]
    path = write_rows(tmp_path / "bad.jsonl", rows * 4)
    with pytest.raises(ConfigError, match=message):
        build("data=chat", f"data.path={path}")


def test_every_row_dropped_as_overlong_is_refused(chat_jsonl):
    with pytest.raises(ConfigError, match=r"data.overlong=drop: every one of the 40 rows was dropped"):
        build("data=chat", f"data.path={chat_jsonl}", "data.seq_len=16", "data.overlong=drop")


@pytest.mark.parametrize("option, train_on", [("pydoc", "assistant"), ("chat", "completion"),
                                              ("prompt_completion", "assistant")])
def test_a_train_on_the_data_cannot_serve_is_refused(option, train_on):
    cfg = compose(f"data={option}", "data.path=x.jsonl" if option != "pydoc" else "data.seq_len=64",
                  f"data.train_on={train_on}")
    with pytest.raises(ConfigError, match=f"data.train_on={train_on} cannot be served by data={option}"):
        validate(cfg)


def test_a_missing_chat_template_file_is_refused(chat_jsonl):
    with pytest.raises(ConfigError, match="data.chat_template='/no/such.jinja': no such file"):
        build("data=chat", f"data.path={chat_jsonl}", "data.chat_template=/no/such.jinja")


def test_a_chat_template_file_is_used(chat_jsonl, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    _, tokenizer, train, _ = build("data=chat", f"data.path={chat_jsonl}", f"data.chat_template={template}",
                                   "data.packing=none", "data.seq_len=256")
    block = train[0]
    text = tokenizer.decode(block["input_ids"][block["attention_mask"].bool()].tolist())
    assert "[user] What is" in text and targets_text(tokenizer, block).endswith(".\n")
    assert "[assistant]" not in targets_text(tokenizer, block)  # the reply's header is not a target


def test_bad_chat_data_exits_2_with_one_line(tmp_path):
    path = write_rows(tmp_path / "bad.jsonl", [{"messages": [{"role": "bot", "content": "hi"}]}] * 4)
    done = warm(1, ["+preset=smoke", "data=chat", f"data.path={path}",
                   f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, check=False)
    errors = [line for line in done.stderr.splitlines() if line.startswith("trainloop: error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
    assert f"{path}:1: data.messages_field='messages' message 1 has role 'bot'" in errors[0]
    assert "Traceback" not in done.stderr
