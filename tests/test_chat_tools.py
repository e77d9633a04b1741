"""Tool-calling conversations in SFT (issue 38, item 1): assistant `tool_calls` (content null or
missing), `tool` messages and a `tools` column of JSON schemas, rendered by the template's own tool
support as TRL's SFT renders them; the loss is on the assistant's turns, their calls included.

Real parts only: `datasets` reading jsonl and parquet, the built-in byte-level tokenizer with the
built-in template and with TRL's Qwen2.5 templates (plain and with {% generation %} markers) from
disk, TRL's SFTTrainer preparing its own dataset, and an in-process run of trainloop.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from pathlib import Path

import pytest
from helpers import compose, conversation, read_metrics, reset_accelerate, train, warm, write_rows

from trainloop.config.compose import ConfigError, validate
from trainloop.data.chat_template import BUILTIN_CHAT_TEMPLATE, parse_tool_calls
from trainloop.data.formats.chat import message_problem

EOS = "<|endoftext|>"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}
TOOLS = [WEATHER, ADD]

# A call with null content (OpenAI's form); content and two calls, one with JSON-string arguments
# (OpenAI's), one flat, answered by two tool replies in a row; a row without tools.
ADDING = [{"role": "user", "content": "What is 2 + 3?"},
          {"role": "assistant", "content": None,
           "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
          {"role": "tool", "content": "5"},
          {"role": "assistant", "content": "2 + 3 = 5."}]
WEATHERS = [{"role": "system", "content": "Use the tools."},
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": "Checking both.", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"name": "get_weather", "arguments": {"city": "Rome"}}]},
            {"role": "tool", "content": "18C"},
            {"role": "tool", "content": "21C"},
            {"role": "assistant", "content": "Paris 18C, Rome 21C."}]
PLAIN = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
ROWS = [{"messages": ADDING, "tools": TOOLS}, {"messages": WEATHERS, "tools": [WEATHER]}, {"messages": PLAIN}]

# What the built-in template renders for ADDING, and the assistant's turns in it (the targets).
ADDING_TEXT = (
    "<|tools|>\n<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(ADD) + f"\n</tools>{EOS}\n"
    f"<|user|>\nWhat is 2 + 3?{EOS}\n"
    f'<|assistant|>\n<tool_call>{{"name": "add", "arguments": {{"a": 2, "b": 3}}}}</tool_call>{EOS}\n'
    f"<|tool|>\n5{EOS}\n"
    f"<|assistant|>\n2 + 3 = 5.{EOS}\n")
TARGETS = {
    "adding": ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' + EOS + "\n",
               f"2 + 3 = 5.{EOS}\n"],
    "weathers": ['Checking both.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
                 '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>' + EOS + "\n",
                 f"Paris 18C, Rome 21C.{EOS}\n"],
    "plain": [f"Hello.{EOS}\n"],
}
# The built-in template before tools (trainloop 2026-11): what it renders must not change.
TEMPLATE_BEFORE_TOOLS = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
QWEN = Path(__import__("trl").__file__).parent / "chat_templates"


def tokenizer():
    from trainloop.data.loaders import byte_level_tokenizer

    return byte_level_tokenizer()


def tokenized(*overrides: str):
    """Each row's input_ids and labels as a run tokenizes them (the format's own loader and row tokenizer)."""
    from trainloop.data.loaders import build_tokenizer, load_examples, tokenize_examples

    cfg = compose("+preset=smoke", "data=chat", *overrides)
    validate(cfg)
    run_tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.model.name_or_path)
    rows = tokenize_examples(cfg.data, run_tokenizer, load_examples(cfg.data, run_tokenizer))
    return rows["input_ids"], rows["labels"]


def target_runs(ids: list[int], labels: list[int]) -> list[str]:
    """The decoded runs of consecutive target tokens."""
    runs, run = [], []
    for token, label in zip(ids, labels):
        if label != -100:
            assert label == token
            run.append(token)
        elif run:
            runs, run = runs + [run], []
    return [tokenizer().decode(r) for r in runs + ([run] if run else [])]


def test_a_tool_calling_row_renders_with_the_built_in_template_and_trains_the_assistants_turns(tmp_path):
    path = write_rows(tmp_path / "tools.jsonl", ROWS)
    ids, labels = tokenized(f"data.path={path}")
    assert tokenizer().decode(ids[0]) == ADDING_TEXT
    assert [target_runs(i, lab) for i, lab in zip(ids, labels)] == list(TARGETS.values())
    text = tokenizer().decode(ids[1])  # the second row's tools alone; its tool replies are context
    assert text.startswith("<|tools|>\n<tools>\n" + json.dumps(WEATHER) + f"\n</tools>{EOS}\n<|system|>\n")
    assert f"<|tool|>\n18C{EOS}\n<|tool|>\n21C{EOS}\n" in text
    assert tokenizer().decode(ids[2]) == f"<|user|>\nHi{EOS}\n<|assistant|>\nHello.{EOS}\n"

    all_ids, all_labels = tokenized(f"data.path={path}", "data.train_on=all")
    assert all_ids == ids and all_labels == ids


def test_null_or_missing_content_is_accepted_beside_tool_calls():
    call = [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]
    user = {"role": "user", "content": "1?"}
    assert message_problem([user, {"role": "assistant", "content": None, "tool_calls": call}]) is None
    assert message_problem([user, {"role": "assistant", "tool_calls": call}]) is None
    assert "has no content" in message_problem([user, {"role": "assistant", "content": None, "tool_calls": []}])


def test_tools_as_json_text_and_parquets_structs_render_as_the_jsonl_rows(tmp_path):
    """TRL reads a tools column of JSON text; parquet gives lists of objects back as structs holding
    every row's keys (null where a row lacks one): both render as the jsonl rows do."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    want = tokenized(f"data.path={write_rows(tmp_path / 'tools.jsonl', ROWS)}")
    as_text = [{**row, "tools": json.dumps(row["tools"])} if "tools" in row else row for row in ROWS]
    assert tokenized(f"data.path={write_rows(tmp_path / 'text.jsonl', as_text)}") == want

    parquet = tmp_path / "tools.parquet"
    rows = copy.deepcopy(ROWS)
    paris = rows[1]["messages"][2]["tool_calls"][0]["function"]
    paris["arguments"] = json.loads(paris["arguments"])  # one type for the column: every call's arguments objects
    table = pa.Table.from_pylist(rows)
    # structs: each tool lists every tool's parameters, each call every call's arguments, null where it has none
    assert pa.types.is_struct(table.schema.field("tools").type.value_type)
    pq.write_table(table, parquet)
    assert tokenized(f"data.path={parquet}") == want


@pytest.mark.parametrize("message, says", [
    ({"role": "assistant", "content": None, "tool_calls": {"name": "add"}},
     "message 2 (assistant) has 'tool_calls' that are an object, not a list of"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": {}}}]},
     "message 2 (assistant) tool call 1 has no function name; a tool call is "
     '{"type": "function", "function": {"name": ..., "arguments": {...}}}'),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "a=1"}}]},
     "message 2 (assistant) tool call 1 of 'add' has 'arguments' text that is not a JSON object ('a=1')"),
    ({"role": "assistant", "tool_calls": [{"name": "add", "arguments": 7}]},
     "message 2 (assistant) tool call 1 of 'add' has 'arguments' that are a number, not an object"),
    ({"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "add", "arguments": {}}}]},
     "message 2 (assistant) tool call 1 has type 'code'; the only type is 'function'"),
    ({"role": "user", "content": "x", "tool_calls": [{"name": "add", "arguments": {}}]},
     "message 2 (user) has 'tool_calls'; only the assistant's messages call tools"),
    ({"role": "tool", "content": None}, "message 2 (tool) has no content; every message needs a text 'content'"),
    ({"role": "tool", "content": {"temperature": 18}}, "message 2 (tool) has a content that is an object, not text"),
])
def test_a_malformed_tool_call_is_refused_naming_the_row_and_message(tmp_path, message, says):
    rows = [{"messages": ADDING, "tools": TOOLS}] * 2 + [{"messages": [ADDING[0], message, *ADDING[2:]]}]
    path = write_rows(tmp_path / "tools.jsonl", rows)
    with pytest.raises(ConfigError, match=re.escape(f"{path}:3: data.messages_field='messages' {says}")):
        tokenized(f"data.path={path}")


@pytest.mark.parametrize("tools, says", [
    ("get_weather", "is text that is not JSON ('get_weather'); give a list of {\"type\": \"function\""),
    ({"get_weather": WEATHER}, "is an object, not a list of"),
    ([WEATHER, {"type": "function", "function": {"description": "nameless"}}],
     "tool 2 has no function name; a tool is"),
    ([{"type": "function", "function": {"name": "f", "parameters": "city"}}],
     "tool 'f' has 'parameters' that are not an object (a JSON schema)"),
    (["get_weather"], "tool 1 is not a tool schema"),
])
def test_a_bad_tools_value_is_refused_naming_the_row_and_key(tmp_path, tools, says):
    path = write_rows(tmp_path / "tools.jsonl", [ROWS[0], ROWS[2], {"messages": ADDING, "tools": tools}])
    with pytest.raises(ConfigError, match=re.escape(f"{path}:3: data.tools_field='tools' {says}")):
        tokenized(f"data.path={path}")


def test_a_tools_column_named_but_missing_is_refused_and_the_default_may_be_missing(tmp_path):
    path = write_rows(tmp_path / "chat.jsonl", [{"messages": PLAIN}] * 3)
    ids, _ = tokenized(f"data.path={path}")
    assert tokenizer().decode(ids[0]) == f"<|user|>\nHi{EOS}\n<|assistant|>\nHello.{EOS}\n"
    with pytest.raises(ConfigError, match=re.escape("data.tools_field='functions' is not a column of")):
        tokenized(f"data.path={path}", "data.tools_field=functions")
    renamed = write_rows(tmp_path / "renamed.jsonl", [{"messages": ADDING, "functions": TOOLS}])
    ids, _ = tokenized(f"data.path={renamed}", "data.tools_field=functions")
    assert tokenizer().decode(ids[0]) == ADDING_TEXT


def test_parse_tool_calls_reads_back_what_the_built_in_template_renders():
    reply = {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2]}}},
        {"name": "add", "arguments": {"a": 1.5, "b": {"nested": None}}}]}
    text = tokenizer().apply_chat_template([ADDING[0], reply], chat_template=BUILTIN_CHAT_TEMPLATE, tokenize=False)
    completion = text.split("<|assistant|>\n", 1)[1].removesuffix(f"{EOS}\n")
    assert parse_tool_calls(completion) == ("Checking.", [
        {"name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2]}},
        {"name": "add", "arguments": {"a": 1.5, "b": {"nested": None}}}])
    assert parse_tool_calls("No call.") == ("No call.", [])

    # malformed blocks stay in the text as written; a JSON-string "arguments" is decoded
    bad = ('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>A'
           '<tool_call>{"name": "add"}</tool_call>'
           '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}</tool_call>B<tool_call>{"name": "cut')
    assert parse_tool_calls(bad) == (
        '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>A<tool_call>{"name": "add"}</tool_call>'
        'B<tool_call>{"name": "cut', [{"name": "add", "arguments": {"a": 2}}])


def test_without_tools_the_built_in_template_renders_as_before():
    conversations = [conversation(i) for i in range(12)] + [PLAIN, [{"role": "user", "content": "{{ x }} <|a|>"}]]
    for messages in conversations:
        for prompt in (False, True):
            before = tokenizer().apply_chat_template(messages, chat_template=TEMPLATE_BEFORE_TOOLS, tokenize=False,
                                                     add_generation_prompt=prompt)
            for tools in (None, []):
                assert tokenizer().apply_chat_template(messages, chat_template=BUILTIN_CHAT_TEMPLATE, tools=tools,
                                                       tokenize=False, add_generation_prompt=prompt) == before


def test_qwen2_5s_template_renders_the_tools_and_its_marked_form_trains_what_the_unmarked_does(tmp_path):
    """TRL's Qwen2.5 template (which closes a run of tool replies after its last) trains the
    assistant's turns with their calls; its training form with {% generation %} markers trains the
    same text as transformers' assistant mask (Qwen's marks start at the newline after the header)."""
    path = write_rows(tmp_path / "tools.jsonl", ROWS)
    ids, labels = tokenized(f"data.path={path}", f"data.chat_template={QWEN / 'qwen2_5.jinja'}")
    text = tokenizer().decode(ids[1])
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert "<tool_response>\n18C\n</tool_response>\n<tool_response>\n21C\n</tool_response><|im_end|>" in text
    runs = [target_runs(i, lab) for i, lab in zip(ids, labels)]
    assert runs[1] == ['Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                       '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
                       '</tool_call><|im_end|>\n', "Paris 18C, Rome 21C.<|im_end|>\n"]

    marked_ids, marked_labels = tokenized(f"data.path={path}", f"data.chat_template={QWEN / 'qwen2_5_training.jinja'}")
    assert marked_ids == ids
    marked_runs = [target_runs(i, lab) for i, lab in zip(marked_ids, marked_labels)]
    assert marked_runs == [["\n" + r for r in row] for row in runs]


def test_trl_sft_trains_the_tokens_trainloop_trains_on_tool_calling_rows(tmp_path):
    """TRL's SFTTrainer (assistant_only_loss, Qwen2.5's template swapped for its training form) on
    the same rows, its tools column as JSON text: trainloop's input_ids and labels, token for token."""
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    rows = [{"messages": ADDING, "tools": TOOLS}, {"messages": [ADDING[0], {**ADDING[1], "content": "Adding."},
                                                                *ADDING[2:]], "tools": [ADD]}]
    qwen = tokenizer()
    qwen.chat_template = (QWEN / "qwen2_5.jinja").read_text()
    qwen.save_pretrained(tmp_path / "qwen")
    qwen = AutoTokenizer.from_pretrained(tmp_path / "qwen")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(qwen), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    args = SFTConfig(output_dir=str(tmp_path / "trl"), assistant_only_loss=True, max_length=None, packing=False,
                     report_to="none", use_cpu=True)
    trainer = SFTTrainer(model=model, args=args, processing_class=qwen, train_dataset=Dataset.from_list(
        [{"messages": row["messages"], "tools": json.dumps(row["tools"])} for row in rows]))
    path = write_rows(tmp_path / "tools.jsonl", rows)
    ids, labels = tokenized(f"data.path={path}", f"data.tokenizer={tmp_path / 'qwen'}",
                            f"data.chat_template={QWEN / 'qwen2_5_training.jinja'}")
    assert ids == trainer.train_dataset["input_ids"]
    assert labels == trainer.train_dataset["labels"]
    assert any("<tool_call>" in tokenizer().decode([t for t in row if t != -100]) for row in labels)


def test_a_template_without_tool_support_is_said(tmp_path, caplog):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    path = write_rows(tmp_path / "tools.jsonl", ROWS)
    with caplog.at_level(logging.WARNING, logger="trainloop"):
        tokenized(f"data.path={path}", f"data.chat_template={template}")
    assert "the chat template renders no tools (data.tools_field='tools')" in caplog.text


def test_a_seq_len_that_cuts_the_answers_warns_with_the_share_of_target_tokens_lost(tmp_path, caplog):
    """Issue 58, item 8: rows whose tool schemas fill most of data.seq_len keep a few of their answers'
    tokens; the warning gives the share of the target tokens lost (counted here from the rows as
    tokenized), the rows left with none, the longest row and the data.seq_len that would hold it."""
    from trainloop.build import build
    from trainloop.parallel import build_strategy
    from trainloop.parallel.accelerator import build_accelerator

    path = write_rows(tmp_path / "tools.jsonl", ROWS * 4)
    ids, labels = tokenized(f"data.path={path}")
    seq_len = len(ids[0]) - 5  # inside the first row's last answer
    lost = total = emptied = 0
    for row in labels:
        targets = [i for i, label in enumerate(row) if label != -100 and i > 0]
        total, lost = total + len(targets), lost + sum(i >= seq_len for i in targets)
        emptied += bool(targets) and all(i >= seq_len for i in targets)
    cut = sum(len(row) > seq_len for row in ids)
    assert 0 < lost < total and cut
    cfg = compose("+preset=smoke", "data=chat", f"data.path={path}", f"data.seq_len={seq_len}", "model.max_position_embeddings=1024")
    validate(cfg)
    reset_accelerate()
    with caplog.at_level(logging.WARNING, logger="trainloop"):
        build(cfg, build_strategy(cfg, build_accelerator(cfg)))
    longest = max(len(row) for row in ids)
    assert (f"data: data.seq_len={seq_len} (data.overlong=truncate) cuts {100 * lost / total:.0f}% of the target "
            f"tokens, the ones trained on: {cut} of {len(ids)} rows lose some, {emptied} keep none; the longest row has "
            f"{longest} tokens, so data.seq_len={longest} would hold every row") in caplog.text, caplog.text


def test_inspect_prints_the_rows_as_the_model_sees_them_with_the_trained_tokens_marked(tmp_path):
    """Issue 58, item 11: `python -m trainloop.inspect` with a run's overrides prints each row rendered, its
    trained tokens between [[ and ]], its lengths and what data.seq_len cuts; exit 0, nothing trained."""
    path = write_rows(tmp_path / "tools.jsonl", ROWS)
    ids, labels = tokenized(f"data.path={path}")
    seq_len = len(ids[0]) - 5
    done = warm(1, ["data=chat", f"data.path={path}", f"data.seq_len={seq_len}", "--rows", "3"], cwd=tmp_path,
                module="trainloop.inspect")
    rows = done.stdout.removesuffix("\n").split("\n\n")
    assert len(rows) == 3, done.stdout
    trained = [sum(label != -100 for label in row) for row in labels]
    lost = sum(label != -100 for label in labels[0][seq_len:])
    assert rows[0].startswith(f"--- row 0: {len(ids[0])} tokens, {trained[0]} trained; longer than data.seq_len="
                              f"{seq_len}: cut at >8 (data.overlong=truncate), {lost} of its {trained[0]} trained "
                              "tokens lost\n")
    assert rows[2] == (f"--- row 2: {len(ids[2])} tokens, {trained[2]} trained\n<|user|>\nHi{EOS}\n<|assistant|>\n"
                       f"[[Hello.{EOS}\n]]")
    assert f"[[{TARGETS['adding'][0]}]]" in rows[0] and " >8 " in rows[0]
    assert not list(tmp_path.glob("outputs")) and not list(tmp_path.rglob("metrics.jsonl"))


def test_a_short_run_trains_on_tool_calling_conversations(tmp_path):
    path = write_rows(tmp_path / "tools.jsonl", ROWS * 8)
    run = train(tmp_path / "run", "data=chat", f"data.path={path}", "trainer.max_steps=3", "data.seq_len=512",
                "trainer.eval_every=3", "trainer.eval_batches=1")
    losses = [m["loss"] for m in read_metrics(run) if "loss" in m]
    assert len(losses) == 3 and all(0 < loss < 10 for loss in losses)
    saved = json.loads((run / "final" / "tokenizer_config.json").read_text()).get("chat_template") or (
        run / "final" / "chat_template.jinja").read_text()
    assert saved == BUILTIN_CHAT_TEMPLATE  # final/ prompts with tools as the run trained
