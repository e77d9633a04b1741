"""objective=simpo (issue 25's reference-free row): its loss, rewards and log-probabilities are TRL
1.16's (CPOTrainer with loss_type=simpo, cpo_alpha=0: TRL's own forward and loss code runs on the
same model and pairs); bad values and keys it does not read are refused naming the key; a short
full fine-tune (no adapter: nothing else to hold) learns a rule the held-out pairs follow; and 2
processes give the step of 1 over the same global batch.

Real parts only: the composed config, data=preference on tests/data/preference.jsonl, the
built-in byte-level tokenizer, a tiny transformers Llama, TRL's CPOTrainer, 2 processes over gloo.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import (
    SMALL, assert_same_logged, compose, logged, pairs_batch, read_metrics, rule_pairs, train, warm, with_attention_masks,
)
from trainloop.config.compose import ConfigError, check_command_line, validate

PAIRS = Path(__file__).resolve().parent / "data" / "preference.jsonl"  # the right sum chosen, a wrong one rejected
SIMPO = ["data=preference", "objective=simpo", f"data.path={PAIRS}"]


def trl_cpo(beta: float, gamma: float, label_smoothing: float):
    """TRL's CPOTrainer for SimPO with only what its loss path reads (no model, data or Trainer
    set up): its concatenated_forward, get_batch_logps, cpo_loss and get_batch_loss_metrics run as written."""
    from trl.experimental.cpo import CPOTrainer

    trainer = CPOTrainer.__new__(CPOTrainer)
    trainer.__dict__.update(
        loss_type="simpo", beta=beta, simpo_gamma=gamma, label_smoothing=label_smoothing, cpo_alpha=0.0, alpha=0.0,
        is_encoder_decoder=False, aux_loss_enabled=False, pad_token_id=0,
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x))
    return trainer


# --- the loss ---------------------------------------------------------------------------------

@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_the_loss_rewards_and_logps_are_trls_on_the_same_batch(label_smoothing):
    """TRL's CPOTrainer computes its SimPO loss and metrics (its forward with an attention mask,
    its per-token mean, its cpo_loss) on the same tiny model and the same data=preference pairs."""
    from trainloop.model.builder import build_model, build_model_config
    from trainloop.objectives import build_objective

    cfg = compose("+preset=smoke", *SIMPO, "objective.beta=2.5", "objective.gamma=1.375",
                  f"objective.label_smoothing={label_smoothing}")
    validate(cfg)
    batch = pairs_batch(cfg, 8)
    torch.manual_seed(0)
    model = build_model(cfg.model, build_model_config(cfg.model, 257)).eval()
    trl_batch = with_attention_masks(batch)  # padding after each completion's last token masked
    trainer = trl_cpo(cfg.objective.beta, cfg.objective.gamma, label_smoothing)
    objective = build_objective(cfg, "cpu")
    with torch.no_grad():
        trl_loss, trl = trainer.get_batch_loss_metrics(model, trl_batch)
        loss = objective.batch_loss(model, batch).summed / objective.count(batch)
    means = objective.means(objective.sums)
    assert loss.item() == pytest.approx(trl_loss.item(), abs=1e-6)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margin", "logps/chosen", "logps/rejected"):
        assert means[key] == pytest.approx(trl[key.replace("margin", "margins")], abs=1e-6), key
    assert means["rewards/accuracy"] == trl["rewards/accuracies"]  # no ties here: TRL counts a tie as wrong
    assert 0 < trl_loss.item() and abs(means["rewards/margin"]) > 1e-3  # a real margin, not a tie


def test_a_tie_counts_half_and_the_margin_gamma_is_the_loss_at_a_tie():
    """Chosen identical to rejected: rewards tie, the accuracy is a coin flip (0.5), and the loss is
    -log sigmoid(-gamma) for every pair."""
    from trainloop.model.builder import build_model, build_model_config
    from trainloop.objectives import build_objective

    cfg = compose("+preset=smoke", *SIMPO)
    batch = pairs_batch(cfg, 4)
    batch["rejected_input_ids"], batch["rejected_labels"] = batch["chosen_input_ids"], batch["chosen_labels"]
    torch.manual_seed(0)
    model = build_model(cfg.model, build_model_config(cfg.model, 257))
    objective = build_objective(cfg, "cpu")
    with torch.no_grad():
        loss = objective.batch_loss(model, batch).summed / objective.count(batch)
    means = objective.means(objective.sums)
    assert means["rewards/accuracy"] == 0.5 and means["rewards/margin"] == 0.0
    assert loss.item() == pytest.approx(-torch.nn.functional.logsigmoid(torch.tensor(-1.0)).item(), abs=1e-6)


# --- the config -------------------------------------------------------------------------------

def test_the_shipped_defaults_are_the_papers():
    o = compose("+preset=smoke", *SIMPO).objective
    assert (o.beta, o.gamma, o.label_smoothing) == (2.0, 1.0, 0.0)  # beta 2.0, gamma/beta 0.5


@pytest.mark.parametrize("overrides, says", [
    (["objective.beta=0"], "objective.beta=0.0 must be greater than 0"),
    (["objective.beta=-2"], "objective.beta=-2.0 must be greater than 0"),
    (["objective.gamma=-0.5"], "objective.gamma=-0.5 must be 0 or more"),
    (["objective.label_smoothing=0.5"], r"objective.label_smoothing=0.5 must be in \[0, 0.5\)"),
    (["model.arch=mixtral"], "objective=simpo does not add a mixture's router loss"),
    (["trainer.auto_batch_size=true"], "objective=simpo does not search a batch size yet"),
    (["data=chat", "data.path=/some/chats.jsonl"], "objective=simpo trains on preference pairs, and data=chat holds none"),
])
def test_what_cannot_work_is_refused_naming_the_key(overrides, says):
    with pytest.raises(ConfigError, match=rf"\n  {says}"):
        validate(compose(*SIMPO, *overrides))


@pytest.mark.parametrize("overrides, base, says", [
    (["objective.loss_type=ipo"], SIMPO, "objective.loss_type=ipo has no effect unless objective=dpo"),
    (["objective.gamma=0.5"], [*SIMPO[:2], "objective=dpo", "adapter=lora"],
     "objective.gamma=0.5 has no effect unless objective=simpo"),
    (["objective.label_smoothing=0.1"], [], "objective.label_smoothing=0.1 has no effect unless objective=dpo or simpo"),
])
def test_a_key_simpo_does_not_read_is_refused_and_its_own_are_not(overrides, base, says):
    with pytest.raises(ConfigError, match=says):
        check_command_line(compose(*base, *overrides), overrides)
    mine = ["objective.beta=2.5", "objective.gamma=1.375", "objective.label_smoothing=0.1"]
    check_command_line(compose(*SIMPO, *mine), mine)


def test_any_adapter_and_strategy_validates():
    """No reference model: nothing ties it to an adapter, and the strategies shard one model."""
    for overrides in ([], ["adapter=lora"], ["+preset=ddp"], ["+preset=zero2"], ["+preset=zero3"], ["+preset=fsdp"],
                      ["adapter=lora", "+preset=fsdp"]):
        validate(compose(*SIMPO, *overrides))


# --- it learns --------------------------------------------------------------------------------

def test_a_short_full_fine_tune_learns_the_rule_of_the_held_out_pairs(tmp_path):
    """Chosen answers end with '!', rejected ones with one of '.?,;:' (the same length): the tiny
    random model's rewards barely differ at its first step (its accuracy a coin flip's); after 8
    steps, with no adapter, the held-out pairs' reward accuracy is at least 0.95, their margin
    clear of 0 and their loss below the first step's."""
    path = rule_pairs(tmp_path / "rule.jsonl")
    run_dir = train(tmp_path / "run", "data=preference", "objective=simpo", f"data.path={path}",
                    "trainer.max_steps=8", "trainer.eval_every=4", "trainer.eval_batches=null", "data.batch_size=8",
                    "data.validation_fraction=0.25", "optimizer.lr=1e-2", "scheduler=constant")
    lines = read_metrics(run_dir)
    first = next(r for r in lines if "loss" in r)  # the untrained model's pairs (its loss before any update)
    held_out = [r for r in lines if "eval_loss" in r]
    assert first["rewards/accuracy"] < 0.95 and abs(first["rewards/margin"]) < 0.1
    assert held_out[-1]["rewards/accuracy"] >= 0.95 and held_out[-1]["rewards/margin"] > 0.5
    assert held_out[-1]["eval_loss"] < held_out[0]["eval_loss"] < first["loss"]
    assert "eval_ppl" not in held_out[-1]
    assert all(key in r for r in lines if "loss" in r or "eval_loss" in r
               for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin",
                           "logps/chosen", "logps/rejected"))


# --- the step ---------------------------------------------------------------------------------

STEP = [*SIMPO, "trainer.max_steps=3", "trainer.eval_every=3", "trainer.eval_batches=null",
        "data.validation_fraction=0.2", "optimizer=sgd", "optimizer.lr=0.5"]  # 10 validation pairs: no whole batches


@pytest.mark.slow
def test_two_processes_give_the_step_of_one(tmp_path):
    keys = ("loss", "eval_loss", "rewards/chosen", "rewards/accuracy", "logps/rejected")  # 4 on each line

    one = logged(train(tmp_path / "one", *STEP, "data.batch_size=4"), keys)
    run_dir = tmp_path / "two"
    warm(2, [*SMALL, *STEP, "data.batch_size=2", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert {r["world_size"] for r in read_metrics(run_dir)} == {2}
    assert len(one) == 4 * 4  # 3 train lines, 1 eval line
    assert_same_logged(logged(run_dir, keys), one, 1e-6)
    assert len({x for _, key, x in one if key == "loss"}) > 1  # the model moved
