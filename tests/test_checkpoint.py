"""Checkpoints: what a save holds, retention, refusals, partial saves, the NaN guard, signals."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

from helpers import compose, launch, read_metrics, train
from trainloop.checkpoint.integrity import COMPLETE
from trainloop.preemption import Preemption
from trainloop.config.compose import ConfigError


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """4 steps with a checkpoint after each, the last 2 kept."""
    return train(tmp_path_factory.mktemp("finished") / "run", "checkpoint.every_steps=1",
                 "checkpoint.keep_last=2", "checkpoint.save_final_model=false")


def test_a_checkpoint_holds_what_a_resume_needs(finished_run):
    root = finished_run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000003", "step_0000004"]
    assert (root / "latest").read_text() == "step_0000004"
    ckpt = root / "step_0000004"
    names = {p.name for p in ckpt.iterdir()}
    # model, optimizer, scheduler (registered object), RNG states of rank 0, trainer state, config
    assert {COMPLETE, "model.safetensors", "optimizer.bin", "custom_checkpoint_0.pkl",
            "random_states_0.pkl", "trainer_state.json", "config.yaml"} <= names

    cfg = compose("+preset=smoke")
    saved = json.loads((ckpt / "trainer_state.json").read_text())
    assert saved["state"]["step"] == 4
    assert saved["state"]["tokens_seen"] == 4 * cfg.data.batch_size * cfg.data.seq_len
    assert saved["state"]["samples_in_epoch"] == 4 * cfg.data.batch_size  # one global batch per step, first epoch
    scheduler = torch.load(ckpt / "custom_checkpoint_0.pkl", weights_only=False)
    assert scheduler["last_epoch"] == 4
    rng = torch.load(ckpt / "random_states_0.pkl", weights_only=False)
    assert {"random_state", "numpy_random_seed", "torch_manual_seed", "step"} <= set(rng)
    assert "lr: 0.001" in (ckpt / "config.yaml").read_text()


@pytest.mark.parametrize("override, named", [
    ("trainer.gradient_accumulation_steps=2", "trainer.gradient_accumulation_steps: 1 -> 2"),
    ("data.batch_size=2", "data.batch_size: 4 -> 2"),
    ("model.hidden_size=128", "model.hidden_size: 64 -> 128"),
])
def test_resuming_with_a_changed_config_is_refused_naming_it(finished_run, override, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        train(finished_run, override)


def test_resume_null_refuses_a_run_dir_that_holds_checkpoints(finished_run):
    with pytest.raises(ConfigError, match="checkpoint.resume=auto"):
        train(finished_run, "checkpoint.resume=null")


def test_resuming_an_older_checkpoint_into_the_same_run_dir_is_refused(finished_run):
    older = finished_run / "checkpoints" / "step_0000003"
    with pytest.raises(ConfigError, match="holds later checkpoints \\(step_0000004\\)"):
        train(finished_run, f"checkpoint.resume={older}")


def test_partial_saves_are_never_loaded(finished_run, tmp_path):
    """A save cut short leaves .tmp_step_N; a folder without COMPLETE is not a checkpoint."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "checkpoints" / ".tmp_step_0000005").mkdir()
    (run / "checkpoints" / ".tmp_step_0000005" / "model.safetensors").write_bytes(b"cut short")
    shutil.copytree(run / "checkpoints" / "step_0000004", run / "checkpoints" / "step_0000006")
    (run / "checkpoints" / "step_0000006" / COMPLETE).unlink()

    train(run, "trainer.max_steps=6", "checkpoint.every_steps=1", "checkpoint.keep_last=2",
          "checkpoint.save_final_model=false")
    steps = [r["step"] for r in read_metrics(run) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]  # resumed from step 4, not from the incomplete step 6
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000005", "step_0000006"]
    assert (root / "step_0000006" / COMPLETE).is_file()


@pytest.mark.slow
def test_nonfinite_stop_names_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    """Acceptance 5: optimizer.lr=1e6 with trainer.on_nonfinite=stop."""
    run = tmp_path / "run"
    proc = launch(["python", "-m", "trainloop", "+preset=smoke", "optimizer.lr=1e6",
                   "trainer.on_nonfinite=stop", "checkpoint.every_steps=1", "trainer.max_steps=30",
                   "trainer.log_every=1", "logging.progress_bar=false", f"hydra.run.dir={run}"], check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]
    stopped = re.search(r"trainloop: error: non-finite .* at optimizer step (\d+)", proc.stderr)
    assert stopped, proc.stderr[-3000:]
    step = int(stopped[1])
    good = run / "checkpoints" / f"step_{step - 1:07d}"
    assert str(good) in proc.stderr  # the message names the checkpoint to go back to
    # and the command that resumes it: the same one, as hydra.run.dir was given (no new run dir)
    assert "run the same command with optimizer.lr=LOWER (" in proc.stderr, proc.stderr[-3000:]
    assert (run / "checkpoints" / "latest").read_text() == good.name
    assert (good / COMPLETE).is_file()
    weights = load_file(good / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert max(r["step"] for r in read_metrics(run) if "loss" in r) == step - 1


def test_nonfinite_skip_leaves_the_weights_and_counts_the_step(tmp_path):
    """lr=1e6 makes every gradient after the first step NaN; skipped steps change nothing."""
    run = train(tmp_path / "run", "optimizer.lr=1e6", "trainer.on_nonfinite=skip", "checkpoint.every_steps=1",
                "checkpoint.keep_last=10", "checkpoint.save_final_model=false")
    records = {r["step"]: r for r in read_metrics(run) if "loss" in r}
    assert records[4]["nonfinite_steps"] > 0
    for step in (2, 3, 4):
        before = load_file(run / "checkpoints" / f"step_{step - 1:07d}" / "model.safetensors")
        after = load_file(run / "checkpoints" / f"step_{step:07d}" / "model.safetensors")
        skipped = records[step]["nonfinite_steps"] > records[step - 1]["nonfinite_steps"]
        unchanged = all(torch.equal(before[k], after[k]) for k in before)
        assert unchanged == skipped, step
        if skipped:  # the schedule does not advance on a skipped update
            assert records[step]["lr"] == records[step - 1]["lr"]


def test_signals_set_the_stop_flag_and_a_second_ctrl_c_stops_at_once():
    previous = signal.getsignal(signal.SIGTERM)
    with Preemption() as preemption:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.requested == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal keeps the first request
        assert preemption.requested == "SIGUSR1"
    assert signal.getsignal(signal.SIGTERM) is previous

    with Preemption() as preemption:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # forwarded by a launcher within the second: the same one
        assert preemption.requested == "SIGINT"
        time.sleep(1.1)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)  # the handler runs between bytecodes, here


def test_verify_resume_refuses_a_bad_override_before_training(capsys):
    from trainloop.tools.verify_resume import main

    assert main(["trainer.gradient_accumulation_steps=0"]) == 2
    assert "trainer.gradient_accumulation_steps=0 must be greater than 0" in capsys.readouterr().err
