"""objective=kto on data=unpaired (issue 39, item 2): TRL's unpaired preference format read by documented
rules, each row carrying its prompt with the row before's completion for the KL estimate; the loss and
gradients are TRL 1.16's KTOTrainer's on the same batch (TRL's own code runs); a short LoRA run ranks
held-out pairs by the rule its labels follow.

Real parts only: the composed config, `datasets` reading jsonl, the built-in byte-level tokenizer, a
tiny transformers Llama with peft's LoRA, TRL's KTOTrainer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import compose, pretrained_llama, read_metrics, train, write_rows
from trainloop.config.compose import ConfigError, validate

KTO = ["data=unpaired", "objective=kto"]
PAIRS = Path(__file__).resolve().parent / "data" / "preference.jsonl"  # the right sum chosen, a wrong one rejected


def unpaired(pairs: list[dict]) -> list[dict]:
    """Each pair as two rows: its chosen completion desirable, its rejected one not (TRL's unpaired_preference)."""
    return [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
            for p in pairs for side in ("chosen", "rejected")]


def rule_pairs(numbers) -> list[dict]:
    return [{"prompt": f"What is {a} plus {b}?", "chosen": f" {a} plus {b} is {a + b}.",
             "rejected": f" It is {a + b + 1 + (a % 3)}."} for a, b in numbers]


def build(path: Path, *overrides: str):
    from trainloop.data.loaders import build_datasets, byte_level_tokenizer

    cfg = compose("+preset=smoke", *KTO, f"data.path={path}", *overrides)
    validate(cfg)
    return build_datasets(cfg.data, byte_level_tokenizer(), cfg.trainer.seed)


# --- the format ---------------------------------------------------------------------------------

def test_each_row_is_an_item_with_its_label_and_the_row_befores_completion(tmp_path):
    from trainloop.data.loaders import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    rows = unpaired(rule_pairs([(a, a + 1) for a in range(5)]))
    conversational = [{"prompt": [{"role": "user", "content": r["prompt"]}],
                       "completion": [{"role": "assistant", "content": r["completion"]}], "label": r["label"]}
                      for r in rows]
    for name, data in (("plain", rows), ("conversational", conversational)):
        parts = build(write_rows(tmp_path / f"{name}.jsonl", data), "data.validation_fraction=0.01")
        tensors = {key: torch.cat([part.tensors[key] for part in parts]) for key in parts[0].tensors}
        assert len(tensors["label"]) == len(rows)
        seen = []
        for ids, labels, kl_ids, kl_labels, label in zip(tensors["input_ids"], tensors["labels"],
                                                         tensors["kl_input_ids"], tensors["kl_labels"],
                                                         tensors["label"]):
            prompt = tokenizer.decode(ids[:int((labels != -100).nonzero()[0])])
            assert prompt == tokenizer.decode(kl_ids[:int((kl_labels != -100).nonzero()[0])])  # the same prompt
            completion, mismatched = (tokenizer.decode(i[t != -100]) for i, t in ((ids, labels), (kl_ids, kl_labels)))
            i = next(i for i, r in enumerate(rows) if r["prompt"] in prompt and r["completion"] in completion)
            assert bool(label) is rows[i]["label"]
            assert rows[i - 1]["completion"] in mismatched  # the file's order, rotated by one
            seen.append(i)
        assert sorted(seen) == list(range(len(rows))), name


@pytest.mark.parametrize("row,says", [
    ({"prompt": "Hi", "completion": "there", "label": "yes"}, "data.label_field='label' is text, not true or false"),
    ({"prompt": "Hi", "completion": "there", "label": 1}, "data.label_field=.label. is a number, not true or false"),
    ({"prompt": "Hi", "completion": "", "label": True}, "data.completion_field='completion' is missing or empty"),
    ({"prompt": "", "completion": "there", "label": True}, "data.prompt_field='prompt' is empty"),
    ({"prompt": [{"role": "user", "content": "Hi"}], "completion": "there", "label": True},
     "mixes text and conversations"),
    ({"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "assistant", "content": ""}], "label": True},
     "completion's last turn, the assistant's, is empty: a completion needs its text"),
])
def test_a_bad_row_is_refused_naming_file_and_line(tmp_path, row, says):
    good = {"prompt": "What?", "completion": " This.", "label": True}
    path = write_rows(tmp_path / "rows.jsonl", [good, good, row])
    with pytest.raises(ConfigError, match=rf"rows\.jsonl:3: {says.replace('(', r'.').replace(')', r'.')}"):
        build(path)


@pytest.mark.parametrize("overrides,says", [
    (["data=preference"],
     "objective=kto trains on completions labelled desirable or not, and data=preference holds none"),
    (["objective=dpo", "adapter=lora"],
     "data=unpaired holds completions labelled desirable or not, which objective=dpo"),
    (["objective.desirable_weight=0"], "objective.desirable_weight=0.0 must be greater than 0"),
    (["parallel.pp_size=2", "trainer.loss_chunk_tokens=64"],
     "trainer.loss_chunk_tokens=64 with parallel.pp_size=2 and objective=kto: the pipeline chunks the next-token loss "
     "alone"),
])
def test_what_cannot_work_is_refused_by_name(overrides, says):
    with pytest.raises(ConfigError, match=says.replace(".", r"\.")):
        validate(compose("+preset=smoke", *KTO, "data.path=rows.jsonl", *overrides))


# --- the loss: TRL's ------------------------------------------------------------------------------

@pytest.mark.parametrize("beta,desirable,undesirable,one_label", [
    (0.1, 1.0, 1.0, False), (0.5, 1.0, 1.0, False), (0.1, 1.33, 0.75, False), (0.5, 0.8, 1.2, False),
    (0.1, 1.0, 1.0, True)])
def test_the_loss_and_gradients_are_trls_on_the_same_batch(tmp_path, beta, desirable, undesirable, one_label):
    """TRL's KTOTrainer (LoRA, reference = adapters disabled) tokenizes the rows, rotates the completions for its
    KL pairs and computes its loss with its own _compute_loss; objective=kto computes on the same model, from the
    same tensors: loss and gradients within 1e-5, and TRL's rewards and KL. With every row desirable (one_label),
    the rejected side and the margin are left out, as TRL leaves them out (issue 58, item 6), never logged as 0."""
    import datasets
    from trl import KTOConfig, KTOTrainer

    from trainloop.data.loaders import byte_level_tokenizer
    from trainloop.model.adapter import lora_config
    from trainloop.model.builder import build_model, build_model_config
    from trainloop.objectives import build_objective

    rows = [row for row in unpaired(rule_pairs([(a, 2 * a + 1) for a in range(3)])) if row["label"] or not one_label]
    cfg = compose("+preset=smoke", *KTO, "adapter=lora", "data.path=rows.jsonl", f"objective.beta={beta}",
                  f"objective.desirable_weight={desirable}", f"objective.undesirable_weight={undesirable}")
    validate(cfg)
    tokenizer = byte_level_tokenizer()
    torch.manual_seed(0)
    base = build_model(cfg.model, build_model_config(cfg.model, len(tokenizer)))
    args = KTOConfig(output_dir=str(tmp_path / "trl"), report_to=[], beta=beta, desirable_weight=desirable,
                     undesirable_weight=undesirable, use_cpu=True, max_length=None,
                     per_device_train_batch_size=len(rows))
    trainer = KTOTrainer(model=base, args=args, train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=tokenizer, peft_config=lora_config(cfg.adapter))
    torch.manual_seed(1)
    for name, parameter in trainer.model.named_parameters():  # a policy away from its reference
        if "lora_B" in name:
            parameter.data.normal_(0, 0.2)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    trainer.model.train()
    trl_loss = trainer._compute_loss(trainer.model, batch, return_outputs=False)
    trl_loss.backward()
    trl_grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad()

    def labelled(ids, mask):
        return ids.masked_fill(mask == 0, -100)

    ours = {"input_ids": batch["input_ids"], "labels": labelled(batch["input_ids"], batch["completion_mask"]),
            "kl_input_ids": batch["KL_input_ids"], "kl_labels": labelled(batch["KL_input_ids"],
                                                                         batch["KL_completion_mask"]),
            "label": torch.as_tensor(batch["label"], dtype=torch.bool)}
    width = max(ours["input_ids"].shape[1], ours["kl_input_ids"].shape[1])  # one forward of both: one width
    for key, fill in (("input_ids", tokenizer.eos_token_id), ("labels", -100)):
        for prefix in ("", "kl_"):
            t = ours[prefix + key]
            ours[prefix + key] = torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill)
    objective = build_objective(cfg, "cpu")
    loss = objective.batch_loss(trainer.model, ours).summed / objective.count(ours)
    loss.backward()
    assert loss.item() == pytest.approx(trl_loss.item(), abs=1e-5)
    grads = {name: p.grad for name, p in trainer.model.named_parameters() if p.grad is not None}
    assert grads.keys() == trl_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, trl_grads[name], atol=1e-5, rtol=0, msg=name)
    means, trl = objective.means(objective.sums), trainer._metrics["train"]
    keys = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl")
    assert [key for key in keys if key in means] == [key for key in keys if trl.get(key)] == \
        [key for key in keys if not (one_label and key.endswith("rejected"))]
    for key in (key for key in keys if key in means):
        assert means[key] == pytest.approx(trl[key][-1], abs=1e-5), key
    assert ("rewards/margin" in means) is bool(trl.get("rewards/margins")) is not one_label
    assert means["kl"] > 0  # the clamp did not hide the estimate


# --- a run --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_kto_ranks_held_out_pairs_by_the_rule_its_labels_follow(tmp_path):
    """LoRA on a pretrained model, the rows of tests/data/preference.jsonl's pairs: on 40 pairs it never saw, the
    chosen completion's log-ratio to the base model is above the rejected one's for at least 90%, read from
    final/ (merged) and the base with transformers alone."""
    import random

    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = pretrained_llama(tmp_path / "base")
    pairs = [json.loads(line) for line in PAIRS.read_text().splitlines()]
    path = write_rows(tmp_path / "rows.jsonl", unpaired(pairs))
    run = train(tmp_path / "run", *KTO, "model=hf", f"model.name_or_path={base}", "adapter=lora", f"data.path={path}",
                "trainer.max_steps=40", "trainer.eval_every=20", "trainer.log_every=20", "optimizer.lr=1e-2")
    line = [r for r in read_metrics(run) if "loss" in r][-1]
    assert {"rewards/chosen", "rewards/rejected", "rewards/margin", "kl"} <= set(line)

    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    policy, reference = (AutoModelForCausalLM.from_pretrained(d).eval() for d in (run / "final", base))

    def logp(model, prompt: str, completion: str) -> float:
        ids = tokenizer(prompt + completion, return_tensors="pt").input_ids
        start = len(tokenizer(prompt).input_ids)
        with torch.no_grad():
            out = model(ids).logits[0, start - 1:-1].log_softmax(-1)
        return out.gather(1, ids[0, start:, None]).sum().item()

    rng = random.Random(0)
    held_out = rule_pairs([(rng.randrange(50, 100), rng.randrange(0, 50)) for _ in range(40)])
    right = sum(logp(policy, p["prompt"], p["chosen"]) - logp(reference, p["prompt"], p["chosen"])
                > logp(policy, p["prompt"], p["rejected"]) - logp(reference, p["prompt"], p["rejected"])
                for p in held_out)
    assert right >= 36, f"{right}/40 held-out pairs ranked by the rule"


@pytest.mark.slow
def test_two_processes_give_the_step_of_one_under_ddp_and_fsdp2_and_a_resume_that_of_no_stop(tmp_path):
    """A full fine-tune (the reference a frozen copy, sharded like the policy under FSDP2): 2 processes at
    batch 2 give the losses, rewards and KL of 1 at batch 4, the KL estimated over both ranks' rows; and 1
    process stopped by SIGTERM and resumed gives them bitwise."""
    from helpers import one_resumed_and_two_processes

    data = Path(__file__).resolve().parent / "data" / "unpaired.jsonl"
    step = [*KTO, f"data.path={data}", "trainer.max_steps=3", "trainer.eval_every=3", "trainer.eval_batches=null",
            "data.validation_fraction=0.2", "optimizer=sgd", "optimizer.lr=0.5"]
    one = one_resumed_and_two_processes(tmp_path, step, ("loss", "eval_loss", "rewards/chosen", "rewards/rejected",
                                                         "kl"))
    assert len(one) == 4 * 4 and len({x for _, key, x in one if key == "loss"}) > 1  # 3 train lines, 1 eval
