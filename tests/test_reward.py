"""objective=reward (issue 39, item 1): a scalar score head trained on preference pairs with the
Bradley-Terry loss. Its loss and gradients are TRL 1.16's RewardTrainer's on the same batch (TRL's own
code runs, with and without centring and the margin column); a run on pairs that follow a rule leaves
a final/ that transformers alone loads as a sequence classifier and that ranks new pairs by that rule;
with LoRA the score head trains whole and the merged export scores as the live model did; what cannot
work is refused in one line.

Real parts only: the composed config, `datasets` reading jsonl, the built-in byte-level tokenizer, a
tiny transformers Llama (LlamaForSequenceClassification), peft, TRL's RewardTrainer.
"""

from __future__ import annotations

import copy
import re
import random
from pathlib import Path

import pytest
import torch

from helpers import compose, one_resumed_and_two_processes, pretrained_llama, read_metrics, train, write_rows
from trainloop.config.compose import ConfigError, validate

REWARD = ["data=preference", "objective=reward"]


def rule_pairs(numbers) -> list[dict]:
    """The rule of tests/data/preference.jsonl, on other numbers: chosen says the sum in a sentence, rejected
    names a wrong one."""
    rows = []
    for a, b in numbers:
        rows.append({"prompt": f"What is {a} plus {b}?", "chosen": f" {a} plus {b} is {a + b}.",
                     "rejected": f" It is {a + b + 1 + (a % 3)}."})
    return rows


# --- the loss: TRL's ------------------------------------------------------------------------------

@pytest.mark.parametrize("center,margin", [(0.0, False), (0.01, False), (0.0, True), (0.05, True)],
                         ids=["plain", "centred", "margin", "centred-margin"])
def test_the_loss_and_gradients_are_trls_on_the_same_batch(tmp_path, center, margin):
    """TRL's RewardTrainer tokenizes the rows and computes its loss with its own compute_loss;
    objective=reward computes on a copy of the same model, from the pairs data=preference made of
    the same rows: the same tokens, loss and gradients within 1e-5, and TRL's accuracy and margin."""
    import datasets
    from trl import RewardConfig, RewardTrainer

    from trainloop.data.loaders import build_datasets, byte_level_tokenizer
    from trainloop.model.builder import build_model, build_model_config, special_token_ids
    from trainloop.objectives import build_objective

    rows = rule_pairs([(a, 2 * a + 1) for a in range(6)])
    if margin:
        for i, row in enumerate(rows):
            row["margin"] = 0.5 * i - 1.0
    path = write_rows(tmp_path / "pairs.jsonl", rows)
    cfg = compose("+preset=smoke", *REWARD, f"data.path={path}", f"objective.center_rewards_coefficient={center}")
    validate(cfg)
    tokenizer = byte_level_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token  # as a run sets it (trainloop.build) and TRL does
    torch.manual_seed(0)
    model = build_model(cfg.model, build_model_config(cfg.model, len(tokenizer), special_token_ids(tokenizer)),
                        head="score")
    ours_model = copy.deepcopy(model)
    args = RewardConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, max_length=None,
                        center_rewards_coefficient=center or None)
    trainer = RewardTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                            processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, batch)
    trl_loss.backward()

    parts = build_datasets(cfg.data, tokenizer, cfg.trainer.seed)  # the pairs, held out or not
    ours = {key: torch.cat([part.tensors[key] for part in parts]) for key in parts[0].tensors}
    order = [rows.index(next(r for r in rows if tokenizer.decode(ids[ids != tokenizer.pad_token_id]).startswith(
        r["prompt"] + r["chosen"]))) for ids in ours["chosen_input_ids"]]
    assert sorted(order) == list(range(len(rows)))  # every row, once
    n = len(rows)
    trl_ids = batch["input_ids"]
    for side, offset in (("chosen", 0), ("rejected", n)):  # the same tokens, each up to its own end
        for i, ids in zip(order, ours[f"{side}_input_ids"]):
            length = int(batch["attention_mask"][offset + i].sum())
            assert ids[:length].tolist() == trl_ids[offset + i, :length].tolist()
            assert (ids[length:] == tokenizer.pad_token_id).all()
    if margin:
        assert ours["margin"].tolist() == [rows[i]["margin"] for i in order]
    objective = build_objective(cfg, "cpu")
    loss = objective.batch_loss(ours_model, ours).summed / objective.count(ours)
    loss.backward()
    assert loss.item() == pytest.approx(trl_loss.item(), abs=1e-5)
    trl_grads = dict(trainer.model.named_parameters())
    for name, parameter in ours_model.named_parameters():
        torch.testing.assert_close(parameter.grad, trl_grads[name].grad, atol=1e-5, rtol=0, msg=name)
    means, trl = objective.means(objective.sums), trainer._metrics["train"]
    assert means["rewards/margin"] == pytest.approx(trl["margin"][-1], abs=1e-5)
    assert means["rewards/accuracy"] == pytest.approx(trl["accuracy"][-1])  # no ties: TRL's count


# --- a run --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_reward_model_learns_the_rule_and_final_scores_with_transformers_alone(tmp_path, capsys):
    """Trained on tests/data/preference.jsonl's rule, final/ loads with AutoModelForSequenceClassification
    and scores the chosen completion of at least 95% of 40 pairs it never saw above the rejected one; the
    train and eval lines carry the accuracy and margin. trainloop.evaluate refuses the run and its
    checkpoint in one line naming the score head (issue 58, item 1): the harness scores a language model."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from trainloop.tools.evaluate import main as evaluate

    data = Path(__file__).resolve().parent / "data" / "preference.jsonl"
    run = train(tmp_path / "run", *REWARD, f"data.path={data}", "trainer.max_steps=30", "trainer.eval_every=15",
                "trainer.log_every=15", "optimizer.lr=1e-3")
    records = read_metrics(run)
    lines = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert lines and evals
    shown = {"rewards/accuracy", "rewards/margin", "rewards/chosen", "rewards/rejected"}
    assert shown <= set(lines[-1]) & set(evals[-1])
    assert "logps/chosen" not in lines[-1]  # a score head has no log-probabilities to report

    final = run / "final"
    model = AutoModelForSequenceClassification.from_pretrained(final).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    rng = random.Random(0)
    held_out = rule_pairs([(rng.randrange(50, 100), rng.randrange(0, 50)) for _ in range(40)])

    def score(text: str) -> float:
        with torch.no_grad():
            return model(**tokenizer(text, return_tensors="pt")).logits[0, 0].item()

    right = sum(score(r["prompt"] + r["chosen"]) > score(r["prompt"] + r["rejected"]) for r in held_out)
    assert right >= 38, f"{right}/40 held-out pairs ranked by the rule"

    (checkpoint,) = (run / "checkpoints").glob("step_*")
    capsys.readouterr()
    for path, named in ((run, f"{final} is a reward model (LlamaForSequenceClassification: a score head"),
                        (checkpoint, f"{checkpoint} is a checkpoint of a reward model (objective=reward: a score head")):
        with pytest.raises(SystemExit) as stop:
            evaluate([str(path), "--tasks", "pydoc_order"])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.startswith(f"error: {named}") and err.count("\n") == 1, err


@pytest.mark.slow
def test_lora_trains_the_score_head_and_the_merged_export_scores_as_the_live_model(tmp_path):
    """With adapter=lora the score head trains whole beside the adapters (peft's sequence-classification
    task); final/ is the merged sequence classifier and final/adapter holds the head: both load, and score
    a text alike."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    data = Path(__file__).resolve().parent / "data" / "preference.jsonl"
    base = pretrained_llama(tmp_path / "base")  # a causal LM: its score head starts from random weights
    run = train(tmp_path / "run", *REWARD, "model=hf", f"model.name_or_path={base}", "adapter=lora",
                f"data.path={data}", "trainer.max_steps=3")
    final = run / "final"
    merged = AutoModelForSequenceClassification.from_pretrained(final).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    ids = tokenizer("What is 3 plus 4? 3 plus 4 is 7.", return_tensors="pt")
    adapted = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(
        base, num_labels=1, pad_token_id=merged.config.pad_token_id), final / "adapter").eval()
    assert any("score" in name for name, _ in adapted.named_parameters() if "modules_to_save" in name)
    with torch.no_grad():
        torch.testing.assert_close(merged(**ids).logits, adapted(**ids).logits, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_grpo_raises_the_reward_of_a_trained_reward_model_its_only_reward(tmp_path):
    """A reward model trained on pairs after the toy prompts (tests/data/prompts.jsonl) that prefer
    lowercase letters to other characters is GRPO's only reward (objective.reward_models, named after its
    run): over 20 steps the mean reward of the last 5 rises above the first 5's."""
    import json
    import string

    data = Path(__file__).resolve().parent / "data"
    prompts = [json.loads(line)["prompt"] for line in (data / "prompts.jsonl").read_text().splitlines()]
    rng = random.Random(0)
    others = string.ascii_uppercase + string.digits + string.punctuation + " "
    pairs = [{"prompt": prompts[i % len(prompts)], "chosen": "".join(rng.choices(string.ascii_lowercase, k=6)),
              "rejected": "".join(rng.choices(others, k=6))} for i in range(96)]
    path = write_rows(tmp_path / "pairs.jsonl", pairs)
    scorer = train(tmp_path / "letters_rm", *REWARD, f"data.path={path}", "trainer.max_steps=40",
                   "trainer.eval_every=40", "trainer.log_every=40", "optimizer.lr=1e-3")
    assert [r for r in read_metrics(scorer) if "eval_loss" in r][-1]["rewards/accuracy"] >= 0.95
    run = train(tmp_path / "grpo", "data=prompts", "objective=grpo", f"data.path={data / 'prompts.jsonl'}",
                "objective.rewards=[]", f"objective.reward_models=[{scorer / 'final'}]", "objective.num_generations=8",
                "objective.max_new_tokens=6", "data.validation_fraction=0.2", "scheduler=constant",
                "checkpoint.save_final_model=false", "data.batch_size=4", "optimizer.lr=1e-2", "trainer.max_steps=20",
                "trainer.eval_every=20")
    lines = [r for r in read_metrics(run) if "reward" in r]
    assert len(lines) == 20 and lines[0]["rewards/letters_rm"] == lines[0]["reward"]
    curve = [r["reward"] for r in lines]
    first, last = sum(curve[:5]) / 5, sum(curve[-5:]) / 5
    print(f"reward model's reward by step {[round(r, 2) for r in curve]}")
    assert last > first + 0.5, curve


PAIRS = Path(__file__).resolve().parent / "data" / "preference.jsonl"
STEP = [*REWARD, f"data.path={PAIRS}", "trainer.max_steps=3", "trainer.eval_every=3", "trainer.eval_batches=null",
        "data.validation_fraction=0.2", "optimizer=sgd", "optimizer.lr=0.5",
        "objective.center_rewards_coefficient=0.01"]  # 10 validation pairs: no whole batches


@pytest.mark.slow
def test_two_processes_give_the_step_of_one_under_ddp_and_fsdp2_and_a_resume_that_of_no_stop(tmp_path):
    """2 processes at batch 2 give the losses, rewards and accuracies of 1 at batch 4, under DDP and FSDP2; and
    1 process stopped by SIGTERM and resumed gives them bitwise."""
    from transformers import AutoModelForSequenceClassification

    one = one_resumed_and_two_processes(
        tmp_path, STEP, ("loss", "eval_loss", "rewards/chosen", "rewards/accuracy", "rewards/margin"))
    assert len(one) == 4 * 4 and len({x for _, key, x in one if key == "loss"}) > 1  # 3 train lines, 1 eval: 4 keys each
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "fsdp" / "final").config.num_labels == 1


# --- what cannot work -------------------------------------------------------------------------------

def test_a_margin_that_is_not_a_number_is_refused_naming_file_and_line(tmp_path):
    from trainloop.data.loaders import build_datasets, byte_level_tokenizer

    rows = rule_pairs([(1, 2), (3, 4), (5, 6)])
    for row in rows:
        row["margin"] = 1.0
    rows[1]["margin"] = "high"
    path = write_rows(tmp_path / "pairs.jsonl", rows)
    cfg = compose("+preset=smoke", *REWARD, f"data.path={path}")
    with pytest.raises(ConfigError, match=rf"{path.name}:2: margin='high' is not a number"):
        build_datasets(cfg.data, byte_level_tokenizer(), 0)


@pytest.mark.parametrize("overrides,named", [
    (["objective.center_rewards_coefficient=-0.1"], "objective.center_rewards_coefficient=-0.1 must be 0"),
    (["eval.prompts=[hello]"], "eval.prompts: objective=reward trains a score head"),
    (["data=prompts", "data.path=x.jsonl"], "objective=reward trains on preference pairs"),
    (["trainer.loss_chunk_tokens=64"], "trainer.loss_chunk_tokens=64 is read by objective="),
])
def test_what_cannot_work_is_refused_by_name(overrides, named):
    cfg = compose("+preset=smoke", *REWARD, "data.path=pairs.jsonl", *overrides)
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace(".", r"\.")):
        validate(cfg)


def test_a_reward_model_that_is_not_one_is_refused_naming_its_place(tmp_path):
    prompts = Path(__file__).resolve().parent / "data" / "prompts.jsonl"
    causal = pretrained_llama(tmp_path / "causal")
    for directory, named in ((causal, "is a LlamaForCausalLM, not a sequence classifier with one score"),
                             (tmp_path / "absent", "is no directory")):
        cfg = compose("+preset=smoke", "data=prompts", "objective=grpo", f"data.path={prompts}",
                      f"objective.reward_models=[{directory}]")
        with pytest.raises(ConfigError, match=rf"objective.reward_models\[0\]: {re.escape(str(directory))} {named}"):
            validate(cfg)
