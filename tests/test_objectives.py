"""Every row of the objective table keeps the contract the loop relies on (issue 24): a batch's
summed loss and unit count add up over any split of the batch into micro-batches, so that one
division by the step's units gives the same step however the batch is cut; its evaluation is the
summed loss per unit; and it is the loss the run trains on."""

from __future__ import annotations

import pytest
import torch

from pathlib import Path

from helpers import OBJECTIVE_NEEDS, compose, read_metrics, reset_accelerate, started, train
from trainloop.objectives import OBJECTIVES, build_objective

# The config each objective needs on top of the smoke preset (a new row adds its own).
PAIRS = Path(__file__).resolve().parent / "data" / "preference.jsonl"
DATA = Path(__file__).resolve().parent / "data"
def batch_for(cfg, objective_name: str) -> tuple[dict, torch.nn.Module]:
    """A batch of 4 training blocks from the run's own data, and the run's model (with its adapter)."""
    from trainloop.model.adapter import apply_adapter
    from trainloop.data.loaders import build_tokenizer
    from trainloop.data.mixture import build_training_data
    from trainloop.model.builder import build_model, build_model_config

    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.model.name_or_path)
    train_set, _, _ = build_training_data(cfg.data, tokenizer, cfg.trainer.seed)
    items = [train_set[i] for i in range(4)]
    batch = {key: torch.stack([item[key] for item in items]) if isinstance(items[0][key], torch.Tensor)
             else [item[key] for item in items] for key in items[0]}
    torch.manual_seed(0)
    head = OBJECTIVES[objective_name].head
    model = build_model(cfg.model, build_model_config(cfg.model, len(tokenizer)), head=head)
    model = apply_adapter(cfg, model, head) if cfg.adapter.name != "none" else model
    if OBJECTIVES[cfg.objective.name].prompts:  # its batch: completions it generates for the prompts
        from accelerate import Accelerator

        from trainloop.parallel import build_strategy

        reset_accelerate()
        strategy = build_strategy(cfg, Accelerator(cpu=True))
        batch = build_objective(cfg, "cpu").step_batches(strategy, model, [batch], step=0)[0]
        batch = {key: value[::4] for key, value in batch.items()}  # one of each group: advantages that do not cancel
    return batch, model


def objective_for(cfg, model):
    """The objective as the build hands it over, with the frozen model it keeps (distill's teacher) whole."""
    return started(build_objective(cfg, "cpu"), cfg, model)


def test_every_objective_has_its_config_and_its_test_needs():
    from trainloop.config.compose import CONFIG_DIR

    assert set(OBJECTIVES) == set(OBJECTIVE_NEEDS) == {p.stem for p in (CONFIG_DIR / "objective").glob("*.yaml")}


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_the_loss_and_its_units_add_up_over_micro_batches(name):
    cfg = compose("+preset=smoke", f"objective={name}", *OBJECTIVE_NEEDS[name])
    batch, model = batch_for(cfg, name)
    objective = objective_for(cfg, model)
    halves = [{key: value[part] for key, value in batch.items()} for part in (slice(0, 2), slice(2, 4))]
    if not OBJECTIVES[name].prompts:  # as the loop does before a step (grpo's batch_for made its completions)
        from accelerate import Accelerator

        from trainloop.parallel import build_strategy

        reset_accelerate()
        halves = objective.step_batches(build_strategy(cfg, Accelerator(cpu=True)), model, halves, step=0)
    whole = objective.batch_loss(model, batch).summed
    assert objective.count(batch) == sum(objective.count(h) for h in halves) > 0
    assert torch.allclose(whole, sum(objective.batch_loss(model, h).summed for h in halves), rtol=1e-5)
    whole.backward()  # a loss the optimizer can follow
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


# objective=grpo evaluates the reward of greedy completions, not a loss (tests/test_grpo.py)
@pytest.mark.parametrize("name", sorted(name for name in OBJECTIVES if not OBJECTIVES[name].prompts))
def test_evaluation_is_the_summed_loss_per_unit(name):
    from accelerate import Accelerator

    from trainloop.data.loaders import build_dataloaders
    from trainloop.parallel import build_strategy

    cfg = compose("+preset=smoke", f"objective={name}", *OBJECTIVE_NEEDS[name], "data.batch_size=4")
    batch, model = batch_for(cfg, name)
    items = [{key: value[i] for key, value in batch.items()} for i in range(4)]  # the loader makes the batch again
    _, loader = build_dataloaders(cfg.data, items, items, pin_memory=False)
    objective = objective_for(cfg, model)
    reset_accelerate()
    got = objective.evaluate(build_strategy(cfg, Accelerator(cpu=True)), model, loader, max_batches=None)
    with torch.no_grad():
        summed, count = objective.eval_sums(model, batch)[:2]
    assert got["eval_loss"] == pytest.approx((summed / count).item(), rel=1e-6)
    assert model.training  # evaluate() hands the model back in training mode


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_a_run_trains_on_the_objective(name, tmp_path):
    lines = [r for r in read_metrics(train(tmp_path / "run", f"objective={name}", *OBJECTIVE_NEEDS[name],
                                           "trainer.max_steps=6")) if "loss" in r]
    assert lines and all(torch.isfinite(torch.tensor(r["loss"])) for r in lines)
    if OBJECTIVES[name].prompts:  # its loss is centred on 0 by the advantages: what it raises is the reward
        assert lines[-1]["reward"] > lines[0]["reward"]
    else:
        assert lines[-1]["loss"] < lines[0]["loss"]
