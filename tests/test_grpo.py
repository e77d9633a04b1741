"""Online RL with verifiable rewards, the first slice of issue 26: data=prompts reads TRL's
prompt-only rows by documented rules; reward functions load by import or file path and fail in
one line; objective=grpo's advantages and loss are TRL 1.16's on the same tensors (TRL's own code
runs); and a tiny model learns a verifiable toy task on CPU, on one process, two and with LoRA.

Real parts only: the composed config, `datasets` and pyarrow reading jsonl and parquet, the
built-in byte-level tokenizer, a tiny transformers Llama (peft's LoRA), TRL's GRPOTrainer, 2 processes over gloo.
"""

from __future__ import annotations

import copy
import json
import math
import re
import signal
from pathlib import Path

import pytest
import torch

from helpers import (
    SMALL, clean_env, compose, launch, once, pretrained_llama, read_metrics, reset_accelerate, run_log, train, warm,
    write_rows,
)
from trainloop.config.compose import ConfigError, check_command_line, validate

DATA = Path(__file__).resolve().parent / "data"
PROMPTS = DATA / "prompts.jsonl"
REWARDS = DATA / "grpo_rewards.py"  # the toy task's reward function, loaded by its file path
GRPO = ["data=prompts", "objective=grpo", f"objective.rewards=[{REWARDS}:letters]"]


def build(path: Path, *overrides: str):
    from trainloop.data.loaders import build_datasets, byte_level_tokenizer

    cfg = compose("+preset=smoke", *GRPO, f"data.path={path}", *overrides)
    validate(cfg)
    return build_datasets(cfg.data, byte_level_tokenizer(), cfg.trainer.seed)


def prompt_text(tokenizer, item: dict) -> str:
    return tokenizer.decode(item["prompt_ids"][item["prompt_mask"].bool()])


# --- the format -------------------------------------------------------------------------------

def test_text_and_conversational_prompts_keep_their_other_columns(tmp_path):
    import pandas

    from trainloop.data.loaders import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a), "level": {"hard": a > 5}} for a in range(10)]
    train, valid = build(write_rows(tmp_path / "plain.jsonl", rows))
    assert len(train) + len(valid) == 10 and len(valid) >= 1
    item = train[0]
    assert item["prompt_ids"].shape == item["prompt_mask"].shape == (64,)  # padded on the left to data.seq_len
    assert item["prompt_mask"][-1] == 1 and item["prompt_mask"][0] == 0
    row = json.loads(item["row"])
    assert prompt_text(tokenizer, item) == row["prompt"] and row["answer"] == str(2 * int(row["prompt"].split("+")[0]))
    assert isinstance(row["level"]["hard"], bool)  # a column keeps its JSON type for the reward functions

    chats = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
    pandas.DataFrame(chats).to_parquet(tmp_path / "chat.parquet")
    for path in (write_rows(tmp_path / "chat.jsonl", chats), tmp_path / "chat.parquet"):
        train, valid = build(path)
        item = train[0]
        row = json.loads(item["row"])
        # rendered with the (built-in) chat template, ending with the generation prompt
        assert prompt_text(tokenizer, item) == f"<|user|>\n{row['prompt'][0]['content']}{tokenizer.eos_token}\n<|assistant|>\n"


@pytest.mark.parametrize("row, says", [
    ({"answer": "2"}, r"data.prompt_field='prompt' is missing or empty; every row needs a prompt"),
    ({"prompt": 3}, r"data.prompt_field='prompt' is a number: give text, or a list of \{role, content\} messages"),
    ({"prompt": [{"role": "user"}]}, r"message 1 \(user\) has no content"),
    ({"prompt": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]},
     r"last turn is the assistant's"),
    ({"prompt": [{"role": "user", "content": "1+1="}]}, r"mixes text and conversations with .*plain.jsonl:1"),
])
def test_a_bad_row_is_refused_naming_its_file_and_line(tmp_path, row, says):
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(5)]
    path = write_rows(tmp_path / "plain.jsonl", [*rows, row, *rows])
    with pytest.raises(ConfigError, match=rf"^{path}:6: .*{says}.*; fix or remove that row$"):
        build(path)


def test_long_prompts_are_skipped_and_counted(tmp_path, caplog):
    rows = [{"prompt": "short"}] * 4 + [{"prompt": "x" * 70}]
    with caplog.at_level("WARNING", logger="trainloop"):
        train, valid = build(write_rows(tmp_path / "p.jsonl", rows))
    assert len(train) + len(valid) == 4
    assert "skipped 1 of 5, whose prompt is longer than data.seq_len=64 tokens" in caplog.text
    with pytest.raises(ConfigError, match=r"^data.seq_len=4: every one of the 5 prompts is longer"):
        build(tmp_path / "p.jsonl", "data.seq_len=4")


def test_csv_is_refused_as_its_columns_lose_their_types(tmp_path):
    (tmp_path / "p.csv").write_text("prompt,answer\n1+1=,2\n")
    with pytest.raises(ConfigError, match=r"data=prompts reads json, jsonl or parquet files"):
        build(tmp_path / "p.csv")


# --- the config -------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, says", [
    (["data=prompts", "objective=grpo"], r"objective.rewards=\[\] names no reward function"),
    ([*GRPO[:2], "objective.rewards=[no_such_module:f]"],
     r"objective.rewards\[0\]='no_such_module:f': module no_such_module cannot be imported \(ModuleNotFoundError"),
    ([*GRPO[:2], f"objective.rewards=[{REWARDS}:missing]"], rf"objective.rewards\[0\]='{REWARDS}:missing': .* has no function missing"),
    ([*GRPO[:2], "objective.rewards=[tests/nowhere.py:f]"], r"objective.rewards\[0\]='tests/nowhere.py:f': no such file tests/nowhere.py"),
    ([*GRPO, "objective.reward_weights=[1.0,2.0]"], r"objective.reward_weights has 2 weights for 1 reward functions"),
    ([*GRPO, "objective.loss_type=sigmoid"],
     r"objective.loss_type=sigmoid is not one of objective=grpo's: dapo, grpo, dr_grpo, bnpo, luspo, cispo, sapo, vespo"),
    ([*GRPO, "objective.scale_rewards=mean"], r"objective.scale_rewards=mean is not one of: group, batch, none"),
    ([*GRPO, "objective.num_generations=1"], r"objective.num_generations=1: a group needs at least 2 completions"),
    ([*GRPO, "objective.max_new_tokens=1000"], r"data.seq_len=64 \(the longest prompt\) \+ objective.max_new_tokens=1000"),
    ([*GRPO, "objective.importance_sampling_level=word"], r"objective.importance_sampling_level=word is not one of"),
    ([*GRPO, "objective.top_entropy_quantile=1.5"], r"objective.top_entropy_quantile=1.5 must be in \[0, 1\]"),
    ([*GRPO, "objective.loss_type=sapo", "objective.sapo_temperature_neg=0"],
     r"objective.sapo_temperature_neg=0.0 must be greater than 0"),
    ([*GRPO, "objective.generation=vllm"], r"objective.generation=vllm is not one of: generate, continuous"),
    ([*GRPO, "objective.generation=continuous", "precision=bf16"],
     r"objective.generation=continuous keeps its KV cache in the weights' dtype, and precision=bf16"),
    ([*GRPO, "objective.generation=continuous", "fsdp=full_shard"],
     r"objective.generation=continuous runs each process on its own schedule, and FSDP2"),
    ([*GRPO, "objective.generation=continuous", "deepspeed=zero3"],
     r"objective.generation=continuous runs each process on its own schedule, and DeepSpeed ZeRO-3"),
    (["data=prompts"], r"data=prompts holds prompts alone, which objective=causal_lm does not train on: set objective=grpo"),
    (GRPO[1:], r"objective=grpo trains on prompts alone, and data=pydoc holds none: set data=prompts"),
])
def test_what_cannot_work_is_refused_naming_the_key(overrides, says):
    with pytest.raises(ConfigError, match=rf"\n  {says}"):
        validate(compose("+preset=smoke", *overrides, f"data.path={PROMPTS}"))


def test_the_objective_keys_are_read_only_by_grpo():
    with pytest.raises(ConfigError, match="objective.num_generations=4 has no effect unless objective=grpo"):
        check_command_line(compose("objective.num_generations=4"), ["objective.num_generations=4"])
    check_command_line(compose(*GRPO, "objective.num_generations=4"), ["objective.num_generations=4"])


# --- advantages and loss: TRL's own code on the same tensors ----------------------------------------

G, N_PROMPTS, MAX_NEW = 4, 3, 8


def preset_rewards() -> tuple[list, list]:
    """Two reward functions' values for 12 completions: None where one does not apply, a group whose
    rewards all tie (zero std), and a completion neither function scores."""
    first = [1.0, 0.0, 0.5, None, 0.3, 0.3, 0.3, 0.3, 2.0, -1.0, None, 0.25]
    second = [0.5, None, 1.0, 1.0, None, None, None, None, 0.0, 1.0, None, -0.5]
    return first, second


def trl_grpo(tmp_path, loss_type: str, scale: str):
    """TRL's GRPOTrainer on the smoke preset's tiny model, whose two reward functions return the
    preset values; and what _generate_and_score_completions made of 3 prompts x 4 completions."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from trainloop.data.loaders import byte_level_tokenizer
    from trainloop.model.builder import build_model, build_model_config

    cfg = compose("+preset=smoke", *GRPO)
    first, second = preset_rewards()

    def reward_a(prompts, completions, **kwargs):
        return first[:len(completions)]

    def reward_b(prompts, completions, **kwargs):
        return second[:len(completions)]

    tokenizer = byte_level_tokenizer()
    torch.manual_seed(0)
    model = build_model(cfg.model, build_model_config(cfg.model, len(tokenizer)))
    prompts = [{"prompt": f"Write {w}:"} for w in ("apple", "river", "stone")]  # one length: no left padding
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, num_generations=G,
                      per_device_train_batch_size=G * N_PROMPTS, max_completion_length=MAX_NEW, loss_type=loss_type,
                      scale_rewards=scale, beta=0.0, epsilon=0.2, epsilon_high=0.28, temperature=0.7,
                      reward_weights=[1.0, 0.5], logging_steps=1, bf16=False)  # fp32 throughout, as ours
    trainer = GRPOTrainer(model=model, reward_funcs=[reward_a, reward_b], args=args, processing_class=tokenizer,
                          train_dataset=datasets.Dataset.from_list(prompts))
    torch.manual_seed(1)
    generated = trainer._generate_and_score_completions([p for p in prompts for _ in range(G)])
    return trainer, generated


# What the loss tests set on the trainer, which _compute_loss reads from itself (GRPOTrainer.__init__ only copies
# loss_type from its config, and TRL's generation reads none of them)
TRAINER_KEYS = ("loss_type", "beta", "epsilon_high", "importance_sampling_level", "top_entropy_quantile")


@pytest.fixture(scope="module")
def trl_generated(tmp_path_factory):
    """trl_grpo(..., "dapo", scale) made once a module for each scale the tests ask for, and given back as made:
    its TRAINER_KEYS, metrics and gradients as they were after the generation."""
    made = {}

    def as_made(scale: str):
        if scale not in made:
            trainer, generated = trl_grpo(tmp_path_factory.mktemp("trl"), "dapo", scale)
            made[scale] = trainer, generated, {key: getattr(trainer, key) for key in TRAINER_KEYS}, \
                copy.deepcopy(trainer._metrics)
        trainer, generated, keys, metrics = made[scale]
        for key, value in keys.items():
            setattr(trainer, key, value)
        trainer._metrics = copy.deepcopy(metrics)
        trainer.model.zero_grad(set_to_none=True)
        return trainer, generated

    return as_made


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_the_advantages_are_trls_for_the_same_rewards(trl_generated, scale):
    from accelerate import Accelerator

    from trainloop.objectives import build_objective
    from trainloop.objectives.policy_gradient import group_advantages
    from trainloop.parallel import build_strategy

    _, generated = trl_generated(scale)
    rewards = torch.tensor([[math.nan if v is None else v for v in col] for col in preset_rewards()]).T
    cfg = compose("+preset=smoke", *GRPO, f"objective.scale_rewards={scale}")
    reset_accelerate()
    strategy = build_strategy(cfg, Accelerator(cpu=True))
    objective = build_objective(cfg, "cpu")
    ours, _ = group_advantages(rewards, torch.tensor([1.0, 0.5]), G, scale,
                               lambda x: objective.batch_moments(strategy, x))
    assert (ours - generated["advantages"]).abs().max().item() <= 1e-6, (ours, generated["advantages"])
    print(f"scale_rewards={scale}: |advantages - TRL's| <= {(ours - generated['advantages']).abs().max().item():.1e}")
    assert ours[10] == 0.0 and ours[4:8].abs().max() <= 1e-6  # unscored: 0; a tied group: 0


# (loss_type, beta, other keys of ours, TRL's attributes for them): every loss type; GSPO's
# sequence-level ratio; the 80/20 entropy mask; cispo's cap where some ratios pass it
LOSSES = [*((loss, beta, {}) for loss in ("dapo", "grpo", "dr_grpo") for beta in (0.0, 0.04)),
          *((loss, 0.04, {}) for loss in ("bnpo", "sapo", "luspo", "vespo")),
          ("cispo", 0.04, {"epsilon_high": 1.2}),
          ("grpo", 0.04, {"importance_sampling_level": "sequence"}),
          ("dapo", 0.0, {"importance_sampling_level": "sequence"}),
          ("luspo", 0.0, {"importance_sampling_level": "sequence"}),
          ("dapo", 0.04, {"top_entropy_quantile": 0.2}),
          ("cispo", 0.0, {"epsilon_high": 1.02, "importance_sampling_level": "sequence", "top_entropy_quantile": 0.5})]
TRL_METRIC = {"cispo": "cispo_clip_ratio", "vespo": "vespo/phi_seq_mean"}  # else clip_ratio/region_mean


@pytest.mark.parametrize("loss_type, beta, keys", LOSSES,
                         ids=[f"{loss}-beta{beta}" + "".join(f"-{k}={v}" for k, v in keys.items())
                              for loss, beta, keys in LOSSES])
def test_the_loss_is_trls_for_the_same_log_probs(trl_generated, loss_type, beta, keys):
    """TRL's _compute_loss and ours on the model TRL generated with, the completions and masks it
    made, its advantages, and old and reference log-probabilities away from the policy's (so that
    the ratio is clipped on some tokens and the KL is not 0)."""
    from accelerate import Accelerator

    from trainloop.objectives import build_objective
    from trainloop.objectives.policy_gradient import completion_logps
    from trainloop.parallel import build_strategy

    trainer, generated = trl_generated("group")
    trainer.loss_type = loss_type  # built with dapo, which the generation does not read
    trainer.beta = beta  # built with beta=0 (no reference model); the reference log-probs are given below
    trainer.current_gradient_accumulation_steps = 1
    for key, value in keys.items():  # the trainer reads these from itself
        setattr(trainer, key, value)
    prompt_ids, completion_ids = generated["prompt_ids"], generated["completion_ids"]
    mask = generated["completion_mask"]
    attention = torch.cat([generated["prompt_mask"], mask], 1)
    batch = {"input_ids": torch.cat([prompt_ids, completion_ids], 1), "attention_mask": attention,
             "position_ids": (attention.cumsum(1) - 1).clamp(min=0), "completion_mask": mask,
             "advantages": generated["advantages"]}
    cfg = compose("+preset=smoke", *GRPO, f"objective.loss_type={loss_type}", f"objective.beta={beta}",
                  "objective.epsilon_high=0.28", "objective.temperature=0.7", f"objective.max_new_tokens={MAX_NEW}",
                  *(f"objective.{key}={value}" for key, value in keys.items()))
    reset_accelerate()
    strategy = build_strategy(cfg, Accelerator(cpu=True))
    objective = build_objective(cfg, "cpu")
    objective.strategy = strategy  # the entropy mask's quantile is over every rank's tokens (start() sets it)
    model = trainer.model
    model.train()
    with torch.no_grad():
        logps = completion_logps(model, batch, 0.7)
    torch.manual_seed(2)
    batch["old_logps"] = logps + 0.3 * torch.randn_like(logps)
    batch["ref_logps"] = logps + 0.5 * torch.randn_like(logps)
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": generated["prompt_mask"], "completion_ids": completion_ids,
              "completion_mask": mask, "advantages": generated["advantages"], "num_items_in_batch": mask.sum(),
              "old_per_token_logps": batch["old_logps"], "ref_per_token_logps": batch["ref_logps"]}
    trl_loss = trainer._compute_loss(model, inputs)
    trl_loss.backward()
    trl_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ours = objective.batch_loss(model, batch).summed / objective.count(batch)
    ours.backward()
    assert abs(ours.item() - trl_loss.item()) <= 1e-6, (ours.item(), trl_loss.item())
    # the same gradient too (the KL's ratio factor moves it even where the ratio is 1)
    worst = max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), trl_grads))
    assert worst <= 1e-6 * max(g.abs().max().item() for g in trl_grads), worst
    print(f"{loss_type} beta={beta} {keys}: |loss - TRL's| = {abs(ours.item() - trl_loss.item()):.1e}, "
          f"gradient {worst:.1e}")
    metrics = trainer._metrics["train"]
    window = objective.window(strategy)
    if loss_type == "sapo":  # no clipping to count, in TRL's metrics and ours
        assert "clip_ratio" not in window and not any(k.startswith("clip_ratio") for k in metrics)
    else:
        name = TRL_METRIC.get(loss_type, "clip_ratio/region_mean")
        ours_name = "vespo_phi" if loss_type == "vespo" else "clip_ratio"
        assert window[ours_name] == pytest.approx(metrics[name][-1], abs=1e-6)
        assert 0 < window[ours_name] < (10 if loss_type == "vespo" else 1)
    if beta:
        assert window["kl"] == pytest.approx(metrics["kl"][-1], abs=1e-6) and window["kl"] > 0
    reset_accelerate()


def test_the_entropy_mask_keeps_the_top_share_of_the_tokens():
    """top_entropy_quantile keeps the completion tokens at or above the (1 - q) quantile of the
    micro-batch's completion tokens (every rank's: one rank here), padding neither kept nor counted."""
    from accelerate import Accelerator

    from trainloop.objectives import build_objective
    from trainloop.parallel import build_strategy

    cfg = compose("+preset=smoke", *GRPO, "objective.top_entropy_quantile=0.25")
    reset_accelerate()
    objective = build_objective(cfg, "cpu")
    objective.strategy = build_strategy(cfg, Accelerator(cpu=True))
    entropies = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.8, 0.2, 0.4]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])  # 7.0 is padding: never kept, never counted
    kept = objective.high_entropy(entropies, mask)
    # the 0.75 quantile of the 7 tokens [0.1, 0.2, 0.3, 0.4, 0.5, 0.8, 0.9] is 0.65 (linear): 0.8 and 0.9 kept
    assert kept.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]
    objective.cfg.top_entropy_quantile = 0.0  # the highest-entropy token alone
    assert objective.high_entropy(entropies, mask).sum().item() == 1.0
    reset_accelerate()


# --- it learns --------------------------------------------------------------------------------

# The toy task: whatever the prompt, write lowercase letters (tests/data/grpo_rewards.py:letters, the
# share of a completion's characters that are). A random tiny model writes about 1 in 10.
TASK = [*GRPO, f"data.path={PROMPTS}", "objective.num_generations=8", "objective.max_new_tokens=6",
        "data.validation_fraction=0.2", "scheduler=constant", "checkpoint.save_final_model=false"]
FULL = [*TASK, "data.batch_size=4", "optimizer.lr=1e-2", "trainer.max_steps=14", "trainer.eval_every=14"]


def reward_curve(run_dir: Path) -> list[float]:
    return [r["reward"] for r in read_metrics(run_dir) if "reward" in r]


def assert_learned(run_dir: Path) -> None:
    curve = reward_curve(run_dir)
    print(f"{run_dir.name}: reward by step {[round(r, 2) for r in curve]}")
    assert curve[0] < 0.2 <= 0.8 <= curve[-1], curve  # the step-0 completions' reward, then the last step's
    held_out = [r for r in read_metrics(run_dir) if "eval_reward" in r][-1]
    assert held_out["eval_reward"] >= 0.8 and held_out["eval_loss"] == -held_out["eval_reward"]


def test_a_tiny_model_learns_the_toy_task(tmp_path):
    run_dir = train(tmp_path / "full", *FULL)
    assert_learned(run_dir)
    lines = read_metrics(run_dir)
    line = next(r for r in lines if "reward" in r)
    assert line["rewards/letters"] == line["reward"] and line["reward_std"] > 0
    assert line["completion_length"] == line["completion_length_max"] == 6 and line["truncated_share"] == 1.0
    assert line["clip_ratio"] == 0.0 and "kl" not in line  # on-policy (num_iterations=1), and beta=0
    assert line["generation_s"] > 0 and line["generated_tokens_per_s"] == pytest.approx(32 * 6 / line["generation_s"])
    shown = [r for r in lines if r.get("event") == "samples"]
    assert len(shown) == 14 and set(shown[-1]["samples"][0]) == {"prompt", "text", "rewards"}
    assert shown[-1]["samples"][0]["prompt"].startswith("Write ")


def test_gradient_checkpointing_gives_the_same_rewards(tmp_path):
    """Generation runs the model in eval mode with its cache; training recomputes the activations."""
    plain = train(tmp_path / "plain", *FULL, "trainer.max_steps=5")
    recomputed = train(tmp_path / "recomputed", *FULL, "trainer.max_steps=5", "model.gradient_checkpointing=true")
    assert reward_curve(recomputed) == pytest.approx(reward_curve(plain), abs=1e-6)
    assert len(set(reward_curve(plain))) > 1


def test_lora_learns_with_a_kl_to_the_model_without_its_adapters(tmp_path):
    """beta > 0: the reference is the model with its adapters disabled. A frozen random head bounds
    the logits, so the adapters cover the head too (and sampling is sharper)."""
    run_dir = train(tmp_path / "lora", *TASK, "adapter=lora", "objective.beta=0.04", "objective.temperature=0.25",
                    "adapter.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]",
                    "data.batch_size=4", "optimizer.lr=2e-2", "trainer.max_steps=8", "trainer.eval_every=8")
    assert_learned(run_dir)
    kl = [r["kl"] for r in read_metrics(run_dir) if "kl" in r]
    assert kl[0] == 0.0 < kl[-1]  # the policy starts as its reference, then moves away


def test_a_full_fine_tune_with_a_kl_keeps_a_frozen_reference_copy(tmp_path, caplog):
    """beta > 0 without an adapter: the reference is a frozen copy of the starting model (as DPO's,
    placed by the strategy). The first step's KL is 0, then it grows; the task is still learned."""
    import logging

    with caplog.at_level(logging.INFO, logger="trainloop"):
        run_dir = train(tmp_path / "full", *FULL, "objective.beta=0.04")
    kl = [r["kl"] for r in read_metrics(run_dir) if "kl" in r]
    assert kl[0] == 0.0 < kl[-1]
    assert "objective=grpo: the KL's reference is a frozen copy of the starting model, whole on each rank" in caplog.text
    assert_learned(run_dir)


def test_num_iterations_trains_each_generated_batch_that_many_steps(tmp_path):
    """objective.num_iterations=2: prompts are read every other step (an epoch of 16 prompts, 4 a
    step, lasts 8 steps, not 4); the second step trains on the same completions, its ratio to the
    policy that sampled them moved by the first update, so some tokens are clipped."""
    run_dir = train(tmp_path / "twice", *FULL, "objective.num_iterations=2", "trainer.max_steps=10")
    lines = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [("reward" in r) for r in lines] == [True, False] * 5  # generated on odd steps only
    assert all(r["clip_ratio"] == 0.0 for r in lines[::2]) and all(r["clip_ratio"] > 0 for r in lines[1::2])
    assert [r["epoch"] for r in lines] == [0] * 8 + [1] * 2


def on_two_processes(run_dir: Path, *overrides: str) -> str:
    """A 2-process run's log."""
    done = warm(2, [*SMALL, *overrides, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent)
    assert {r["world_size"] for r in read_metrics(run_dir)} == {2}
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> Path:
    """2 processes over gloo, 2 prompts each, under DDP: the run the sharded strategies must match."""
    return once(tmp_path_factory, "grpo-ddp", lambda path: on_two_processes(path / "ddp", *FULL, "data.batch_size=2")) / "ddp"


@pytest.mark.slow
def test_two_processes_learn_it_under_ddp(ddp):
    assert_learned(ddp)


@pytest.mark.slow
def test_fsdp2_gives_ddps_rewards(ddp, tmp_path):
    """Every rank generates together while FSDP2 shards the weights: the same rewards, step by step."""
    fsdp = tmp_path / "fsdp"
    assert "FSDP2 full_shard over 2 shard(s)" in on_two_processes(fsdp, *FULL, "data.batch_size=2", "fsdp=full_shard")
    assert reward_curve(fsdp) == pytest.approx(reward_curve(ddp), abs=1e-6)


@pytest.mark.slow
def test_zero3_gives_ddps_rewards(ddp, tmp_path, deepspeed_ops):
    """ZeRO-3 partitions the parameters: each generation forward gathers them on every rank together."""
    zero3 = tmp_path / "zero3"
    assert "DeepSpeed ZeRO-3 engaged" in on_two_processes(zero3, *FULL, "data.batch_size=2", "deepspeed=zero3")
    assert reward_curve(zero3) == pytest.approx(reward_curve(ddp), abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["fsdp=full_shard", "deepspeed=zero3"])
def test_lora_sharded_generates_and_takes_its_reference(tmp_path, sharding, request):
    """A PEFT model's generate reaches the inner model past FSDP2's root hooks: trainloop.parallel.sharding marks
    generate as a forward, so its embeddings are gathered; the KL's reference is the same sharded
    model with its adapters disabled (under ZeRO-3, the engine's module). An environment (Echo) on each
    rank gives each rollout its own instance, reset with its row, whose reward is a column of its own."""
    if sharding.startswith("deepspeed"):
        request.getfixturevalue("deepspeed_ops")
    run_dir = tmp_path / "lora"
    on_two_processes(run_dir, *TASK, "adapter=lora", "objective.beta=0.04", sharding,
                     f"objective.environment={REWARDS}:Echo", "data.batch_size=2", "optimizer.lr=1e-2",
                     "trainer.max_steps=3", "trainer.eval_every=3",
                     # ZeRO-3 gathers every layer for each token generated, on every rank: 4 rollouts of 3
                     # tokens a prompt (not the task's 8 of 6): the ZeRO-3 case from 118 s to 17 s in the suite
                     "objective.num_generations=4", "objective.max_new_tokens=3")
    lines = [r for r in read_metrics(run_dir) if "kl" in r]
    kl = [r["kl"] for r in lines]
    assert len(kl) == 3 and kl[0] == 0.0 < kl[-1]
    assert [r["rewards/Echo"] for r in lines] == [1.0] * 3
    assert [r for r in read_metrics(run_dir) if "eval_reward" in r]


def test_a_stopped_run_resumes_to_the_same_completions_and_losses(tmp_path):
    """objective.num_iterations=2, stopped after step 3 (saved inside the window of steps 3 and 4)
    and resumed: step 4 trains on step 3's completions, which the checkpoint holds, and steps 5 and 6
    sample the completions a straight run does (their generator is seeded by the step): bitwise the
    losses and rewards of a straight run."""
    steps = [*FULL, "trainer.max_steps=6", "trainer.eval_every=3", "objective.num_iterations=2"]
    straight = train(tmp_path / "straight", *steps)
    stopped = tmp_path / "stopped"
    train(stopped, *steps, "trainer.stop_at_step=3")
    assert (stopped / "checkpoints" / "step_0000003" / "objective_0.pt").is_file()
    train(stopped, *steps)

    def lines(run_dir, after=0):
        keys = ("loss", "reward", "reward_std", "clip_ratio", "eval_reward", "samples")
        return [(r["step"], key, r[key]) for r in read_metrics(run_dir) for key in keys if key in r and r["step"] > after]

    assert [step for step, key, _ in lines(stopped) if key == "loss"] == [1, 2, 3, 4, 5, 6]  # resumed, not restarted
    assert lines(stopped, after=3) == lines(straight, after=3) and len(lines(straight, after=3)) >= 10
    # step 4 trained on step 3's completions after an update: its ratio moved (generated anew, it would be 1)
    assert [value > 0 for step, key, value in lines(stopped) if key == "clip_ratio"] == [False, True] * 3


@pytest.mark.slow
def test_sigterm_mid_run_and_the_same_command_again_give_the_straight_runs_rewards(tmp_path):
    """Acceptance 4 of issue 26 and 5 of issue 38: with objective.num_iterations=3, a SIGTERM in
    the middle of step 4 (sent by the reward function, at its second call: step 4's rollouts) ->
    the step ends, is saved inside its window (steps 4 to 6), exit 75; the same command again
    resumes it, and the losses, rewards and completions of every later step are bitwise the ones
    of a run that was not stopped."""
    args = [*SMALL, *FULL, "trainer.max_steps=9", "trainer.eval_every=5", "objective.num_iterations=3",
            f"objective.rewards=[{REWARDS}:letters_then_sigterm]"]
    straight = tmp_path / "straight"
    warm(1, [*args, f"hydra.run.dir={straight}"])
    run = tmp_path / "run"
    stopped = launch(["python", "-m", "trainloop", *args, f"hydra.run.dir={run}"], check=False,
                     env=clean_env(GRPO_SIGTERM_AT_CALL="2"))
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert max(r["step"] for r in read_metrics(run) if "loss" in r) == 4
    assert (run / "checkpoints" / "step_0000004" / "objective_0.pt").is_file()
    warm(1, [*args, f"hydra.run.dir={run}"])

    def after(run_dir, step):
        keys = ("loss", "reward", "reward_std", "clip_ratio", "completion_length", "eval_reward", "samples")
        return [(r["step"], key, r[key]) for r in read_metrics(run_dir) for key in keys
                if key in r and r["step"] > step]

    assert after(run, 4) == after(straight, 4) and len(after(straight, 4)) >= 12
    assert "generating a new one" not in run_log(run)


# --- a reward function that fails -------------------------------------------------------------------

@pytest.mark.slow
def test_a_reward_function_that_raises_ends_the_run_in_one_line_keeping_its_checkpoints(tmp_path):
    """grpo_rewards.py:fails raises on a completion holding a 'q' (from step 3 on): the run exits 2 with one
    line naming the function and the row; the checkpoints saved before it are complete (the last 2)."""
    run_dir = tmp_path / "run"
    done = warm(1, [*SMALL, *FULL, f"objective.rewards=[{REWARDS}:letters,{REWARDS}:fails]",
                   "checkpoint.every_steps=1", f"hydra.run.dir={run_dir}"], cwd=tmp_path, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert f"the reward function {REWARDS}:fails raised ZeroDivisionError: float division by zero (on completion " in last
    assert "q" in last.split("completion ")[-1] and "Traceback" not in done.stderr
    failed_at = len([r for r in read_metrics(run_dir) if "loss" in r])
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert failed_at >= 2 and saved == [f"step_{s:07d}" for s in range(1, failed_at + 1)][-2:]  # keep_last=2


def test_a_reward_function_of_the_wrong_length_is_named(tmp_path):
    with pytest.raises(ConfigError, match=rf"^the reward function {REWARDS}:too_few returned 31 values for 32 "
                                          r"completions: it must return a list with one number \(or None\) per"):
        train(tmp_path / "run", *FULL, f"objective.rewards=[{REWARDS}:too_few]")


# --- rewards that were not computed (issue 33) ------------------------------------------------------

CHEAP = [*TASK, "data.batch_size=2", "objective.num_generations=2", "objective.max_new_tokens=4",
         "trainer.eval_batches=1"]  # 4 completions a step


def test_train_from_python_takes_a_reward_function_defined_in_the_caller(tmp_path):
    """Issue 58, item 11: trainloop.train runs GRPO in this process with a reward function defined here (a
    notebook's), named by its own name in the metrics; it returns the run dir and the last train and eval
    values, and train.log has the run's lines. The same key given twice is refused."""
    import trainloop

    scored = []

    def short(prompts, completions, **columns):
        scored.append(len(completions))
        return [1.0 if len(c) < 3 else 0.0 for c in completions]

    overrides = [*SMALL, *(o for o in CHEAP if not o.startswith("objective.rewards")), "trainer.max_steps=2"]
    done = trainloop.train(overrides, rewards=[short], run_dir=tmp_path / "run")
    assert done.run_dir == tmp_path / "run" and scored
    assert {"loss", "reward", "rewards/short", "eval_loss", "eval_reward"} <= set(done.metrics) and \
        done.metrics["step"] == 2
    assert re.search(r"\] - step 2  loss ", (tmp_path / "run" / "train.log").read_text())
    with pytest.raises(ConfigError, match=r"^objective.rewards is given twice: as Python objects to trainloop.train"):
        trainloop.train(CHEAP, rewards=[short], run_dir=tmp_path / "twice")


def test_completions_cut_at_the_budget_are_counted_and_most_cut_warns_once_naming_the_key(tmp_path, caplog):
    """Issue 58, item 2: 4 new tokens are too few for the random model to end its answers: truncated_share
    says so on every line, and one warning names objective.max_new_tokens."""
    import logging

    with caplog.at_level(logging.WARNING, logger="trainloop"):
        run = train(tmp_path / "run", *CHEAP, "trainer.max_steps=2", "trainer.log_every=1", "trainer.eval_every=2")
    shares = [r["truncated_share"] for r in read_metrics(run) if "loss" in r]
    assert len(shares) == 2 and all(share > 0.5 for share in shares), shares
    warned = [r.getMessage() for r in caplog.records if "objective.max_new_tokens" in r.getMessage()]
    assert len(warned) == 1 and re.match(r"objective=grpo: \d of 4 completions since the last line were cut at "
                                         r"objective.max_new_tokens=4: .*raise objective.max_new_tokens", warned[0])


def test_a_pretrained_model_trains_at_the_objectives_default_lr_and_the_start_up_line_says_so(tmp_path, caplog):
    """Issue 58, item 4: objective=grpo with model=hf and no optimizer.lr trains at TRL's GRPOConfig default,
    1e-6 (a from-scratch 1e-3 collapsed a pretrained policy in 4 steps), and the start-up line says so; the
    tiny model trained from scratch keeps 1e-3, and a given optimizer.lr is taken as given."""
    import logging

    base = pretrained_llama(tmp_path / "base")
    one_step = [*CHEAP, "trainer.max_steps=1", "trainer.log_every=1", "trainer.eval_every=1"]
    runs = {"hf": ["model=hf", f"model.name_or_path={base}"], "hf_given": ["model=hf", f"model.name_or_path={base}",
            "optimizer.lr=3e-5"], "tiny": []}
    said = {}
    for name, overrides in runs.items():
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="trainloop"):
            run = train(tmp_path / name, *one_step, *overrides)
        said[name] = caplog.text
        runs[name] = [r["lr"] for r in read_metrics(run) if "loss" in r]
    assert runs == {"hf": [1e-6], "hf_given": [3e-5], "tiny": [1e-3]}
    assert "blocks of 64 tokens | lr 1e-06: objective=grpo's default for a pretrained model (TRL's GRPOConfig)\n" \
        in said["hf"]
    assert "default for a pretrained model" not in said["hf_given"] + said["tiny"]


@pytest.mark.parametrize("function, value, row", [("nan_first", "nan", 0), ("infinite_last", "inf", 2)])
def test_a_nan_or_infinite_reward_is_a_broken_verifier_named_with_its_row(function, value, row):
    """None says "does not apply"; NaN or inf says the verifier broke: refused, not read as None."""
    from trainloop.objectives.rewards import Rewards

    spec = f"{REWARDS}:{function}"
    with pytest.raises(ConfigError, match=rf"^the reward function {re.escape(spec)} returned {value} for completion "
                                          rf"{row} of the batch, prompt 'p{row}', completion 'c{row}': give a finite"):
        Rewards([f"{REWARDS}:letters", spec]).score(["p0", "p1", "p2"], ["c0", "c1", "c2"], {})


def test_a_nan_reward_or_a_step_that_nothing_scored_stops_the_run_before_it_logs(tmp_path):
    """Acceptance 1 of issue 33: NaN for one completion stops the run at its first step, naming
    the function and the row; so does a step whose every completion each function returned None
    for. Neither logs a train line (no reward of 0.0 that nothing computed)."""
    with pytest.raises(ConfigError, match=rf"^the reward function {re.escape(str(REWARDS))}:nan_first returned nan "
                                          r"for completion 0 of the batch, prompt 'Write \w+:'"):
        train(tmp_path / "nan", *CHEAP, f"objective.rewards=[{REWARDS}:letters,{REWARDS}:nan_first]")
    with pytest.raises(ConfigError, match=r"^no reward function scored any of the 4 completions of step 1: "
                                          rf"{re.escape(str(REWARDS))}:none returned None for each; give a number"):
        train(tmp_path / "none", *CHEAP, f"objective.rewards=[{REWARDS}:none]")
    for run_dir in (tmp_path / "nan", tmp_path / "none"):
        assert not [r for r in read_metrics(run_dir) if "loss" in r]


# Scores the completions of its first call (step 1's) and no completion after it (the evaluation's).
FIRST_CALL_ONLY = '''
calls = []


def first_call_only(prompts, completions, **columns):
    calls.append(1)
    return [1.0 if len(calls) == 1 else None for _ in completions]
'''


def test_an_evaluation_that_nothing_scored_stops_the_run_in_one_line(tmp_path):
    """Issue 33: the mean reward of no scored completion is not a reward of 0.0. An evaluation whose
    greedy completions no function scored stops the run naming the functions, and logs no eval line."""
    rewards = tmp_path / "first_call.py"
    rewards.write_text(FIRST_CALL_ONLY)
    with pytest.raises(ConfigError, match=r"^no reward function scored any of the greedy completions of the "
                                          rf"validation prompts: {re.escape(str(rewards))}:first_call_only returned "
                                          "None for each"):
        train(tmp_path / "run", *CHEAP, f"objective.rewards=[{rewards}:first_call_only]", "trainer.max_steps=1",
              "trainer.eval_every=1", "trainer.log_every=1")
    metrics = read_metrics(tmp_path / "run")
    assert [r["step"] for r in metrics if "loss" in r] == [1]  # step 1 trained on its scored completions
    assert not [r for r in metrics if "eval_loss" in r or "eval_reward" in r]


# Returns None (does not apply) for every other completion, and on its third call, step 3's, sends
# this process SIGTERM as a scheduler would: a preemption at a known step, in process.
PREEMPTING = '''
import os
import signal

calls = []


def half(prompts, completions, **columns):
    calls.append(1)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return [None if i % 2 else 1.0 for i in range(len(completions))]
'''


def test_a_preempted_run_logs_its_partial_window_and_counts_the_unscored(tmp_path, caplog, capsys):
    """Items 11, 1 and 4 of issue 33: with trainer.log_every=4, SIGTERM in step 3 writes a train line
    for steps 1-3 before the run exits (6 of their 12 completions unscored, on the log line too);
    the resumed run's step-4 line holds step 4 alone, its progress bar the headline metrics. Each
    sample shows its rewards; the report draws the reward."""
    import logging

    from trainloop.errors import Preempted
    from trainloop.tools.report import main as report

    rewards = tmp_path / "half.py"
    rewards.write_text(PREEMPTING)
    # the for-loop AdamW reads the guard's verdict every step, so SIGTERM stops the run after the step it came in
    # (the fused one reads it a step late: trainloop/guard.py)
    run = [*CHEAP, f"objective.rewards=[{rewards}:half]", "trainer.max_steps=4", "trainer.log_every=4",
           "trainer.eval_every=4", "optimizer.impl=for_loop"]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        with caplog.at_level(logging.INFO, logger="trainloop"), pytest.raises(Preempted, match="by SIGTERM after step 3"):
            train(tmp_path / "run", *run)
    finally:  # a preempted run ignores further signals until its process exits: this one goes on
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert re.search(r"step 3  loss \S+  lr \S+  \S+ tok/s  reward 1  reward_std 0  unscored 6\n", caplog.text)
    assert "  rewards: half 1\n" in caplog.text and "  rewards: half None\n" in caplog.text
    train(tmp_path / "run", *run, "logging.progress_bar=true")
    lines = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [(r["step"], r["unscored"], r["reward"]) for r in lines] == [(3, 6, 1.0), (4, 2, 1.0)]
    assert re.search(r"4/4 \[.*, loss=\S+, lr=\S+, tok_s=\S+, reward=1, reward_std=0, unscored=2\]", capsys.readouterr().err)
    drawn = {ax.get_title(): ax for ax in report([str(tmp_path / "run")]).axes}
    assert {line.get_label(): list(line.get_xydata().tolist()) for line in drawn["reward"].get_lines()} == {
        "run train": [[3, 1.0], [4, 1.0]], "run eval": [[4, 1.0]]}
    assert "KL to the reference" not in drawn  # objective.beta=0: no KL logged, no panel
