"""Chat rows that are unusual or wrong, and rows whose unread fields differ (issue 23, items 5 and 6).

Every unusual conversation either trains, is skipped and counted in one warning line, or is refused
with one line naming its file and 1-based line; none ends in a traceback. Only the columns a data
option reads are read, so json files whose other fields differ load. Real parts only: `datasets`,
the built-in byte-level tokenizer and its built-in chat template, a strict Jinja template.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from helpers import compose, read_metrics, train, warm
from trainloop.config.compose import ConfigError, validate

U = {"role": "user", "content": "What is two plus two?"}
A = {"role": "assistant", "content": "Four."}
S = {"role": "system", "content": "Be brief."}
EMPTY = {"role": "assistant", "content": ""}

# Alternation as Llama-2's and Mistral's templates enforce it: roles user/assistant in turn.
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


def write_lines(path: Path, rows: list) -> Path:
    """One JSON value per line; None writes a blank line (no row, but a line)."""
    path.write_text("".join(("" if row is None else json.dumps(row)) + "\n" for row in rows))
    return path


def examples(*overrides: str):
    from trainloop.data.loaders import byte_level_tokenizer, load_examples

    cfg = compose(*overrides)
    validate(cfg)
    return load_examples(cfg.data, byte_level_tokenizer())


def build(*overrides: str):
    from trainloop.data.loaders import build_datasets, byte_level_tokenizer

    cfg = compose(*overrides)
    validate(cfg)
    return build_datasets(cfg.data, byte_level_tokenizer(), seed=0)


# --- chat rows: trained, skipped and counted, or refused naming file:line (acceptance 4) ---------

def test_unusual_conversations_are_kept_or_skipped_and_counted_in_one_warning(tmp_path, caplog):
    good = {"messages": [S, U, A]}
    rows = [good] * 6 + [
        {"messages": [A, U, A]},                      # the assistant first: skipped
        {"messages": [U]},                            # no reply: skipped
        {"messages": []}, {"other": 1},               # no messages: skipped
        {"messages": [U, A, U]},                      # trailing user turn: kept, not trained
        {"messages": [U, U, A]},                      # two user turns: kept
        {"messages": [U, A, A]},                      # two replies: kept
        {"messages": [U, A, S, U, A]},                # a system turn in the middle: kept
        {"messages": [U, EMPTY, U, A]},               # an empty reply: kept
    ]
    path = write_lines(tmp_path / "chat.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="trainloop"):
        kept = examples("data=chat", f"data.path={path}")
    assert len(kept) == 6 + 5
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and "data=chat" in r.getMessage()]
    assert len(warnings) == 1, warnings
    line = warnings[0]
    assert "skipped 4 of 15 rows (" in line
    for count in ("1 with the assistant's reply first", "1 with no assistant reply", "2 with no messages",
                  "kept 1 with a trailing turn after the last reply (not trained)",
                  "kept 1 with two user turns in a row",
                  "kept 1 with two assistant replies in a row", "kept 1 with a system turn after the first message",
                  "kept 1 with an empty reply (trained as its end of turn alone)"):
        assert count in line, (count, line)


def test_a_conversation_opening_with_the_assistant_no_longer_crashes_the_run(tmp_path):
    """The issue's 55-line traceback: the first reply's header was rendered from an empty conversation."""
    path = write_lines(tmp_path / "chat.jsonl", [{"messages": [A, U, A]}] + [{"messages": [U, A]}] * 30)
    train_set, valid_set = build("data=chat", f"data.path={path}", "data.packing=none", "data.seq_len=64")
    assert len(train_set) + len(valid_set) == 30  # one block a row: the one opening with the reply skipped


def test_with_train_on_all_a_conversation_without_a_reply_is_kept(tmp_path):
    path = write_lines(tmp_path / "chat.jsonl", [{"messages": [U]}, {"messages": [U, A]}])
    assert len(examples("data=chat", f"data.path={path}", "data.train_on=all")) == 2
    assert len(examples("data=chat", f"data.path={path}")) == 1


def test_a_trailing_user_turn_is_context_without_a_loss(tmp_path, caplog):
    from trainloop.data.loaders import byte_level_tokenizer

    path = write_lines(tmp_path / "chat.jsonl", [{"messages": [U, A, {"role": "user", "content": "Thanks!"}]}] * 20)
    with caplog.at_level(logging.WARNING, logger="trainloop"):
        train_set, _ = build("data=chat", f"data.path={path}", "data.packing=none", "data.seq_len=128")
    assert "kept 20 with a trailing turn after the last reply (not trained)" in caplog.text
    block = train_set[0]
    text = byte_level_tokenizer().decode(block["input_ids"][block["attention_mask"].bool()].tolist())
    targets = byte_level_tokenizer().decode(block["labels"][block["labels"] != -100].tolist())
    assert "Thanks!" in text and "Thanks!" not in targets and targets.startswith("Four.")


@pytest.mark.parametrize("rows, says", [
    ([{"messages": [U, EMPTY]}, {"messages": [U, EMPTY, U, EMPTY]}],
     "every assistant reply in {path} is empty: the model would learn only to stop"),
    ([{"messages": [A]}, {"messages": [A, U, A]}],
     "none of the 6 rows of {path} can be trained: 6 with the assistant's reply first"),
    ([{"messages": [U]}, {"messages": [S, U]}],
     "data.train_on=assistant: no row of {path} has an assistant message"),
])
def test_data_with_nothing_to_learn_is_refused(tmp_path, rows, says):
    path = write_lines(tmp_path / "chat.jsonl", rows * 3)
    with pytest.raises(ConfigError, match=re.escape(says.format(path=path))):
        examples("data=chat", f"data.path={path}")


@pytest.mark.parametrize("bad, says", [
    ("hello", "data.messages_field='messages' is text, not a list of {role, content} messages"),
    ({"role": "user", "content": "hi"}, "data.messages_field='messages' is an object, not a list"),
    ([U, "Four."], "data.messages_field='messages' message 2 is text, not a {role, content} object"),
    ([U, {"role": "bot", "content": "hi"}], "data.messages_field='messages' message 2 has role 'bot'"),
    ([U, {"role": "assistant", "content": None}],
     "data.messages_field='messages' message 2 (assistant) has no content"),
])
def test_a_row_that_is_not_a_conversation_is_refused_naming_its_file_and_line(tmp_path, bad, says):
    """Two files, a blank line: the line is the line of the file, 1-based, not an index into all rows."""
    folder = tmp_path / "chats"
    folder.mkdir()
    write_lines(folder / "a.jsonl", [{"messages": [U, A]}] * 5)
    write_lines(folder / "b.jsonl", [{"messages": [U, A]}, None, {"messages": [U, A]}, {"messages": bad}])
    with pytest.raises(ConfigError, match=re.escape(f"{folder / 'b.jsonl'}:4: {says}")):
        examples("data=chat", f"data.path={folder}")


def test_a_row_the_template_refuses_is_refused_with_the_templates_message(tmp_path):
    template = tmp_path / "strict.jinja"
    template.write_text(STRICT_TEMPLATE)
    path = write_lines(tmp_path / "chat.jsonl", [{"messages": [U, A]}] * 3 + [{"messages": [U, U, A]}])
    with pytest.raises(ConfigError, match=re.escape(
            f"{path}:4: the chat template cannot render this conversation (TemplateError: Conversation roles "
            "must alternate user/assistant/user/assistant/...)")):
        examples("data=chat", f"data.path={path}", f"data.chat_template={template}")


@pytest.mark.slow
def test_a_refused_row_is_one_line_from_the_command_line(tmp_path):
    template = tmp_path / "strict.jinja"
    template.write_text(STRICT_TEMPLATE)
    path = write_lines(tmp_path / "chat.jsonl", [{"messages": [U, A]}] * 3 + [{"messages": [A, U, A]}])
    done = warm(1, ["+preset=smoke", "data=chat", f"data.path={path}",
                   f"data.chat_template={template}", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, check=False)
    errors = [line for line in done.stderr.splitlines() if line.startswith("trainloop: error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
    assert f"{path}:4: the chat template cannot render this conversation" in errors[0]
    assert "Traceback" not in done.stderr


def test_a_prompt_completion_row_without_text_is_named_by_its_line(tmp_path):
    pair = {"prompt": "Q: 1+1?", "completion": " A: 2."}
    path = write_lines(tmp_path / "pairs.jsonl", [pair, None, pair, {"prompt": "Q: 2+2?"}, pair])
    with pytest.raises(ConfigError, match=re.escape(f"{path}:4: data.completion_field='completion' has no text "
                                                    "there (nor in 0 more rows)")):
        examples("data=prompt_completion", f"data.path={path}")


# --- rows whose unread fields differ (acceptance 5) -----------------------------------------------

@pytest.mark.parametrize("option", ["files", "chat"])
def test_a_folder_of_jsonl_files_with_differing_extra_fields_trains(tmp_path, option):
    from pydoc_data.topics import topics

    folder = tmp_path / "data"
    folder.mkdir()
    texts = [topics[k] for k in sorted(topics)[:40]]
    row = (lambda t: {"text": t}) if option == "files" else (lambda t: {"messages": [U, {**A, "content": t[:200]}]})
    write_lines(folder / "a.jsonl", [{**row(t), "id": i} for i, t in enumerate(texts[:20])])
    write_lines(folder / "b.jsonl", [{**row(t), "id": f"b{i}", "source": {"url": "x", "tags": [1, 2]}}
                                     for i, t in enumerate(texts[20:])])
    run = train(tmp_path / "run", f"data={option}", f"data.path={folder}", "data.seq_len=64")
    assert [m["step"] for m in read_metrics(run) if "loss" in m] == [1, 2, 3, 4]


def test_a_30mb_jsonl_whose_late_rows_carry_other_fields_loads(tmp_path):
    """`datasets` infers the columns from the first 10 MB: a later row with another field, or a field of
    another type, made the whole (valid) file 'cannot be read as json'."""
    path = tmp_path / "big.jsonl"
    body = "Lorem ipsum dolor sit amet. " * 36  # ~1 kB a row
    with path.open("w") as f:
        for i in range(30_000):
            row = {"text": f"{i} {body}", "id": i}
            if i >= 29_000:
                row.update(id=f"late-{i}", meta={"kind": ["x", 1]})
            f.write(json.dumps(row) + "\n")
    assert path.stat().st_size > 29e6
    rows = examples("data=files", f"data.path={path}")
    assert len(rows) == 30_000 and rows.column_names == ["text"] and rows[29_999]["text"].startswith("29999 ")


def test_a_read_column_of_another_type_is_refused_naming_its_file_and_line(tmp_path):
    path = write_lines(tmp_path / "corpus.jsonl", [{"text": "fine"}, {"text": "also fine"}, None, {"text": 42}])
    with pytest.raises(ConfigError, match=re.escape(f"{path}:4: data.text_field='text' holds a number, not text")):
        examples("data=files", f"data.path={path}")


def test_a_json_array_file_names_the_line_its_row_starts_on(tmp_path):
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([{"messages": [U, A]}, {"messages": [U, {"role": "bot", "content": "x"}]}], indent=2))
    start = path.read_text().splitlines().index("  {", 2) + 1  # the second object's first line
    with pytest.raises(ConfigError, match=re.escape(f"{path}:{start}: data.messages_field='messages' message 2 "
                                                    "has role 'bot'")):
        examples("data=chat", f"data.path={path}")


@pytest.mark.parametrize("kind", ["parquet", "csv"])
def test_parquet_and_csv_files_with_differing_extra_columns_load(tmp_path, kind):
    import pandas as pd

    folder = tmp_path / "data"
    folder.mkdir()
    frames = [pd.DataFrame({"text": ["one", "two"], "id": [1, 2]}),
              pd.DataFrame({"text": ["three"], "id": ["c"], "score": [0.5]})]
    for i, frame in enumerate(frames):
        if kind == "parquet":
            frame.to_parquet(folder / f"{i}.parquet")
        else:
            frame.to_csv(folder / f"{i}.csv", index=False)
    rows = examples("data=files", f"data.path={folder}")
    assert rows["text"] == ["one", "two", "three"] and rows.column_names == ["text"]
