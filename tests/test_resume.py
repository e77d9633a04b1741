"""Exact resume, preemption and killed saves, with real launches (acceptance checks 1-4).

The runs use dropout, so the per-rank RNG states matter too, gradient accumulation 2 and 2
DataLoader workers; the training split is cut to 72 blocks (18 batches of 4), so the runs
cross epoch boundaries, where accelerate also forces an optimizer step on an odd batch.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from helpers import finish, once, ranks_of, start, wait_for_step, warm, warm_runs
from trainloop.tools import verify_resume

RESUME = ["+preset=smoke", "model.dropout=0.1", "trainer.gradient_accumulation_steps=2",
          "data.num_workers=2", "data.validation_fraction=0.99", "trainer.eval_batches=2"]
DDP_STEPS = 42  # 108 training blocks, 16 a step (2 ranks x 4 x 2): resumed at step 21, mid-way through epoch 3
TORCHRUN = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node=2"]


def resumed_at(log: str) -> tuple[int, int, int]:
    found = re.search(r"resumed from \S+ at step (\d+) \(epoch (\d+), batch (\d+)\)", log)
    assert found, log[-3000:]
    return int(found[1]), int(found[2]), int(found[3])


@pytest.mark.slow
def test_one_process_resume_is_bitwise(tmp_path, capsys, child_env):
    """Acceptance 1: 20 steps straight = 10 + resume + 10, losses and weights bitwise."""
    # 108 training blocks, 16 a step: 6 steps an epoch, so step 10 is in the second one
    code = verify_resume.main(["--steps", "20", "--rtol", "0", "--dir", str(tmp_path), *RESUME, "data.batch_size=8"],
                              run=warm_runs())
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("bitwise identical") == 2, out
    step, epoch, batch = resumed_at((tmp_path / "second_half.log").read_text())
    assert step == 10 and epoch >= 1 and batch > 0  # mid-epoch, after an epoch boundary

    # The comparison sees a difference of one unit in the last place of one weight.
    import torch
    from safetensors.torch import load_file, save_file

    nudged = tmp_path / "nudged"
    shutil.copytree(tmp_path / "resumed", nudged)
    weights = load_file(nudged / "final" / "model.safetensors")
    name = sorted(weights)[0]
    weights[name].view(-1)[0] = torch.nextafter(weights[name].view(-1)[0], torch.tensor(math.inf))
    save_file(weights, nudged / "final" / "model.safetensors")
    found = verify_resume.compare(tmp_path / "straight", nudged, 20)
    assert found.losses_bitwise and not found.weights_bitwise and 0 < found.weights_max_rel < 1e-6
    assert found.agrees(1e-6) and not found.agrees(0)


@pytest.fixture(scope="module")
def ddp_verified(tmp_path_factory):
    """verify_resume on 2 processes; its straight run is also the uninterrupted baseline below."""
    def verify(root: Path) -> None:
        with open(root / "output.txt", "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = verify_resume.main(["--nproc", "2", "--rtol", "0", "--steps", str(DDP_STEPS),
                                       "--dir", str(root / "runs"), *RESUME], run=warm_runs(2))
        (root / "code").write_text(str(code))

    root = once(tmp_path_factory, "resume-ddp_verified", verify)
    return root / "runs", int((root / "code").read_text()), (root / "output.txt").read_text()


@pytest.mark.slow
def test_two_process_resume_is_bitwise(ddp_verified):
    """Acceptance 2 (DDP): the same on 2 processes, and the checkpoint refuses 1 process."""
    root, code, out = ddp_verified
    assert code == 0, out[-4000:]
    assert out.count("bitwise identical") == 2, out[-4000:]
    step, epoch, batch = resumed_at((root / "second_half.log").read_text())
    assert step == DDP_STEPS // 2 and epoch >= 1 and batch > 0

    refused = warm(1, [*RESUME, f"hydra.run.dir={root / 'resumed'}"], check=False)
    assert refused.returncode == 2
    assert "world_size: 2 -> 1" in refused.stderr


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_resume_within_1e6(stage, tmp_path, deepspeed_ops):
    """Acceptance 2 (DeepSpeed): 2 processes under ZeRO-2 and ZeRO-3, within 1e-6 relative.
    With 20 steps the resume falls on an epoch's end (an empty rest of the epoch to skip)."""
    with open(tmp_path / "output.txt", "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = verify_resume.main(["--nproc", "2", "--rtol", "1e-6", "--steps", "20", "--dir", str(tmp_path / "runs"),
                                   *RESUME, f"deepspeed={stage}"], run=warm_runs(2))
    out = (tmp_path / "output.txt").read_text()
    assert code == 0, out[-4000:]
    assert "resume OK" in out
    log = (tmp_path / "runs" / "second_half.log").read_text()
    assert f"DeepSpeed ZeRO-{stage[-1]} engaged" in log
    step, epoch, batch = resumed_at(log)
    assert step == 10 and epoch >= 1


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_both_and_the_rerun_matches(ddp_verified, tmp_path):
    """Acceptance 3: SIGTERM to one rank of torchrun's mid-training -> every rank exits 75 with a complete
    checkpoint; re-running the same arguments on 2 ranks (warm ones: the numbers are torchrun's) ends with
    the uninterrupted run's losses and weights."""
    baseline, _, _ = ddp_verified
    run = tmp_path / "run"
    args = [*RESUME, f"trainer.max_steps={DDP_STEPS}", "trainer.log_every=1", f"trainer.eval_every={DDP_STEPS}",
            "logging.progress_bar=false", f"hydra.run.dir={run}"]
    proc = start([*TORCHRUN, "-m", "trainloop", *args], tmp_path / "output.txt")
    try:
        wait_for_step(run, 2, proc)
        os.kill(ranks_of(proc.pid)[1], signal.SIGTERM)  # rank 0 is not told: the ranks must agree
        code = finish(proc, timeout=300)
    finally:
        finish(proc, timeout=0)
    out = (tmp_path / "output.txt").read_text()
    assert code not in (0, None), out[-4000:]  # torchrun exits 1 when a rank exits non-zero; theirs:
    assert re.findall(r"exitcode\s+:\s*(-?\d+)", out) == ["75", "75"], out[-4000:]  # its report
    stopped = re.search(r"trainloop: stopped by (.+) after step (\d+), checkpoint saved in (\S+);", out)
    assert stopped and stopped[1] in ("SIGTERM", "a signal to another rank"), out[-4000:]
    assert 2 <= int(stopped[2]) < DDP_STEPS
    assert Path(stopped[3], "COMPLETE").is_file() and Path(stopped[3]).name == f"step_{int(stopped[2]):07d}"

    again = warm(2, args, cwd=tmp_path, timeout=300, check=False)  # checkpoint.resume=auto is the default
    code, out = again.returncode, again.stdout + again.stderr
    assert code == 0, out[-12000:]
    assert resumed_at(out)[0] == int(stopped[2])
    same = verify_resume.compare(baseline / "straight", run, DDP_STEPS)
    assert same.losses_bitwise and same.weights_bitwise and not same.notes, same.report(0)


@pytest.mark.slow
def test_sigkill_while_saving_resumes_from_the_previous_checkpoint(tmp_path):
    """Acceptance 4: kill -9 in the middle of a save; the same arguments (run on a warm rank: the subject is
    the resume, not the process) resume and finish."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "trainloop", "+preset=smoke", "trainer.max_steps=40",
               "checkpoint.every_steps=1", "logging.progress_bar=false", f"hydra.run.dir={run}"]
    root = run / "checkpoints"
    proc = start(command, tmp_path / "output.txt")
    partial = None
    try:
        while partial is None and proc.poll() is None:
            names = os.listdir(root) if root.is_dir() else []
            if not any(n.startswith("step_") for n in names):
                time.sleep(0.02)
                continue
            if not any(n.startswith(".tmp_step_") for n in names):
                continue
            # Frozen, the run's folder holds still: kill it only in a save with some files written
            # and no COMPLETE yet (between COMPLETE and the rename, a kill is a different case).
            proc.send_signal(signal.SIGSTOP)
            for name in (n for n in os.listdir(root) if n.startswith(".tmp_step_")):
                written = os.listdir(root / name)
                if written and "COMPLETE" not in written:
                    proc.send_signal(signal.SIGKILL)
                    partial = name
            if partial is None:
                proc.send_signal(signal.SIGCONT)
    finally:
        code = finish(proc, timeout=0 if partial is None else 60)
    assert partial, "the run finished before a save could be interrupted"
    assert code == -signal.SIGKILL
    assert (root / partial).is_dir() and not (root / partial / "COMPLETE").exists()
    previous = max(p.name for p in root.glob("step_*"))
    assert f"step_{int(partial.rpartition('_')[2]) - 1:07d}" == previous

    again = warm(1, command[3:])
    log = again.stdout + again.stderr
    assert f"removing {root / partial}" in log
    assert f"resumed from {root / previous}" in log
    assert (run / "final" / "model.safetensors").is_file()
    assert not list(root.glob(".tmp_*"))


def test_cpu_adam_resumes_bitwise(deepspeed_ops, monkeypatch):
    """DeepSpeed's CPU Adam (the optimizer of ZeRO offload), 20 steps straight against 10, a
    state_dict round trip into a new optimizer, and 10: bitwise. Without restoring its step count,
    its bias correction at step 11 is pow(0.95, 11), not 0.95 multiplied up 11 times: 1 ulp apart."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from trainloop.parallel.deepspeed_config import restore_cpu_adam_step_count

    def train(params, optimizer, steps):
        for step in steps:
            generator = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator)
            optimizer.step()

    def fresh(tensors):
        params = [torch.nn.Parameter(t.clone()) for t in tensors]
        return params, DeepSpeedCPUAdam(params, lr=1e-3, betas=(0.9, 0.95), adamw_mode=True)

    start = [torch.randn(1000, generator=torch.Generator().manual_seed(0)), torch.randn(300)]
    straight, optimizer = fresh(start)
    train(straight, optimizer, range(1, 21))
    first, optimizer = fresh(start)
    train(first, optimizer, range(1, 11))
    resumed, again = fresh([p.detach() for p in first])
    again.load_state_dict(optimizer.state_dict())
    restore_cpu_adam_step_count(again)
    train(resumed, again, range(11, 21))
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
