"""FSDP2 checkpoints in DCP format (issue 16, acceptance checks 2 and 3), with real launches on CPU.

Check 2, in one chain of runs: 2 processes x batch 4 train 8 steps straight (a synchronous save at
step 4); the same world size resumes from step 4 bitwise; 1 process x batch 8 resumes from it
(DCP reshards 2 -> 1) and saves asynchronously at step 6; 2 processes resume from that (1 -> 2).
Both agree with the straight run within 1e-5.
Check 3: a wider model that takes a while to write saves asynchronously every 2 steps; the run is
killed with SIGKILL right after the save of step 6 began; the same command resumes from step 4
and recomputes steps 5 and 6 bitwise.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import compose, end_family, losses, ranks_of, read_metrics, start, torchrun, warm
from trainloop.checkpoint.compatibility import check_format, run_fingerprint
from trainloop.config.compose import ConfigError

FSDP = ["+preset=[smoke,fsdp]", "logging.progress_bar=false", "trainer.log_every=1", "trainer.eval_batches=1",
        "trainer.max_steps=8", "trainer.eval_every=8"]


def saves(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r.get("event") == "checkpoint"]


def checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:07d}"


def final_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Path:
    """The straight run and the three resumes of check 2 (see the module's docstring)."""
    root = tmp_path_factory.mktemp("fsdp_resume")
    warm(2, [*FSDP, "checkpoint.every_steps=4", f"hydra.run.dir={root / 'straight'}"])
    warm(2, [*FSDP, f"checkpoint.resume={checkpoint(root / 'straight', 4)}",
            f"hydra.run.dir={root / 'same'}"])
    done = warm(1, [*FSDP, "data.batch_size=8", "checkpoint.every_steps=2",
                   "checkpoint.save_final_model=false",
                   "checkpoint.async_save=true", f"checkpoint.resume={checkpoint(root / 'straight', 4)}",
                   f"hydra.run.dir={root / 'one'}"])
    (root / "one.log").write_text(done.stdout + done.stderr)
    done = warm(2, [*FSDP, f"checkpoint.resume={checkpoint(root / 'one', 6)}",
                   "checkpoint.save_final_model=false",
                   f"hydra.run.dir={root / 'two'}"])
    (root / "two.log").write_text(done.stdout + done.stderr)
    return root


@pytest.mark.slow
def test_resume_is_bitwise_at_the_same_world_size_and_reshards_across_world_sizes(chain):
    straight = losses(chain / "straight")
    assert sorted(straight) == list(range(1, 9))
    shards = sorted(p.name for p in (checkpoint(chain / "straight", 4) / "model_optimizer").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one shard per rank
    assert (checkpoint(chain / "straight", 4) / "random_states_1.pkl").is_file()
    for saved in (checkpoint(chain / "straight", 4), checkpoint(chain / "one", 6)):  # synchronous, asynchronous
        state = json.loads((saved / "trainer_state.json").read_text())  # every rank's files have a checksum
        assert set(state["crc32"]) == set(state["files"]) >= {"model_optimizer/__0_0.distcp", "model_optimizer/.metadata"}
        assert not (saved / ".checksums").exists()  # the ranks' records, gathered at the commit
    assert "model_optimizer/__1_0.distcp" in json.loads(
        (checkpoint(chain / "straight", 4) / "trainer_state.json").read_text())["crc32"]

    # 2 -> 2: the losses after the resume and the final weights, bitwise
    same = losses(chain / "same")
    assert sorted(same) == [5, 6, 7, 8] and all(same[s] == straight[s] for s in same), (same, straight)
    weights, resumed = final_weights(chain / "straight"), final_weights(chain / "same")
    assert weights.keys() == resumed.keys() and all(weights[k].equal(resumed[k]) for k in weights)

    # 2 -> 1 (batch 8) and 1 -> 2 (batch 4): the same global batch, within 1e-5
    one, two = losses(chain / "one"), losses(chain / "two")
    assert sorted(one) == [5, 6, 7, 8] and sorted(two) == [7, 8]
    for resumed in (one, two):
        for step, loss in resumed.items():
            assert abs(loss - straight[step]) <= 1e-5 * abs(straight[step]), (step, loss, straight[step])
    assert "at another world size (world_size: 2 -> 1)" in (chain / "one.log").read_text()
    assert "at another world size (world_size: 1 -> 2)" in (chain / "two.log").read_text()
    shards = sorted(p.name for p in (checkpoint(chain / "one", 6) / "model_optimizer").iterdir())
    assert shards == [".metadata", "__0_0.distcp"]
    # the 1-process run saved asynchronously: each save committed once written, the last at the end
    assert [(r["checkpoint"], r["saved_step"]) for r in saves(chain / "one")] == [
        ("step_0000006", 6), ("step_0000008", 8)]
    assert all(r["committed_at_step"] >= r["written_by_step"] >= r["saved_step"] for r in saves(chain / "one"))
    assert (chain / "one" / "checkpoints" / "latest").read_text() == "step_0000008"


@pytest.mark.slow
def test_a_checkpoint_of_the_other_format_is_refused(chain, tmp_path):
    """A run without FSDP cannot load DCP shards, nor FSDP2 accelerate's files: refused by name."""
    refused = warm(1, ["+preset=smoke", "data.batch_size=8",
                      f"checkpoint.resume={checkpoint(chain / 'straight', 4)}", f"hydra.run.dir={tmp_path}"],
                     check=False)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "was saved under FSDP2" in refused.stderr and "this run is without FSDP" in refused.stderr
    assert "Resume it with fsdp=full_shard" in refused.stderr


def test_async_save_is_read_only_under_fsdp():
    from trainloop.config.compose import check_command_line

    with pytest.raises(ConfigError, match="checkpoint.async_save=True has no effect unless fsdp=full_shard"):
        check_command_line(compose("checkpoint.async_save=true"), ["checkpoint.async_save=true"])
    check_command_line(compose("+preset=fsdp", "checkpoint.async_save=true"), ["checkpoint.async_save=true"])


def test_the_format_check_names_both_formats():

    with_fsdp, without = (run_fingerprint(compose(*o), 2) for o in (["+preset=fsdp"], []))
    with pytest.raises(ConfigError, match="saved without FSDP .* this run is under FSDP2 .* fsdp=none"):
        check_format(Path("step_0000004"), without, with_fsdp)
    with pytest.raises(ConfigError, match="saved under FSDP2 .* this run is without FSDP .* fsdp=full_shard"):
        check_format(Path("step_0000004"), with_fsdp, without)
    old = {k: v for k, v in without.items() if k != "fsdp.name"}  # saved before trainloop had FSDP2
    check_format(Path("step_0000004"), old, without)
    with pytest.raises(ConfigError, match="fsdp.name: 'none' -> 'full_shard'"):
        check_format(Path("step_0000004"), old, with_fsdp)


# The tiny model at its full size (4 layers 256 wide, 4.3M parameters, 50 MB with AdamW's state):
# writing a checkpoint takes long enough (about 0.6 s here) to signal the run in the middle of it.
ASYNC = ["+preset=[smoke,fsdp]", "logging.progress_bar=false", "trainer.log_every=1", "trainer.eval_batches=1",
         "trainer.max_steps=8", "trainer.eval_every=8", "model.num_layers=4", "model.hidden_size=256",
         "model.num_heads=4", "data.batch_size=1", "data.seq_len=32", "checkpoint.every_steps=2",
         "checkpoint.async_save=true", "checkpoint.save_final_model=false"]


def wait_for_line(line: str, output: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while line not in output.read_text():
        assert proc.poll() is None, f"it ended before {line!r}:\n{output.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {line!r} in {timeout} s"
        time.sleep(0.01)


@pytest.mark.slow
def test_async_save_overlaps_training_a_kill_during_it_resumes_the_previous_and_sigterm_waits_for_it(tmp_path):
    """Check 3: SIGKILL while the save of step 6 is written -> resumed from step 4, steps 5 and 6
    recomputed bitwise; that run gets SIGTERM while it writes step 6 again -> it commits step 6,
    saves step 7 and exits 75."""
    run = tmp_path / "run"
    command = [*ASYNC, f"hydra.run.dir={run}"]
    began = f"saving checkpoint {checkpoint(run, 6)} in the background"
    killed = start([*torchrun(2), *command], tmp_path / "killed.txt")
    try:
        wait_for_line(began, tmp_path / "killed.txt", killed)
    finally:
        end_family(killed, stacks=False)  # SIGKILL to torchrun and every rank at once
        killed.wait()
    root = run / "checkpoints"
    # killed during the save: its folder is there, unfinished; the previous one is the latest.
    # (DCP makes model_optimizer/ from its writer thread, which the kill may come before.)
    assert (root / ".tmp_step_0000006").is_dir()
    assert not checkpoint(run, 6).exists()
    assert (root / "latest").read_text() == "step_0000004" and (checkpoint(run, 4) / "COMPLETE").is_file()
    committed = saves(run)
    assert [(r["checkpoint"], r["saved_step"]) for r in committed] == [("step_0000002", 2), ("step_0000004", 4)]
    for record in committed:  # of the time the shards took to write, training waited for a part
        # only (the copy, and at the next save the rest, if any): it ran the next steps meanwhile
        assert record["blocked_s"] + record["waited_s"] < record["write_s"], record
        assert record["committed_at_step"] >= record["written_by_step"] >= record["saved_step"], record
        assert record["committed_at_step"] > record["saved_step"], record
    before = [r for r in read_metrics(run) if "loss" in r]
    assert {5, 6} <= {r["step"] for r in before}

    again = start([*torchrun(2), *command], tmp_path / "again.txt")  # the same command (on a free port)
    try:
        wait_for_line(began, tmp_path / "again.txt", again)
        os.kill(ranks_of(again.pid)[1], signal.SIGTERM)  # rank 0 is not told: the ranks agree
        code = again.wait(timeout=300)
    finally:
        end_family(again, stacks=False)
    out = (tmp_path / "again.txt").read_text()
    assert f"removing {root / '.tmp_step_0000006'}" in out
    assert f"resumed from {checkpoint(run, 4)}" in out
    # metrics.jsonl holds both runs' lines: the resumed run's come last. Steps 5 and 6 ran twice,
    # from the live state and from the checkpoint written while step 5 ran: the same losses.
    resumed = [r for r in read_metrics(run) if "loss" in r][len(before):]
    assert [r["step"] for r in resumed] == [5, 6, 7], out[-4000:]
    first = {r["step"]: r["loss"] for r in before}
    assert [r["loss"] for r in resumed[:2]] == [first[5], first[6]], (resumed, before)
    # SIGTERM while step 6 was written: the stop after step 7 committed it, then saved step 7
    assert code != 0 and re.findall(r"exitcode\s+:\s*(-?\d+)", out) == ["75", "75"], out[-4000:]
    stopped = re.findall(r"stopped by (SIGTERM|a signal to another rank) after step (\d+), checkpoint saved in (\S+);", out)
    assert sorted(stopped) == [("SIGTERM", "7", str(checkpoint(run, 7))),  # each rank names the same one
                               ("a signal to another rank", "7", str(checkpoint(run, 7)))], out[-4000:]
    assert [(r["checkpoint"], r["saved_step"]) for r in saves(run)][2:] == [("step_0000006", 6), ("step_0000007", 7)]
    assert saves(run)[-1]["committed_at_step"] == 7
    assert (root / "latest").read_text() == "step_0000007"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000006", "step_0000007"]  # keep_last=2
    assert json.loads((checkpoint(run, 7) / "trainer_state.json").read_text())["state"]["step"] == 7
    assert not list(root.glob(".tmp_*"))
