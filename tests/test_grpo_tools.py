"""objective=grpo with tools (issue 38, item 2): a rollout's tool calls are run and answered, the
model asked again; a tool that raises, hangs or is not one becomes a reply, never a crash; the
replies and the prompt get no loss and no advantage; the prompts carry the tools' JSON schemas.

Real parts only: the composed config, the built-in byte-level tokenizer and chat template, a tiny
transformers Llama generating the model's later turns, tools loaded by file path.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from helpers import compose, read_metrics, reset_accelerate, train, write_rows
from trainloop.config.compose import ConfigError, check_command_line, validate

DATA = Path(__file__).resolve().parent / "data"
TOOLS = DATA / "grpo_tools.py"
REWARDS = DATA / "grpo_rewards.py"
GRPO = ["data=prompts", "objective=grpo", f"objective.rewards=[{REWARDS}:letters]"]
CALL = '<tool_call>{"name": "lookup", "arguments": {"key": "alpha"}}</tool_call>'


def test_a_tool_that_raises_hangs_takes_other_arguments_or_is_not_one_is_answered():
    from trainloop.objectives.tools import call_tool, load_tools

    tools = load_tools([f"{TOOLS}:lookup", f"{TOOLS}:broken", f"{TOOLS}:hangs", f"{TOOLS}:reports"])
    assert call_tool(tools, {"name": "lookup", "arguments": {"key": "alpha"}}, 1.0) == ("417", False)
    assert call_tool(tools, {"name": "broken", "arguments": {"key": "a"}}, 1.0) == (
        str({"error": "'no table for a'"}), True)
    started = time.monotonic()
    reply = call_tool(tools, {"name": "hangs", "arguments": {"key": "a"}}, 0.5)
    assert time.monotonic() - started < 5, "the hung tool was waited for"
    assert reply == (str({"error": "Tool hangs did not answer within objective.tool_timeout_s=0.5 s."}), True)
    assert call_tool(tools, {"name": "nope", "arguments": {}}, 1.0) == (str({"error": "Tool nope not found."}), True)
    reply, failed = call_tool(tools, {"name": "lookup", "arguments": {"name": "alpha"}}, 1.0)
    assert failed and reply.startswith("{'error':") and "unexpected keyword argument 'name'" in reply
    # a tool whose answer is an error of its own has not failed (TRL counts what raised)
    reply = call_tool(tools, {"name": "reports", "arguments": {"key": "a"}}, 1.0)
    assert reply == (str({"error": "not stored"}), False)


@pytest.mark.parametrize("overrides, says", [
    ([f"objective.tools=[{TOOLS}:undocumented]"],
     rf"objective.tools\[0\]='{TOOLS}:undocumented': no JSON schema can be made of undocumented"),
    ([f"objective.tools=[{TOOLS}:lookup,{TOOLS}:lookup]"], r"objective.tools\[1\]=.*a second tool named lookup"),
    ([f"objective.tools=[{TOOLS}:missing]"], rf"objective.tools\[0\]='{TOOLS}:missing': .* has no function missing"),
    ([f"objective.tools=[{TOOLS}:lookup]", "objective.max_tool_calls=0"], r"objective.max_tool_calls=0 must be 1"),
    ([f"objective.tools=[{TOOLS}:lookup]", "objective.tool_timeout_s=0"], r"objective.tool_timeout_s=0.0 must be"),
])
def test_what_cannot_work_is_refused_naming_the_key(overrides, says):
    with pytest.raises(ConfigError, match=rf"\n  {says}"):
        validate(compose("+preset=smoke", *GRPO, *overrides, f"data.path={DATA / 'prompts.jsonl'}"))


def test_the_tool_keys_are_read_only_with_tools():
    with pytest.raises(ConfigError, match="objective.tool_timeout_s=5.0 has no effect unless objective=grpo with "
                                          "objective.tools names some"):
        check_command_line(compose("+preset=smoke", *GRPO, "objective.tool_timeout_s=5"),
                           ["objective.tool_timeout_s=5"])


def test_text_prompts_have_no_place_for_the_tools(tmp_path):
    with pytest.raises(ConfigError, match="objective.tools: a text prompt has no place for the tools' schemas"):
        train(tmp_path / "run", *GRPO, f"data.path={DATA / 'prompts.jsonl'}", f"objective.tools=[{TOOLS}:lookup]",
              "trainer.max_steps=1")


def built(cfg):
    """The strategy (one process), the objective and a tiny model (eval mode) of `cfg`."""
    from accelerate import Accelerator

    from trainloop.model.builder import build_model, build_model_config
    from trainloop.objectives import build_objective
    from trainloop.parallel import build_strategy

    reset_accelerate()
    strategy = build_strategy(cfg, Accelerator(cpu=True))
    objective = build_objective(cfg, "cpu")
    torch.manual_seed(0)
    model = build_model(cfg.model, build_model_config(cfg.model, len(objective.tokenizer))).eval()
    return strategy, objective, model


def test_tool_replies_and_the_prompt_get_no_loss_and_no_advantage():
    """The model's first turn calls the tool (written here: a random model rarely would); the tool's
    reply and the header of the model's next turn follow, untrained; the model writes that turn.
    The loss's gradient reaches each of the model's tokens and none of the reply's."""
    from trainloop.objectives.grpo import GRPO as Objective
    from trainloop.objectives.policy_gradient import policy_loss, summed_loss

    cfg = compose("+preset=smoke", *GRPO, f"objective.tools=[{TOOLS}:lookup]", "objective.max_new_tokens=160")
    strategy, objective, model = built(cfg)
    tokenizer = objective.tokenizer
    messages = [{"role": "user", "content": "What is stored under alpha?"}]
    prompt = tokenizer.apply_chat_template(messages, chat_template=objective.template,
                                           tools=Objective.prompt_tools(cfg), add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    assert '"name": "lookup"' in tokenizer.decode(prompt)  # the prompt shows the tool's schema
    call = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    prompt_ids = torch.tensor([prompt, prompt])
    out = torch.cat([prompt_ids, torch.tensor([call, call])], 1)
    with torch.no_grad():
        rollout = objective.tool_rollout(strategy, model, prompt_ids, torch.ones_like(prompt_ids), out,
                                         objective.sampling, [{"prompt": messages}] * 2)
    width = prompt_ids.shape[1]
    completion, mask = rollout["input_ids"][:, width:], rollout["completion_mask"]
    present = rollout["attention_mask"][:, width:]
    for row in range(2):
        reply = tokenizer.decode(completion[row][(mask[row] == 0) & (present[row] == 1)])
        assert reply == "\n<|tool|>\n417<|endoftext|>\n<|assistant|>\n", reply
        trained = tokenizer.decode(completion[row][mask[row] == 1])
        assert trained.startswith(CALL + "<|endoftext|>") and len(trained) > len(CALL) + len("<|endoftext|>")
        first, answer = rollout["messages"][row][:2]
        assert first == {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "lookup", "arguments": {"key": "alpha"}}}]}
        assert answer == {"role": "tool", "name": "lookup", "content": "417"}
        assert rollout["messages"][row][2]["role"] == "assistant"  # the model's next turn
    assert rollout["tool_calls"].tolist() == [2.0, 0.0]
    logps = torch.randn(mask.shape, requires_grad=True)
    per_token, _ = policy_loss(logps, logps.detach(), torch.tensor([1.0, -1.0]), mask, objective.cfg, 0.2)
    summed_loss(per_token, mask, "dapo", 160).backward()
    assert (logps.grad[mask == 0] == 0).all() and (logps.grad[mask == 1] != 0).all()
    reset_accelerate()


def test_a_tool_that_fails_on_every_call_is_warned_of_once(caplog):
    """Issue 58, item 10: every call of a line answered with an error (a tool that raises) is one warning
    naming objective.tools, not only tool_failure_share 1 in metrics.jsonl."""
    import logging

    from trainloop.objectives.grpo import GRPO as Objective

    cfg = compose("+preset=smoke", *GRPO[:2], "objective.rewards=[trainloop.objectives.rewards:exact_answer]",
                  f"objective.tools=[{TOOLS}:broken]", "objective.max_new_tokens=160")
    strategy, objective, model = built(cfg)
    tokenizer = objective.tokenizer
    messages = [{"role": "user", "content": "What is stored under a?"}]
    prompt = torch.tensor([tokenizer.apply_chat_template(messages, chat_template=objective.template,
                                                         tools=Objective.prompt_tools(cfg), add_generation_prompt=True,
                                                         tokenize=True, return_dict=False)] * 2)
    call = tokenizer('<tool_call>{"name": "broken", "arguments": {"key": "a"}}</tool_call>',
                     add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    with torch.no_grad():
        rollout = objective.tool_rollout(strategy, model, prompt, torch.ones_like(prompt),
                                         torch.cat([prompt, torch.tensor([call, call])], 1), objective.sampling,
                                         [{"prompt": messages}] * 2)
    assert rollout["tool_calls"].tolist() == [2.0, 2.0]
    scores = objective.score(rollout)
    assert not isinstance(scores, ConfigError), scores
    with caplog.at_level(logging.WARNING, logger="trainloop"):
        for _ in range(2):  # two lines, one warning
            objective.record([rollout], scores, scores[:, 0])
            assert objective.window(strategy)["tool_failure_share"] == 1.0
    warned = [r.getMessage() for r in caplog.records if "tool calls" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("objective=grpo: every one of the 2 tool calls since the last "
                                                     "line failed"), warned
    reset_accelerate()


def test_a_run_with_tools_renders_their_schemas_into_the_prompts_and_trains(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"Look up {key}."}], "answer": answer}
            for key, answer in (("alpha", "417"), ("beta", "92")) * 8]
    run = train(tmp_path / "run", *GRPO[:2], "objective.rewards=[trainloop.objectives.rewards:exact_answer]",
                f"data.path={write_rows(tmp_path / 'p.jsonl', rows)}",
                f"objective.tools=[{TOOLS}:lookup]", "objective.num_generations=2", "objective.max_new_tokens=8",
                "data.seq_len=400", "data.batch_size=2", "trainer.max_steps=2", "trainer.eval_every=2",
                "checkpoint.save_final_model=false")
    lines = [r for r in read_metrics(run) if "reward" in r]
    assert len(lines) == 2 and all("tool_calls_per_completion" in r for r in lines)
    assert [r for r in read_metrics(run) if "eval_reward" in r]


@pytest.mark.parametrize("max_rounds, rounds", [(1, 1), (None, 3)])
def test_the_model_is_asked_again_until_it_calls_nothing_or_the_rounds_or_the_budget_run_out(max_rounds, rounds):
    """The model's turns are written here (each calls the tool again, the fourth answers): with
    objective.max_tool_calls=1 one round of calls is answered; with no limit, rounds go on until the
    budget of completion tokens has no room for a reply and a token more."""
    from trainloop.data.chat_template import BUILTIN_CHAT_TEMPLATE
    from trainloop.data.tokenizer import byte_level_tokenizer
    from trainloop.objectives.tools import load_tools, take_turns

    tokenizer = byte_level_tokenizer()
    call = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    asked = []

    def generate(which, rows, room):
        assert which == [0]  # the one row, by its place
        asked.append(len(rows))
        return [call[:r] for r in room]

    turns = take_turns([[1, 2, 3]], [call], generate, lambda going: going > 0, tokenizer, BUILTIN_CHAT_TEMPLATE,
                       [load_tools([f"{TOOLS}:lookup"])], max_rounds, 1.0, budget=4 * len(call) + 60)
    turn = turns[0]
    assert asked == [1] * rounds and turn.calls == rounds
    assert [m["role"] for m in turn.messages] == ["assistant", "tool"] * rounds + ["assistant"]
    assert len(turn.ids) == len(turn.trained) <= 4 * len(call) + 60
    cut = max_rounds is None  # the budget cut the last turn short: no end-of-text, so no call
    assert (turn.ids[-1] != tokenizer.eos_token_id) == cut
    assert ("tool_calls" in turn.messages[-1]) == (not cut)  # at the rounds' limit its call is left unanswered


# --- environments (objective.environment, TRL's environment_factory) --------------------------------

VAULT = f"{TOOLS}:Vault"


@pytest.mark.parametrize("overrides, says", [
    ([f"objective.environment={TOOLS}:NoReset"], r"objective.environment='.*:NoReset': NoReset has no reset method"),
    ([f"objective.environment={TOOLS}:Undocumented"],
     r"objective.environment='.*:Undocumented': method peek: no JSON schema can be made of peek"),
    ([f"objective.environment={TOOLS}:Clash", f"objective.tools=[{TOOLS}:lookup]"],
     r"objective.environment=.*: its method lookup has the name of a tool of objective.tools"),
    ([f"objective.environment={TOOLS}:Unmakeable"],
     r"objective.environment=.*: making an instance raised RuntimeError: no database"),
    ([f"objective.environment={TOOLS}:Missing"], r"objective.environment='.*:Missing': .* has no class Missing"),
    ([f"objective.environment={TOOLS}:Quiet", "objective.rewards=[]"], r"objective.rewards=\[\] names no reward"),
    ([f"objective.environment={VAULT}", "objective.reward_weights=[1,2,3]"],
     r"objective.reward_weights has 3 weights for 1 reward functions: give one per function, then optionally "
     r"the environment Vault's"),
])
def test_an_environment_that_cannot_work_is_refused_naming_the_key(overrides, says):
    with pytest.raises(ConfigError, match=rf"\n  {says}"):
        validate(compose("+preset=smoke", *GRPO, *overrides, f"data.path={DATA / 'prompts.jsonl'}"))


def test_each_rollout_has_its_own_environment_reset_with_its_row(tmp_path, caplog):
    """Four rollouts of two rows: each its own Vault, reset with its row (whose text is appended to the
    prompt, rendered again with the vault's schema); the model's call (written here) is answered by its
    own vault with its row's secret; get_reward is a reward column named Vault, weighted 1.0 after the
    functions'; the reward functions get the instances. The next step reuses the instances. A sample
    is a transcript of every turn, in event=samples and the log (issue 58, item 3)."""
    import logging

    from trainloop.objectives.grpo import shown
    from trainloop.observe.metrics import Metrics

    cfg = compose("+preset=smoke", *GRPO[:2], "objective.rewards=[trainloop.objectives.rewards:exact_answer]",
                  f"objective.environment={VAULT}", "objective.max_new_tokens=160",
                  "objective.num_generations=2", "data.seq_len=300")
    strategy, objective, model = built(cfg)
    tokenizer = objective.tokenizer
    rows = [{"prompt": [{"role": "user", "content": "Open the vault."}], "secret": secret}
            for secret in (417, 92) for _ in range(2)]
    stale = objective.render(rows[0]["prompt"])  # as the data rendered it, before reset
    prompt_ids = torch.tensor([stale] * 4)
    objective.environments.start()
    ids, mask, vaults = objective.reset(strategy, rows, prompt_ids, torch.ones_like(prompt_ids))
    assert len({id(v) for v in vaults}) == 4 and [v.secret for v in vaults] == ["417", "417", "92", "92"]
    assert tokenizer.decode(ids[0][mask[0].bool()]).endswith(
        "Open the vault. (the vault is locked)<|endoftext|>\n<|assistant|>\n")
    assert '"name": "vault"' in tokenizer.decode(ids[0])  # the environment's method is a tool in the prompt
    assert rows[0]["prompt"][-1]["content"] == "Open the vault. (the vault is locked)"  # as the rewards see it
    call = tokenizer('<tool_call>{"name": "vault", "arguments": {}}</tool_call>', add_special_tokens=False)
    out = torch.cat([ids, torch.tensor([call["input_ids"] + [tokenizer.eos_token_id]] * 4)], 1)
    with torch.no_grad():
        rollout = objective.tool_rollout(strategy, model, ids, mask, out, objective.sampling, rows, vaults)
    assert [m[1] for m in rollout["messages"]] == [{"role": "tool", "name": "vault", "content": s}
                                                   for s in ("417", "417", "92", "92")]
    assert [v.opened for v in vaults] == [1, 1, 1, 1]
    assert objective.rewards.names == ["exact_answer", "Vault"] and objective.rewards.weights == [1.0, 1.0]
    scores = objective.score(rollout)
    assert scores[:, 1].tolist() == [1.0] * 4  # each vault was opened once (the rows have no answer: NaN)
    samples = shown(rollout, "prompt", objective.rewards.names, scores)
    turns = samples[0]["text"].splitlines()
    assert samples[0]["prompt"] == "user: Open the vault. (the vault is locked)" and samples[0]["conversation"]
    assert turns[:2] == ["assistant calls vault({})", "tool vault: 417"] and turns[2].startswith("assistant: ")
    assert samples[0]["rewards"] == {"exact_answer": None, "Vault": 1.0}
    metrics = Metrics(tmp_path, True, 1, 0, False, 1)
    with caplog.at_level(logging.INFO, logger="trainloop"):
        metrics.samples(1, samples)
    metrics.close()
    assert [r["samples"] for r in read_metrics(tmp_path)] == [samples]
    assert ("step 1: sample 1\n  user: Open the vault. (the vault is locked)\n  assistant calls vault({})\n"
            "  tool vault: 417\n  assistant: ") in caplog.text and "\n  rewards: exact_answer None, Vault 1\n" in caplog.text

    # a budget that ends right after the call (issue 58, item 2): the vault still answers, the reward
    # functions get its reply, and the rollout counts as cut (truncated_share)
    objective.cfg.max_new_tokens = len(call["input_ids"]) + 3
    with torch.no_grad():
        cut = objective.tool_rollout(strategy, model, ids, mask, out, objective.sampling, rows, vaults)
    assert [m[1:] for m in cut["messages"]] == [[{"role": "tool", "name": "vault", "content": s}]
                                                for s in ("417", "417", "92", "92")]
    assert cut["truncated"].all() and [v.opened for v in vaults] == [2, 2, 2, 2]
    assert cut["input_ids"].shape[1] == ids.shape[1] + len(call["input_ids"]) + 1  # the reply's tokens did not fit
    objective.environments.start()
    assert objective.environments.draw(4) == vaults  # made once, reset often
    reset_accelerate()


def test_a_reset_that_fails_stops_the_run_in_one_line(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "Open the vault."}]}] * 8  # no secret: reset's argument
    with pytest.raises(ConfigError, match=r"objective.environment=.*:Vault: reset raised TypeError: .*secret"):
        train(tmp_path / "run", *GRPO, f"data.path={write_rows(tmp_path / 'p.jsonl', rows)}",
              f"objective.environment={VAULT}", "data.seq_len=300", "trainer.max_steps=1")


def test_a_run_rewarded_by_its_environment_alone(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "Open the vault."}], "secret": n} for n in range(16)]
    run = train(tmp_path / "run", *GRPO[:2], "objective.rewards=[]", f"objective.environment={VAULT}",
                f"data.path={write_rows(tmp_path / 'p.jsonl', rows)}", "objective.num_generations=2",
                "objective.max_new_tokens=8", "data.seq_len=300", "data.batch_size=2", "trainer.max_steps=2",
                "trainer.eval_every=2", "checkpoint.save_final_model=false")
    lines = [r for r in read_metrics(run) if "reward" in r]
    assert len(lines) == 2 and all(r["rewards/Vault"] == 0.0 and "tool_calls_per_completion" in r for r in lines)
    assert [r["eval_reward"] for r in read_metrics(run) if "eval_reward" in r] == [0.0]
