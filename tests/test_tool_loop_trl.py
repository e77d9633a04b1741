"""objective=grpo with tools against TRL 1.16 (issue 38, acceptance check 3): a multi-turn rollout (the
model's tool calls answered, the model asked again) gives TRL's completion ids and completion (tool) mask
on the same conversation. TRL's own GRPOTrainer._tool_call_loop and _get_tool_suffix_ids run beside
trainloop's take_turns, from the same prompt, the same first turn and the same model.

Real parts only: the built-in byte-level tokenizer and chat template (given, for TRL's parse_response, a
response template for the template's `<tool_call>...</tool_call>` turns ending in `<|endoftext|>`), tools
loaded by file path, and one tiny transformers Llama whose greedy generation writes the later turns on
both sides. TRL's trainer is not built: its loop runs on a stand-in holding the state it reads.
Where the two differ, the test says so and pins it: the exact-budget rule, and the replies that do not
fit, which the reward functions still get here (TRL drops them; issue 58, item 2).
"""

from __future__ import annotations

import copy
import functools
import json
import sys
import types
from pathlib import Path

import pytest
import torch
from helpers import compose

from trainloop.data.chat_template import BUILTIN_CHAT_TEMPLATE, BUILTIN_RESPONSE_TEMPLATE

TOOLS = Path(__file__).resolve().parent / "data" / "grpo_tools.py"
# The completion's tokens (TRL's max_completion_length), well away from every case's boundary: at exactly the
# boundary the two differ by design (TRL keeps the replies where completion + replies == the budget, then
# generates nothing; trainloop ends the rollout where the replies leave no room for one more token), pinned by
# the last test.
BUDGET = 320

def written(*calls: tuple[str, dict]) -> str:
    """A model turn that makes these calls, as the built-in template writes them."""
    return "".join(f'<tool_call>{{"name": {json.dumps(name)}, "arguments": {json.dumps(arguments)}}}</tool_call>'
                   for name, arguments in calls)


@pytest.fixture(scope="module")
def parts():
    """The tokenizer (with TRL's response parsing), the tools and the tiny model, shared by the cases."""
    from trainloop.data.tokenizer import byte_level_tokenizer
    from trainloop.model.builder import build_model, build_model_config
    from trainloop.objectives.tools import load_tools

    tokenizer = byte_level_tokenizer()
    tokenizer.response_template = BUILTIN_RESPONSE_TEMPLATE  # TRL's parse_response reads it
    cfg = compose("+preset=smoke")
    torch.manual_seed(0)
    model = build_model(cfg.model, build_model_config(cfg.model, len(tokenizer))).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 64-wide model's generation: threads only wait on each other
    yield tokenizer, load_tools([f"{TOOLS}:lookup", f"{TOOLS}:broken"]), model
    torch.set_num_threads(threads)


def greedy(model, rows: list[list[int]], limits: list[int], eos: int) -> list[list[int]]:
    """The model's greedy turn after each row, at most `limits[i]` tokens, cut after its first end-of-text:
    the one generation both sides are given."""
    turns = []
    for row, limit in zip(rows, limits):
        ids = torch.tensor([row])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=limit, do_sample=False,
                                 use_cache=True, eos_token_id=eos, pad_token_id=eos)[0, len(row):].tolist()
        turns.append(out[:out.index(eos) + 1] if eos in out else out)
    return turns


def both(parts, first_texts: list[str], budget: int):
    """The rollouts of TRL's _tool_call_loop and of trainloop's take_turns from the same prompts (rendered with
    the tools' schemas, as TRL's _tokenize_prompts renders them) and the same written first turns."""
    from trl import GRPOTrainer
    from trl.chat_template_utils import parse_response

    from trainloop.objectives.tools import take_turns

    tokenizer, tools, model = parts
    eos = tokenizer.eos_token_id
    prompts = [[{"role": "user", "content": f"Look things up ({i})."}] for i in range(len(first_texts))]
    prompt_ids = [tokenizer.apply_chat_template(p, tools=list(tools.values()), chat_template=BUILTIN_CHAT_TEMPLATE,
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
                  for p in prompts]
    first = [tokenizer(text, add_special_tokens=False)["input_ids"] + [eos] for text in first_texts]
    # TRL's _generate parses the first turns so (the tools type the calls' arguments)
    completions = [[parse_response(tokenizer, ids, prefix=prompt, tools=list(tools.values()))]
                   for ids, prompt in zip(first, prompt_ids)]
    stand_in = types.SimpleNamespace(
        _sync_tool_dicts=[dict(tools) for _ in prompts], _async_tool_dicts=[{} for _ in prompts],
        max_tool_calling_iterations=sys.maxsize,  # TRL's max_tool_calling_iterations=None
        processing_class=tokenizer, _tokenizer=tokenizer, chat_template=BUILTIN_CHAT_TEMPLATE,
        chat_template_kwargs={}, _is_vlm=False, use_vllm=False, model=model, max_completion_length=budget,
        environment_factories=None, tools=list(tools.values()),
        # TRL's transformers path generates max_completion_length tokens; its loop cuts what overflows the budget
        _generate_single_turn=lambda rows, images, fields, num_generations, has_tool_images=False: (
            greedy(model, rows, [budget] * len(rows), eos), None))
    stand_in._get_tool_suffix_ids = functools.partial(GRPOTrainer._get_tool_suffix_ids, stand_in)
    trl = GRPOTrainer._tool_call_loop(stand_in, copy.deepcopy(prompts), [list(p) for p in prompt_ids],
                                      [list(f) for f in first], copy.deepcopy(completions), None, None, None)
    tool_mask, trl_completions, completion_ids, _, calls, failures, _ = trl
    turns = take_turns(prompt_ids, first, lambda which, rows, room: greedy(model, rows, room, eos), lambda n: n > 0,
                       tokenizer, BUILTIN_CHAT_TEMPLATE, [dict(tools) for _ in prompts], None, 5.0, budget)
    return completions, (completion_ids, tool_mask, trl_completions, calls, failures), turns


def tool_messages(messages: list[dict]) -> list[dict]:
    return [m for m in messages if m["role"] == "tool"]


def made_calls(messages: list[dict]) -> list[list[dict]]:
    return [m.get("tool_calls") for m in messages if m["role"] == "assistant"]


CASES = {
    "one call": ([("lookup", {"key": "alpha"})], ["417"]),
    "two calls in one turn": ([("lookup", {"key": "alpha"}), ("lookup", {"key": "beta"})], ["417", "92"]),
    "failing calls": ([("broken", {"key": "a"}), ("nope", {})],  # a tool that raises, one that is not a tool
                      [str({"error": "'no table for a'"}), str({"error": "Tool nope not found."})]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_multi_turn_rollout_gives_trls_completion_and_tool_mask(parts, case):
    """Two rollouts: the first answers in plain text (no call, nothing to do), the second makes the case's
    calls; TRL's loop and take_turns answer them, then the model writes its next turn (here it runs to the
    budget, which both cut at the same token). Ids, mask, replies and counts are TRL's."""
    calls, replies = CASES[case]
    first_messages, (completion_ids, tool_mask, trl_messages, trl_calls, trl_failures), turns = \
        both(parts, ["No tool is needed.", written(*calls)], BUDGET)
    expected_calls = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    assert first_messages[1][0]["tool_calls"] == expected_calls, "TRL's parse_response fell back to plain text"
    assert "tool_calls" not in first_messages[0][0]
    for i in range(2):
        assert turns[i].ids == completion_ids[i]
        assert turns[i].trained == tool_mask[i]
        assert tool_messages(turns[i].messages) == tool_messages(trl_messages[i])
        assert made_calls(turns[i].messages) == made_calls(trl_messages[i])
        # the model's texts, stripped as TRL's parser strips them ("text" content)
        assert [m["content"] for m in turns[i].messages if m["role"] == "assistant"] == \
            [m["content"] for m in trl_messages[i] if m["role"] == "assistant"]
    assert turns[0].ids == completion_ids[0] and set(tool_mask[0]) == {1}  # the plain answer is left as it was
    assert [m["content"] for m in tool_messages(turns[1].messages)] == replies
    assert sum(t.calls for t in turns) == trl_calls == len(calls)
    assert sum(t.failed for t in turns) == trl_failures == (len(calls) if case == "failing calls" else 0)
    tokenizer = parts[0]
    reply = tokenizer.decode([t for t, m in zip(turns[1].ids, turns[1].trained) if m == 0])
    assert reply == "".join(f"\n<|tool|>\n{r}<|endoftext|>" for r in replies) + "\n<|assistant|>\n"
    assert turns[1].trained[-1] == 1 and turns[1].messages[-1]["role"] == "assistant"  # the model's next turn


def reply_length(parts, calls, replies) -> int:
    from trainloop.objectives.tools import reply_ids

    tokenizer = parts[0]
    return len(reply_ids(tokenizer, BUILTIN_CHAT_TEMPLATE,
                         [{"role": "tool", "name": n, "content": r} for (n, _), r in zip(calls, replies)]))


def test_replies_that_do_not_fit_leave_the_completion_as_it_was(parts):
    """The budget holds the first turn (two calls, both failing) and half their replies: both end the rollout,
    the completion the first turn, all of it trained, and count the calls run and their failures (TRL's
    tools/call_frequency and tools/failure_frequency). The one difference, by design: TRL drops the replies
    from the messages; take_turns keeps them there, marking the rollout cut, so that the reward functions see
    what the tools answered (a user's vault environment had run the call, and its reward saw none)."""
    calls, replies = CASES["failing calls"]
    text = written(*calls)
    first = len(parts[0](text, add_special_tokens=False)["input_ids"]) + 1
    budget = first + reply_length(parts, calls, replies) // 2
    first_messages, (completion_ids, tool_mask, trl_messages, trl_calls, trl_failures), turns = \
        both(parts, [text], budget)
    assert turns[0].ids == completion_ids[0] and len(completion_ids[0]) == first
    assert turns[0].trained == tool_mask[0] == [1] * first
    assert turns[0].messages[:1] == trl_messages[0] == first_messages[0]  # the calls; TRL has no reply after them
    assert [m["content"] for m in tool_messages(turns[0].messages)] == replies
    assert len(turns[0].messages[0]["tool_calls"]) == 2 and turns[0].ended
    assert (trl_calls, trl_failures) == (turns[0].calls, turns[0].failed) == (2, 2)


def test_at_exactly_the_budget_trl_keeps_the_replies_and_trainloop_ends_the_rollout(parts):
    """The one rule on which the two differ, by design: where the first turn and the replies fill the budget
    exactly, TRL keeps the replies (completion + replies == max_completion_length is not overlong) and then
    generates nothing; take_turns ends the rollout there, as the replies leave no room for one more token."""
    calls, replies = CASES["one call"]
    text = written(*calls)
    first = len(parts[0](text, add_special_tokens=False)["input_ids"]) + 1
    replied = reply_length(parts, calls, replies)
    _, (completion_ids, tool_mask, _, _, _), turns = both(parts, [text], first + replied)
    assert completion_ids[0][:first] == turns[0].ids and len(completion_ids[0]) == first + replied
    assert tool_mask[0] == [1] * first + [0] * replied and turns[0].trained == [1] * first
