"""The objective in a checkpoint's fingerprint (issue 34, item 5): resuming with another objective,
or with an objective key that changes the loss, is refused in one line naming the keys, before any
compute; what may change on resume (optimizer.lr, trainer.max_steps, ...) is one list,
trainloop.checkpoint.compatibility.MAY_CHANGE_ON_RESUME, and every config key is either in it or recorded; a
checkpoint saved before the objective was recorded resumes, with a warning naming the keys.

Real runs, small: DPO with LoRA on tests/data/preference.jsonl stopped after step 2 of 4, and
copies of it resumed; a refused resume is a subprocess (exit code 2, one line)."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest

from helpers import SMALL, compose, read_metrics, train, warm
from trainloop.checkpoint.compatibility import (FINGERPRINT_KEYS, MAY_CHANGE_ON_RESUME, may_change_on_resume,
                                                run_fingerprint)
from trainloop.checkpoint.integrity import STATE_FILE

PAIRS = Path(__file__).resolve().parent / "data" / "preference.jsonl"
PAIRS_DATA = ["data=preference", f"data.path={PAIRS}", "data.validation_fraction=0.2"]
RUN = ["adapter=lora", "trainer.max_steps=4", "trainer.eval_every=100", "trainer.eval_batches=1",
       "checkpoint.save_final_model=false"]
DPO = [*PAIRS_DATA, "objective=dpo", *RUN]
SAVED = "step_0000002"


def leaf_keys(node, prefix: str = "") -> list[str]:
    from omegaconf import DictConfig

    return [k for key, value in node.items_ex(resolve=False)
            for k in (leaf_keys(value, f"{prefix}{key}.") if isinstance(value, DictConfig) else [f"{prefix}{key}"])]


@pytest.mark.parametrize("overrides", [[], ["data=preference", "objective=dpo"], ["data=preference", "objective=simpo"],
                                       ["data=prompts", "objective=grpo", "objective.num_iterations=2"],
                                       ["+preset=fsdp"]])
def test_every_config_key_is_recorded_or_may_change_on_resume(overrides):
    from trainloop.objectives import keys_read

    cfg = compose(*overrides)
    fingerprint = run_fingerprint(cfg, 1)
    read = keys_read(cfg)
    for key in leaf_keys(cfg):
        unread = key.startswith("objective.") and key not in read  # another objective's key: no effect here
        assert (key in fingerprint) != (may_change_on_resume(key) or unread) or key in FINGERPRINT_KEYS, key
    assert not [k for k in MAY_CHANGE_ON_RESUME if k in fingerprint]


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    """DPO with LoRA stopped (and checkpointed) after step 2 of 4; each test resumes a copy."""
    return train(tmp_path_factory.mktemp("fingerprint") / "run", *DPO, "trainer.stop_at_step=2")


def copy_of(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def refused(run: Path, *overrides: str) -> str:
    """The one `trainloop: error:` line of a resume of `run` with these overrides, refused (exit 2)
    before any step: the run dir gains no checkpoint and no metrics."""
    metrics = (run / "metrics.jsonl").read_text()
    proc = warm(1, [*SMALL, *overrides,
                   f"hydra.run.dir={run}"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("trainloop: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", SAVED]
    assert (run / "metrics.jsonl").read_text() == metrics  # no step taken, no evaluation
    return errors[0]


@pytest.mark.parametrize("change, named", [("objective.beta=0.2", r"objective\.beta: 0\.1 -> 0\.2"),
                                           ("optimizer.weight_decay=0.0", r"optimizer\.weight_decay: 0\.1 -> 0\.0")])
def test_resuming_dpo_with_another_beta_or_weight_decay_is_refused_naming_the_key(dpo_run, tmp_path, change, named):
    run = copy_of(dpo_run, tmp_path)
    error = refused(run, *DPO, change)
    assert re.fullmatch(rf"trainloop: error: checkpoint \S+{SAVED} was made with another config; changed: "
                        rf"{named}\. Restore those settings to resume it, or start a new run "
                        r"in a new hydra\.run\.dir", error), error


def test_resuming_dpo_as_causal_lm_is_refused_naming_the_objective(dpo_run, tmp_path):
    run = copy_of(dpo_run, tmp_path)
    # causal_lm trains on text, not pairs (validation refuses it on data=preference): the data
    # changes too, and the one line names both
    error = refused(run, "data=pydoc", "objective=causal_lm", *RUN)
    assert "changed: data.name: 'preference' -> 'pydoc'" in error, error
    assert "; objective.name: 'dpo' -> 'causal_lm'." in error, error
    assert "objective.beta" not in error  # a key causal_lm does not read is not compared
    assert error.endswith("Restore those settings to resume it, or start a new run in a new hydra.run.dir"), error


def test_resuming_with_another_learning_rate_trains_on_at_it(dpo_run, tmp_path, caplog):
    """optimizer.lr may change on resume, and the schedule goes on from it: the loaded scheduler and
    optimizer would otherwise put the checkpoint's back (the message of a non-finite stop tells
    the user to resume with optimizer.lr=LOWER)."""
    from trainloop.optim.optimizers import lr_factor

    run = copy_of(dpo_run, tmp_path)
    with caplog.at_level(logging.INFO, logger="trainloop"):
        train(run, *DPO, "optimizer.lr=0.0005")
    assert "at step 2" in caplog.text and "saved before trainloop recorded" not in caplog.text, caplog.text
    assert f"optimizer.lr changed since {SAVED} (0.001 -> 0.0005)" in caplog.text, caplog.text
    lrs = [(r["step"], r["lr"]) for r in read_metrics(run) if "loss" in r and "eval_loss" not in r]
    assert [step for step, _ in lrs] == [1, 2, 3, 4]  # resumed, not restarted
    for step, lr in lrs:  # the logged lr is the one the step after it takes: cosine to 0 at step 4
        assert lr == pytest.approx((0.001 if step <= 2 else 0.0005) * lr_factor("cosine", step, 0, 4), rel=1e-12)
    assert (run / "checkpoints" / "step_0000004").is_dir()


def test_a_checkpoint_from_before_the_objective_was_recorded_still_resumes(dpo_run, tmp_path, caplog):
    """Saved before this change: no objective.* in its fingerprint, so none is compared, and the
    warning names them; a resume with another beta goes on."""
    run = copy_of(dpo_run, tmp_path)
    state_file = run / "checkpoints" / SAVED / STATE_FILE
    state = json.loads(state_file.read_text())
    state["fingerprint"] = {k: v for k, v in state["fingerprint"].items() if not k.startswith("objective.")}
    state_file.write_text(json.dumps(state))
    with caplog.at_level(logging.INFO, logger="trainloop"):
        train(run, *DPO, "objective.beta=0.2")
    assert "at step 2" in caplog.text, caplog.text
    assert ("saved before trainloop recorded objective.name, objective.beta, objective.loss_type, "
            "objective.label_smoothing: resuming it without comparing those") in caplog.text, caplog.text
    assert json.loads((run / "checkpoints" / "step_0000004" / STATE_FILE).read_text())["fingerprint"][
        "objective.beta"] == 0.2  # its own saves record the objective from now on
