"""Preference tuning, the first slice of issue 25: data=preference reads TRL's three row forms by
documented rules; objective=dpo's loss and rewards are TRL 1.16's on the same batch (TRL's own
code runs); a step's loss is the mean over the pairs of the global batch, however the pairs fall
into micro-batches and processes; and a short LoRA run learns a rule the held-out pairs follow.

Real parts only: the composed config, `datasets` reading jsonl and parquet, the built-in byte-level
tokenizer, a tiny transformers Llama with peft's LoRA, TRL's DPOTrainer, 2 processes over gloo.
"""

from __future__ import annotations

import logging
import random
import re
import signal
import sys
from pathlib import Path

import pytest
import torch

from helpers import (
    SMALL, clean_env, compose, finish, logits_agree, read_metrics, train, wait_for_step, warm,
    write_rows,
)
from trainloop.config.compose import ConfigError, check_command_line, validate

DPO = ["data=preference", "objective=dpo", "adapter=lora"]
PAIRS = Path(__file__).resolve().parent / "data" / "preference.jsonl"  # the right sum chosen, a wrong one rejected


def sums(n: int = 12) -> list[dict]:
    return [{"prompt": f"{a}+{b}=", "chosen": f"{a + b}", "rejected": f"{a + b + 1}{a}"}
            for a in range(n) for b in range(2)][:n]


def as_conversation(row: dict) -> dict:
    return {"prompt": [{"role": "user", "content": row["prompt"]}],
            "chosen": [{"role": "assistant", "content": row["chosen"]}],
            "rejected": [{"role": "assistant", "content": row["rejected"]}]}


def as_implicit(row: dict) -> dict:
    conversation = as_conversation(row)
    return {side: conversation["prompt"] + conversation[side] for side in ("chosen", "rejected")}


def build(path: Path, *overrides: str):
    from trainloop.data.loaders import build_datasets, byte_level_tokenizer

    cfg = compose("+preset=smoke", *DPO, f"data.path={path}", *overrides)
    validate(cfg)
    return build_datasets(cfg.data, byte_level_tokenizer(), cfg.trainer.seed)


def completion(tokenizer, item: dict, side: str) -> str:
    ids, labels = item[f"{side}_input_ids"], item[f"{side}_labels"]
    return tokenizer.decode(ids[labels != -100])


# --- the format -------------------------------------------------------------------------------

def test_the_three_row_forms_give_one_pair_per_row(tmp_path, caplog):
    import pandas

    from trainloop.data.loaders import byte_level_tokenizer, trained_chat_template
    from trainloop.data.chat_template import BUILTIN_CHAT_TEMPLATE

    tokenizer, rows = byte_level_tokenizer(), sums()
    plain = write_rows(tmp_path / "plain.jsonl", rows)
    conversational = write_rows(tmp_path / "conversational.jsonl", [as_conversation(r) for r in rows])
    implicit = write_rows(tmp_path / "implicit.jsonl", [as_implicit(r) for r in rows])
    pandas.DataFrame([as_conversation(r) for r in rows]).to_parquet(tmp_path / "conversational.parquet")
    caplog.set_level(logging.INFO, logger="trainloop")
    train, valid = build(plain)
    # final/ carries the built-in template after plain text too, but only rendered rows say so (issue 33, item 9)
    assert trained_chat_template(compose(*DPO, f"data.path={plain}").data, tokenizer) == BUILTIN_CHAT_TEMPLATE
    assert "chat template" not in caplog.text
    assert len(train) + len(valid) == len(rows)
    item = train[0]
    assert item["chosen_input_ids"].shape == item["rejected_labels"].shape == (64,)  # padded to data.seq_len
    start = int((item["chosen_labels"] != -100).nonzero()[0])
    row = next(r for r in rows if tokenizer.decode(item["chosen_input_ids"][:start]) == r["prompt"])  # no loss on it
    assert completion(tokenizer, item, "chosen") == row["chosen"] + tokenizer.eos_token  # plain ones end with EOS
    assert completion(tokenizer, item, "rejected") == row["rejected"] + tokenizer.eos_token
    built = {name: build(path) for name, path in [("conversational", conversational), ("implicit", implicit),
                                                   ("parquet", tmp_path / "conversational.parquet")]}
    assert "the tokenizer has no chat template: using trainloop's built-in one" in caplog.text
    for name, (t, v) in built.items():
        assert len(t) + len(v) == len(rows), name
        for key in item:  # the implicit prompt is the shared turns: the same tokens as the explicit one
            assert torch.equal(t.tensors[key], built["conversational"][0].tensors[key]), (name, key)
    conversation = built["conversational"][0][0]  # rendered with the (built-in) chat template
    text = tokenizer.decode(conversation["chosen_input_ids"])
    row = next(r for r in rows if text.startswith(f"<|user|>\n{r['prompt']}{tokenizer.eos_token}\n<|assistant|>\n"))
    assert completion(tokenizer, conversation, "chosen") == f"{row['chosen']}{tokenizer.eos_token}\n"


@pytest.mark.parametrize("row, says", [
    ({"prompt": "1+1=", "chosen": "2"}, r"data.rejected_field='rejected' is missing or empty"),
    ({"prompt": "1+1=", "chosen": None, "rejected": "3"}, r"data.chosen_field='chosen' is missing or empty"),
    ({"chosen": "2", "rejected": "3"}, r"a plain-text pair needs its prompt"),
    ({"prompt": "1+1=", "chosen": [{"role": "assistant", "content": "2"}], "rejected": "3"},
     r"mixes text and conversations"),
    ({"prompt": "", "chosen": "2", "rejected": "3"}, r"data.prompt_field='prompt' is empty"),  # as data=prompts
    ({"prompt": "1+1=", "chosen": 2, "rejected": "3"}, r"data.chosen_field='chosen' is a number: give text"),
    ({"prompt": 11, "chosen": "2", "rejected": "3"}, r"data.prompt_field='prompt' is a number: give text"),
    ({"prompt": [{"role": "user", "content": "1+1="}], "chosen": [{"role": "assistant", "content": "2"}],
      "rejected": [{"role": "assistant", "content": "3"}, {"role": "user", "content": "sure?"}]},
     r"rejected's last turn is the user's, not the assistant's"),
    ({"prompt": [{"role": "user", "content": "1+1="}], "chosen": [{"role": "assistant", "content": ""}],
      "rejected": [{"role": "assistant", "content": "3"}]},
     r"chosen's last turn, the assistant's, is empty: a completion needs its text"),  # as "chosen": "" is
    ({"chosen": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}],
      "rejected": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": ""}]},
     r"rejected's last turn, the assistant's, is empty"),
])
def test_a_bad_row_is_refused_naming_its_file_and_line(tmp_path, row, says):
    path = write_rows(tmp_path / "pairs.jsonl", [*sums(5), row, *sums(5)])
    with pytest.raises(ConfigError, match=rf"^{path}:6: .*{says}.*; fix or remove that row$"):
        build(path)


def test_identical_pairs_and_overlong_prompts_are_skipped_and_counted(tmp_path, caplog):
    from trainloop.data.loaders import byte_level_tokenizer

    rows = [*sums(10), {"prompt": "1+1=", "chosen": "2", "rejected": "2"},
            {"prompt": "x" * 80, "chosen": "2", "rejected": "3"}, {"prompt": "long:", "chosen": "y" * 90, "rejected": "z"}]
    path = write_rows(tmp_path / "pairs.jsonl", rows)
    with caplog.at_level(logging.INFO, logger="trainloop"):
        train, valid = build(path)
    assert len(train) + len(valid) == 11  # 13 rows: one identical pair, one prompt longer than data.seq_len
    assert "skipped 1 of 13 (1 with chosen identical to rejected)" in caplog.text
    assert "1 with their completions truncated, 1 skipped as their prompt alone fills data.seq_len" in caplog.text
    tokenizer = byte_level_tokenizer()
    long = next(item for item in (train[i] for i in range(len(train))) if "long:" in tokenizer.decode(item["chosen_input_ids"]))
    assert tokenizer.decode(long["chosen_input_ids"]).startswith("long:")  # the prompt kept
    assert completion(tokenizer, long, "chosen") == "y" * (64 - len("long:"))  # the completion truncated to fit
    with pytest.raises(ConfigError, match=r"^data.seq_len=4: the prompt of every one of the 12 pairs fills it"):
        build(path, "data.seq_len=4")
    with pytest.raises(ConfigError, match=r"is a pair to learn from: each has chosen identical to rejected$"):
        build(write_rows(tmp_path / "same.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "b"}] * 3))


def test_truncating_every_pair_warns_and_nothing_left_to_tell_them_apart_is_refused(tmp_path, caplog):
    """Issue 33, item 7: every pair cut by data.seq_len is a warning, not a note; pairs whose chosen
    and rejected differ only past data.seq_len are skipped, and none left is refused."""
    ends = [{"prompt": f"{i}:", "chosen": f"{i}" + "x" * 70, "rejected": f"{i + 1}" + "x" * 70} for i in range(12)]
    with caplog.at_level(logging.INFO, logger="trainloop"):
        train, valid = build(write_rows(tmp_path / "long.jsonl", ends))
    assert len(train) + len(valid) == 12
    said = [r for r in caplog.records if "with their completions truncated" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, caplog.text
    assert "of 12 pairs (data.seq_len=64, the longest 76 tokens): 12 with their completions truncated" in caplog.text
    alike = [{"prompt": f"{i}:", "chosen": "x" * 70 + "a", "rejected": "x" * 70 + "b"} for i in range(12)]
    with pytest.raises(ConfigError, match=r"^data.seq_len=64: no pair keeps a part of its completions that tells "
                                          r"chosen from rejected \(the longest pair is 75 tokens\); raise data.seq_len$"):
        build(write_rows(tmp_path / "alike.jsonl", alike))


def test_the_data_fingerprint_sees_the_pairs(tmp_path):
    from trainloop.data.loaders import byte_level_tokenizer, data_fingerprint

    tokenizer = byte_level_tokenizer()
    one = data_fingerprint(tokenizer, *build(write_rows(tmp_path / "a.jsonl", sums())))
    rows = sums()
    rows[3]["rejected"] += "0"
    other = data_fingerprint(tokenizer, *build(write_rows(tmp_path / "b.jsonl", rows)))
    assert one["data content"] != other["data content"] and "blocks of 64 tokens" in one["data content"]


# --- the config -------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, says", [
    (["data=preference", "objective=dpo", "+preset=zero3", "deepspeed.zero3_init=true"],
     "deepspeed.zero3_init=true with objective=dpo and adapter=none: the frozen reference is a copy of the model"),
    # the objectives whose row says their reference is a copy of the model as built (Objective.copies_model)
    (["data=unpaired", "objective=kto", "+preset=zero3", "deepspeed.zero3_init=true"],
     "deepspeed.zero3_init=true with objective=kto and adapter=none"),
    (["data=prompts", "objective=grpo", "objective.beta=0.04", "+preset=zero3", "deepspeed.zero3_init=true"],
     "deepspeed.zero3_init=true with objective=grpo and adapter=none"),
    (["data=chat", "objective=dpo", "adapter=lora"], "objective=dpo trains on preference pairs, and data=chat holds "
                                                     "none: set data=preference"),
    (["data=preference"], "data=preference holds preference pairs, which objective=causal_lm does not train on"),
    ([*DPO, "objective.label_smoothing=0.1"], "objective.label_smoothing=0.1 is read only by objective.loss_type=robust"),
    ([*DPO, "objective.loss_type=kto"], "objective.loss_type=kto is not one of: sigmoid, ipo, hinge, robust"),
    ([*DPO, "model.arch=mixtral"], "objective=dpo does not add a mixture's router loss"),
    ([*DPO, "data.packing=documents"], "data.packing=documents: data=preference makes one item of each pair"),
])
def test_what_cannot_work_is_refused_naming_the_key(overrides, says):
    with pytest.raises(ConfigError, match=rf"\n  {says}"):
        validate(compose(*overrides, "data.path=/some/pairs.jsonl"))


def test_the_objective_keys_are_read_only_by_dpo():
    cfg = compose("objective.beta=0.5")
    with pytest.raises(ConfigError, match="objective.beta=0.5 has no effect unless objective=dpo"):
        check_command_line(cfg, ["objective.beta=0.5"])
    check_command_line(compose(*DPO, "objective.beta=0.5"), ["objective.beta=0.5"])


# --- the loss ---------------------------------------------------------------------------------

@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "robust"])
def test_the_loss_and_rewards_are_trls_on_the_same_batch(tmp_path, loss_type):
    """TRL's DPOTrainer (LoRA, reference = adapters disabled) tokenizes the rows and computes its
    loss with its own _compute_loss; objective=dpo computes on the same model and batch."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    from trainloop.model.adapter import lora_config
    from trainloop.data.loaders import byte_level_tokenizer
    from trainloop.model.builder import build_model, build_model_config
    from trainloop.objectives import build_objective

    smoothing = ["objective.label_smoothing=0.2"] if loss_type == "robust" else []
    path = write_rows(tmp_path / "pairs.jsonl", sums(6))
    cfg = compose("+preset=smoke", *DPO, f"data.path={path}", f"objective.loss_type={loss_type}", *smoothing)
    validate(cfg)
    tokenizer = byte_level_tokenizer()
    torch.manual_seed(0)
    base = build_model(cfg.model, build_model_config(cfg.model, len(tokenizer)))
    args = DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], beta=cfg.objective.beta, loss_type=[loss_type],
                     label_smoothing=cfg.objective.label_smoothing, use_cpu=True, max_length=None)
    trainer = DPOTrainer(model=base, args=args, train_dataset=datasets.Dataset.from_list(sums(6)),
                         processing_class=tokenizer, peft_config=lora_config(cfg.adapter))
    torch.manual_seed(1)
    for name, parameter in trainer.model.named_parameters():  # a policy away from its reference
        if "lora_B" in name:
            parameter.data.normal_(0, 0.2)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(6)])
    with torch.no_grad():
        trl_loss = trainer._compute_loss(trainer.model, batch, return_outputs=False)

    # the same pairs as data=preference tokenizes them
    ours_set, _ = build(path, "data.validation_fraction=0.01")
    trl_pairs = {tuple(row["prompt_ids"] + row[f"{side}_ids"]) for row in trainer.train_dataset
                 for side in ("chosen", "rejected")}
    for side in ("chosen", "rejected"):
        for ids, labels in zip(ours_set.tensors[f"{side}_input_ids"], ours_set.tensors[f"{side}_labels"]):
            assert tuple(ids[:int((labels != -100).nonzero()[-1]) + 1].tolist()) in trl_pairs
    ids, labels = batch["input_ids"], batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    ours = {"chosen_input_ids": ids[:6], "rejected_input_ids": ids[6:], "chosen_labels": labels[:6],
            "rejected_labels": labels[6:]}
    objective = build_objective(cfg, "cpu")
    with torch.no_grad():
        loss = objective.batch_loss(trainer.model, ours).summed / objective.count(ours)
    means, trl = objective.means(objective.sums), trainer._metrics["train"]
    assert loss.item() == pytest.approx(trl_loss.item(), abs=1e-5)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margin", "logps/chosen", "logps/rejected"):
        assert means[key] == pytest.approx(trl[key.replace("margin", "margins")][-1], abs=1e-5), key
    assert means["rewards/accuracy"] == pytest.approx(trl["rewards/accuracies"][-1])
    assert abs(means["rewards/margin"]) > 1e-3  # the policy really differs from its reference


# --- the step ---------------------------------------------------------------------------------

STEP = [*DPO, f"data.path={PAIRS}", "trainer.max_steps=3", "trainer.eval_every=3", "trainer.eval_batches=null",
        "data.validation_fraction=0.2", "optimizer=sgd", "optimizer.lr=0.5"]
# 10 validation pairs, no whole number of global batches of 4: on 2 processes x 2, rank 1 has none
# left in the last micro-step and still joins its forward (ZeRO-3, FSDP2); each pair counts once


def dpo_losses(run_dir: Path) -> list[tuple[int, str, float]]:
    keys = ("loss", "eval_loss", "rewards/chosen", "logps/rejected")
    return [(r["step"], key, r[key]) for r in read_metrics(run_dir) for key in keys if key in r]


def assert_same_losses(got: Path, want: Path, tolerance: float = 1e-6) -> None:
    a, b = dpo_losses(got), dpo_losses(want)
    assert [(s, k) for s, k, _ in a] == [(s, k) for s, k, _ in b] and len(a) >= 8
    for (step, key, x), (_, _, y) in zip(a, b):
        assert x == pytest.approx(y, rel=tolerance, abs=tolerance), (step, key, a, b)
    assert len({x for _, key, x in a if key == "loss"}) > 1  # the policy moved


@pytest.mark.slow
def test_accumulation_and_two_processes_give_the_step_of_the_whole_batch(tmp_path):
    whole = train(tmp_path / "batch4", *STEP, "data.batch_size=4")
    accumulated = train(tmp_path / "accum4", *STEP, "data.batch_size=1", "trainer.gradient_accumulation_steps=4")
    assert_same_losses(accumulated, whole)
    run_dir = tmp_path / "two"
    warm(2, [*SMALL, *STEP, "data.batch_size=2", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert {r["world_size"] for r in read_metrics(run_dir)} == {2}
    assert_same_losses(run_dir, whole)


FULL = [*(o for o in STEP if o != "adapter=lora"), "adapter=none"]  # a full fine-tune: a frozen reference copy


@pytest.mark.slow
def test_a_full_fine_tune_precomputed_or_chunked_gives_the_losses_of_its_reference_copy(tmp_path):
    """A full fine-tune's frozen reference copy, against: objective.precompute_reference (no copy:
    the policy scores every pair before its first step), and trainer.loss_chunk_tokens (issue 28:
    the policy's and the copy's log-probs 16 tokens at a time, never the full logits). The same
    losses within 1e-6."""
    full = train(tmp_path / "full", *FULL, "data.batch_size=4")
    precomputed = train(tmp_path / "precomputed", *FULL, "data.batch_size=4", "objective.precompute_reference=true")
    assert_same_losses(precomputed, full)
    chunked = train(tmp_path / "chunked", *FULL, "data.batch_size=4", "trainer.loss_chunk_tokens=16")
    assert_same_losses(chunked, full)


@pytest.mark.slow
def test_a_full_fine_tune_under_zero3_and_fsdp2_gives_the_step_of_one_process(tmp_path, caplog, deepspeed_ops):
    """Full fine-tune: the reference is a frozen copy of the starting model, partitioned by ZeRO-3
    or sharded by FSDP2 like the policy; 2 processes x batch 2 give the losses and rewards of 1 x 4."""

    with caplog.at_level(logging.INFO, logger="trainloop"):
        whole = train(tmp_path / "one", *FULL, "data.batch_size=4")
    assert "the reference is a frozen copy of the starting model, whole on each rank" in caplog.text
    for strategy, held in [
        ("zero3", "partitioned by DeepSpeed ZeRO-3 like the policy"),
        ("fsdp", "sharded by FSDP2 like the policy"),
    ]:
        run_dir = tmp_path / strategy
        warm(2, [f"+preset=[smoke,{strategy}]", *SMALL[1:], *FULL, "data.batch_size=2", f"hydra.run.dir={run_dir}"],
             cwd=tmp_path, env=clean_env(DS_ACCELERATOR="cpu"))
        assert held in (run_dir / "train.log").read_text(), strategy
        assert {r["world_size"] for r in read_metrics(run_dir)} == {2}
        assert_same_losses(run_dir, whole, tolerance=1e-5)


# --- it learns --------------------------------------------------------------------------------

@pytest.mark.slow
def test_dpo_on_an_sft_model_learns_the_rule_of_the_held_out_pairs(tmp_path, caplog, capsys):
    """Chosen answers end with '!', rejected ones with '.'. A tiny model first fine-tuned on both
    endings alike (SFT: it echoes, with no preference), then DPO with LoRA on it: the held-out
    pairs' reward accuracy goes from 0.5 at the first step (the policy is its reference: every
    reward ties, a tie counts half) to at least 0.95; final/ loads merged in transformers and its
    adapter on the SFT model in peft. objective.precompute_reference=true (the reference's log-probs
    computed before training) gives the same losses within 1e-6. The log line, the progress bar
    and the report show the accuracy and the margin."""
    words = "apple river stone cloud green quick seven maple lantern copper ocean violet".split()
    rng = random.Random(0)
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 3))) for _ in range(96)]
    pairs = [{"prompt": f"Echo: {t}\n", "chosen": t + "!", "rejected": t + "."} for t in texts]
    sft = write_rows(tmp_path / "sft.jsonl", [{"prompt": p["prompt"], "completion": p[rng.choice(["chosen", "rejected"])]}
                                              for p in pairs])
    base = train(tmp_path / "sft", "data=prompt_completion", f"data.path={sft}", "trainer.max_steps=12",
                 "trainer.eval_every=12", "data.batch_size=8", "optimizer.lr=3e-3") / "final"
    path = write_rows(tmp_path / "rule.jsonl", pairs)
    dpo = [*DPO, "model=hf", f"model.name_or_path={base}", f"data.path={path}", "trainer.max_steps=4",
           "trainer.eval_every=4", "trainer.eval_batches=null", "data.batch_size=8", "data.validation_fraction=0.25",
           "optimizer.lr=1e-2", "scheduler=constant"]
    with caplog.at_level(logging.INFO, logger="trainloop"):
        run_dir = train(tmp_path / "run", *dpo)
    lines = read_metrics(run_dir)
    first = next(r for r in lines if "loss" in r)
    assert first["step"] == 1 and first["rewards/margin"] == 0.0 and first["rewards/accuracy"] == 0.5
    assert re.search(r"step 1  loss \S+  lr \S+  \S+ tok/s  rewards/accuracy 0.5  rewards/margin 0\n", caplog.text)
    held_out = [r for r in lines if "eval_loss" in r][-1]
    from trainloop.tools.report import main as report  # eval lines repeat the train keys: each drawn apart

    drawn = {ax.get_title(): ax for ax in report([str(run_dir)]).axes}
    assert {line.get_label(): line.get_ydata().tolist() for line in drawn["reward accuracy"].get_lines()} == {
        "run train": [r["rewards/accuracy"] for r in lines if "loss" in r], "run eval": [held_out["rewards/accuracy"]]}
    assert "reward margin" in drawn and "reward" not in drawn
    assert held_out["rewards/accuracy"] >= 0.95 and held_out["rewards/margin"] > 0
    assert held_out["eval_loss"] < first["loss"]
    assert "eval_ppl" not in held_out

    name, worst = logits_agree(run_dir / "final", base)
    assert name == "LlamaForCausalLM" and worst < 1e-4, worst
    capsys.readouterr()
    precomputed = train(tmp_path / "precomputed", *dpo, "objective.precompute_reference=true", "logging.progress_bar=true")
    assert re.search(r"4/4 \[.*, tok_s=\S+, rewards/accuracy=\S+, rewards/margin=\S+\]", capsys.readouterr().err)
    assert (precomputed / "reference_logps.pt").is_file()
    assert_same_losses(precomputed, run_dir, tolerance=1e-6)


@pytest.mark.slow
def test_sigterm_and_a_resume_give_bitwise_the_losses_of_a_run_not_stopped(tmp_path):
    """Acceptance 4, a full fine-tune with objective.precompute_reference=true: SIGTERM after step 2
    -> exit 75 with a checkpoint; the command its message gives resumes, reads the reference's
    log-probs back from the run dir instead of computing them, and every logged loss and reward of
    the two runs is bitwise that of a run that was not stopped. The stopped run has Hydra's default
    run dir (outputs/DATE/TIME, new at each launch), so that command must name it (issue 33, item 5)."""
    import subprocess
    import time

    args = [*SMALL, *FULL, "objective.precompute_reference=true", "data.batch_size=4", "trainer.max_steps=20",
            "trainer.eval_every=5", "checkpoint.save_final_model=false"]
    command = [sys.executable, "-m", "trainloop", *args]  # the stopped run: a real process, its real SIGTERM
    warm(1, [*args, f"hydra.run.dir={tmp_path / 'straight'}"], cwd=tmp_path)
    with open(tmp_path / "output.txt", "w") as output:
        proc = subprocess.Popen(command, cwd=tmp_path, env=clean_env(), stdout=output, stderr=subprocess.STDOUT)
    try:
        while not list(tmp_path.glob("outputs/*/*")):
            assert proc.poll() is None, (tmp_path / "output.txt").read_text()[-3000:]
            time.sleep(0.05)
        run = next(tmp_path.glob("outputs/*/*"))
        wait_for_step(run, 2, proc)
        proc.send_signal(signal.SIGTERM)
        code = finish(proc, timeout=300)
    finally:
        finish(proc, timeout=0)
    out = (tmp_path / "output.txt").read_text()
    assert code == 75, out[-4000:]
    stopped = int(re.search(r"stopped by SIGTERM after step (\d+)", out)[1])
    assert 2 <= stopped < 20
    given = re.search(r"; run the same command with (\S+) again to continue", out)
    assert given and given[1] == f"hydra.run.dir={run}", out[-2000:]
    again = warm(1, [*args, given[1]], cwd=tmp_path)
    assert "reference's log-probabilities of 38 + 10 pairs read from" in again.stdout + again.stderr
    assert [step for step, key, _ in dpo_losses(run) if key == "loss"] == list(range(1, 21))  # resumed, not restarted
    assert dpo_losses(run) == dpo_losses(tmp_path / "straight")


