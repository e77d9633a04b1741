"""objective=orpo (issue 59's proof that an objective is one file and one row): its loss, rewards,
log-probabilities and log odds are TRL 1.16's (trl.experimental.orpo's ORPOTrainer: TRL's own forward and
loss code runs on the same model and pairs); bad values and keys it does not read are refused naming the
key; a short full fine-tune learns a rule the held-out pairs follow; and 2 processes give the step of 1
over the same global batch (its next-token term a mean over the step's tokens, not one micro-batch's).

Real parts only: the composed config, data=preference on tests/data/preference.jsonl, the built-in
byte-level tokenizer, a tiny transformers Llama, TRL's ORPOTrainer, 2 processes over gloo.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import (
    SMALL, assert_same_logged, compose, logged, pairs_batch, read_metrics, rule_pairs, touched_by_the_commit_adding,
    train, warm, with_attention_masks,
)
from trainloop.config.compose import ConfigError, check_command_line, validate

PAIRS = Path(__file__).resolve().parent / "data" / "preference.jsonl"  # the right sum chosen, a wrong one rejected
ORPO = ["data=preference", "objective=orpo", f"data.path={PAIRS}"]


def trl_orpo(beta: float):
    """TRL's ORPOTrainer with only what its loss path reads (no model, data or Trainer set up): its
    concatenated_forward, get_batch_logps, odds_ratio_loss and get_batch_loss_metrics run as written."""
    from trl.experimental.orpo import ORPOTrainer

    trainer = ORPOTrainer.__new__(ORPOTrainer)
    trainer.__dict__.update(
        beta=beta, is_encoder_decoder=False, aux_loss_enabled=False, padding_value=0, label_pad_token_id=-100,
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x))
    return trainer


@pytest.mark.parametrize("beta", [0.1, 0.75])
def test_the_loss_rewards_logps_and_log_odds_are_trls_on_the_same_batch(beta):
    """TRL's ORPOTrainer computes its loss and metrics (its forward with an attention mask over prompt and
    completion, its chosen NLL over both, its per-token mean, its odds_ratio_loss) on the same tiny model
    and the same data=preference pairs."""
    from trainloop.model.builder import build_model, build_model_config
    from trainloop.objectives import build_objective

    cfg = compose("+preset=smoke", *ORPO, f"objective.beta={beta}")
    validate(cfg)
    batch = pairs_batch(cfg, 8)
    torch.manual_seed(0)
    model = build_model(cfg.model, build_model_config(cfg.model, 257)).eval()
    trl_batch = with_attention_masks(batch)  # prompt and completion attended; the padding after them masked
    objective = build_objective(cfg, "cpu")
    with torch.no_grad():
        trl_loss, trl = trl_orpo(beta).get_batch_loss_metrics(model, trl_batch)
        loss = objective.batch_loss(model, batch).summed / objective.count(batch)
    means = objective.means(objective.sums)
    assert loss.item() == pytest.approx(trl_loss.item(), abs=1e-6)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margin", "logps/chosen", "logps/rejected",
                "nll_loss", "log_odds_ratio", "log_odds_chosen"):
        assert means[key] == pytest.approx(trl[key.replace("margin", "margins")], abs=1e-6), key
    assert means["rewards/accuracy"] == trl["rewards/accuracies"]  # no ties here: TRL counts a tie as wrong
    assert trl["nll_loss"] > 1 and abs(means["log_odds_chosen"]) > 1e-3  # a real NLL and odds ratio, not a tie


def test_the_gradient_is_trls():
    """The gradient of one batch's loss, through every parameter, is the one TRL's loss gives."""
    from trainloop.model.builder import build_model, build_model_config
    from trainloop.objectives import build_objective

    cfg = compose("+preset=smoke", *ORPO)
    batch = pairs_batch(cfg, 4)
    torch.manual_seed(0)
    model = build_model(cfg.model, build_model_config(cfg.model, 257))
    trl_batch = with_attention_masks(batch)
    trl_orpo(cfg.objective.beta).get_batch_loss_metrics(model, trl_batch)[0].backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    objective = build_objective(cfg, "cpu")
    (objective.batch_loss(model, batch).summed / objective.count(batch)).backward()
    for p, g in zip(model.parameters(), want):
        assert torch.allclose(p.grad, g, atol=1e-6, rtol=1e-5)
    assert any(g.abs().sum() > 0 for g in want)


def test_the_shipped_default_is_trls():
    assert compose("+preset=smoke", *ORPO).objective.beta == 0.1


@pytest.mark.parametrize("overrides, says", [
    (["objective.beta=0"], "objective.beta=0.0 must be greater than 0"),
    (["model.arch=mixtral"], "objective=orpo does not add a mixture's router loss"),
    (["trainer.auto_batch_size=true"], "objective=orpo does not search a batch size yet"),
    (["data=chat", "data.path=/some/chats.jsonl"], "objective=orpo trains on preference pairs, and data=chat holds none"),
])
def test_what_cannot_work_is_refused_naming_the_key(overrides, says):
    with pytest.raises(ConfigError, match=rf"\n  {says}"):
        validate(compose(*ORPO, *overrides))


def test_a_key_orpo_does_not_read_is_refused_and_its_own_is_not():
    overrides = ["objective.gamma=0.5"]
    with pytest.raises(ConfigError, match="objective.gamma=0.5 has no effect unless objective=simpo"):
        check_command_line(compose(*ORPO, *overrides), overrides)
    check_command_line(compose(*ORPO, "objective.beta=0.2"), ["objective.beta=0.2"])


def test_any_adapter_and_sharding_validates():
    """No reference model: nothing ties it to an adapter, and DDP, ZeRO and FSDP2 shard one model."""
    for overrides in ([], ["adapter=lora"], ["+preset=ddp"], ["+preset=zero2"], ["+preset=zero3"], ["+preset=fsdp"],
                      ["adapter=lora", "+preset=fsdp"], ["parallel.cp_size=2"]):
        validate(compose(*ORPO, *overrides))


def test_a_short_full_fine_tune_learns_the_rule_of_the_held_out_pairs(tmp_path):
    """Chosen answers end with '!', rejected ones with one of '.?,;:': after 8 steps the held-out pairs'
    reward accuracy is at least 0.95 and their loss below the first step's; every line carries TRL's metrics."""
    path = rule_pairs(tmp_path / "rule.jsonl")
    run_dir = train(tmp_path / "run", "data=preference", "objective=orpo", f"data.path={path}", "objective.beta=1.0",
                    "trainer.max_steps=8", "trainer.eval_every=4", "trainer.eval_batches=null", "data.batch_size=8",
                    "data.validation_fraction=0.25", "optimizer.lr=1e-2", "scheduler=constant")
    lines = read_metrics(run_dir)
    first = next(r for r in lines if "loss" in r)
    held_out = [r for r in lines if "eval_loss" in r]
    assert first["rewards/accuracy"] < 0.95
    assert held_out[-1]["rewards/accuracy"] >= 0.95 and held_out[-1]["rewards/margin"] > 0
    assert held_out[-1]["eval_loss"] < held_out[0]["eval_loss"] < first["loss"]
    assert all(key in r for r in lines if "loss" in r or "eval_loss" in r
               for key in ("rewards/chosen", "rewards/margin", "logps/chosen", "nll_loss", "log_odds_ratio"))


STEP = [*ORPO, "trainer.max_steps=3", "trainer.eval_every=3", "trainer.eval_batches=null",
        "data.validation_fraction=0.2", "optimizer=sgd", "optimizer.lr=0.5"]


@pytest.mark.slow
def test_two_processes_give_the_step_of_one(tmp_path):
    """The next-token term is a mean over the step's chosen tokens on every rank, so 2 processes at batch 2
    take the step of 1 at batch 4, though their micro-batches hold different numbers of tokens."""
    keys = ("loss", "eval_loss", "rewards/chosen", "nll_loss", "log_odds_chosen")
    one = logged(train(tmp_path / "one", *STEP, "data.batch_size=4"), keys)
    run_dir = tmp_path / "two"
    warm(2, [*SMALL, *STEP, "data.batch_size=2", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert {r["world_size"] for r in read_metrics(run_dir)} == {2}
    assert len(one) == 4 * 4  # 3 train lines, 1 eval line: 4 of the keys on each
    assert_same_logged(logged(run_dir, keys), one, 1e-6)
    assert len({x for _, key, x in one if key == "loss"}) > 1  # the model moved


def test_the_commit_that_added_it_touched_only_its_file_its_row_and_its_yaml():
    """docs/extending.md's claim, read from git: in trainloop/ and conf/, the commit that added orpo.py edited
    nothing but it, its row in objectives/__init__.py and conf/objective/orpo.yaml (issue 59, check 3)."""
    touched, row = touched_by_the_commit_adding("trainloop/objectives/orpo.py")
    assert touched == {"trainloop/objectives/orpo.py", "trainloop/objectives/__init__.py", "conf/objective/orpo.yaml"}
    assert row == ["+from trainloop.objectives.orpo import ORPO", '+"orpo": ORPO,']
