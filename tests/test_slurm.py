"""scripts/slurm.sbatch requeues a preempted run whatever the launcher returns (issue 23).

The job script runs for real under bash, with torchrun and trainloop; only SLURM's own commands
are stand-ins (no SLURM here): `srun` runs its command once, as on one node, and `scontrol`
answers `show hostnames` and writes down a `requeue`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, clean_env, read_metrics, wait_for_step

SRUN = """#!/usr/bin/env bash
while [ "${1#--}" != "$1" ]; do shift; done  # srun's own options
exec "$@"
"""
SCONTROL = """#!/usr/bin/env bash
case "$1" in
  show) echo localhost ;;
  *) echo "$@" >> "$SCONTROL_LOG" ;;
esac
"""


@pytest.fixture
def slurm_bin(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


@pytest.mark.slow
def test_a_preempted_job_is_requeued_though_torchrun_exits_1(tmp_path, slurm_bin):
    run_dir, log = tmp_path / "run", tmp_path / "scontrol.log"
    env = clean_env(PATH=f"{slurm_bin}:{os.environ['PATH']}", SLURM_JOB_ID="1234", SLURM_JOB_NODELIST="node1",
                    SLURM_SUBMIT_DIR=str(REPO), RUN_DIR=str(run_dir), NPROC_PER_NODE="1", PYTHON=sys.executable,
                    MASTER_PORT="29631", SCONTROL_LOG=str(log))
    job = subprocess.Popen(["bash", "scripts/slurm.sbatch", "+preset=smoke", "trainer.max_steps=400",
                            "trainer.log_every=1", "logging.progress_bar=false"], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_for_step(run_dir, 2, job)
        torchrun = [p for p in subprocess.run(["pgrep", "-f", "torch.distributed.run", "-s", str(job.pid)],
                                              capture_output=True, text=True).stdout.split()]
        assert len(torchrun) == 1, torchrun
        os.kill(int(torchrun[0]), signal.SIGTERM)  # SLURM's --signal=TERM@120 reaches the job step
        out, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert "preempted (launcher exit 1)" in out, out[-4000:]  # torchrun's code; its rank exited 75
    assert job.returncode == 0, out[-4000:]
    assert log.read_text() == "requeue 1234\n", out[-4000:]
    last = read_metrics(run_dir)[-1]
    assert last["event"] == "preempted" and last["by"] == "SIGTERM", last
    assert Path(last["checkpoint"], "COMPLETE").is_file(), last


def test_a_failed_job_is_not_requeued_and_keeps_its_exit_code(tmp_path, slurm_bin):
    log = tmp_path / "scontrol.log"
    env = clean_env(PATH=f"{slurm_bin}:{os.environ['PATH']}", SLURM_JOB_ID="1234", SLURM_JOB_NODELIST="node1",
                    SLURM_SUBMIT_DIR=str(REPO), RUN_DIR=str(tmp_path / "run"), NPROC_PER_NODE="1",
                    PYTHON=sys.executable, MASTER_PORT="29632", SCONTROL_LOG=str(log))
    job = subprocess.run(["bash", "scripts/slurm.sbatch", "+preset=smoke", "optimizer.lr=-1"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert job.returncode != 0 and "optimizer.lr" in job.stderr + job.stdout, job.stderr[-3000:]
    assert not log.exists()
