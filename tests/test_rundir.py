"""One run per run directory, each launch's record kept, and no rank outliving its launcher."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from helpers import SMALL, alive, clean_env, end_family, family, launch, start, torchrun, warm
from trainloop.config.compose import ConfigError
from trainloop.rundir import RUN_LOCK, hold_run_dir, run_dir_problem



def wait_for(condition, proc: subprocess.Popen, output: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"it ended (exit {proc.returncode}):\n{output.read_text()[-4000:]}"
        assert time.monotonic() < deadline, output.read_text()[-4000:]
        time.sleep(0.1)


def test_a_held_run_dir_is_refused_naming_its_holder(tmp_path):
    with hold_run_dir(tmp_path):
        with pytest.raises(ConfigError, match=rf"in use by another run \(host {socket.gethostname()}, "
                                              rf"pid {os.getpid()}, started "):
            with hold_run_dir(tmp_path):
                pass
    with hold_run_dir(tmp_path):  # released when the block ends: runs one after another go on
        pass


def test_the_lock_of_a_killed_run_does_not_block_the_next(tmp_path):
    holder = ("import os, signal, sys\nfrom trainloop.rundir import hold_run_dir\n"
              "with hold_run_dir(sys.argv[1]):\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.Popen([sys.executable, "-c", holder, str(tmp_path)], env=clean_env())
    assert proc.wait() == -signal.SIGKILL and f'"pid": {proc.pid},' in (tmp_path / RUN_LOCK).read_text()
    with hold_run_dir(tmp_path):
        pass


def test_a_run_dir_under_a_file_is_one_line_before_hydra_logs(tmp_path):
    """Issue 33, item 6: Hydra's log file handler would fail there with a 30-line traceback. Root
    may write anywhere chmod forbids, so the run dir is under a regular file."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc = launch(["python", "-m", "trainloop", f"hydra.run.dir={blocker / 'run'}"], check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [f"trainloop: error: cannot create the run dir {blocker / 'run'} ({blocker} "
                                        "is a file); choose another hydra.run.dir"], proc.stderr[-3000:]
    assert proc.stdout == ""


def not_as_root(function, *args) -> str:
    """repr(function(*args)), called in a child process that is not root, where permissions count."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only plain system calls, then out without any exit hook
        try:
            os.close(read)
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)  # nobody
            os.write(write, repr(function(*args)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as result:
        said = result.read()
    os.waitpid(pid, 0)
    return said


def test_a_run_dir_that_cannot_be_written_is_named():
    with tempfile.TemporaryDirectory(dir="/tmp") as root:  # not under tmp_path, which only root may enter
        read_only = Path(root) / "read_only"
        read_only.mkdir(mode=0o555)
        os.chmod(root, 0o755)
        assert not_as_root(run_dir_problem, read_only) == repr(
            f"cannot write into the run dir {read_only} (permission denied)")
        assert not_as_root(run_dir_problem, read_only / "run") == repr(
            f"cannot create the run dir {read_only / 'run'} (Permission denied: {read_only / 'run'})")
        writable = Path(root) / "writable"
        writable.mkdir()
        os.chmod(writable, 0o777)
        assert not_as_root(run_dir_problem, writable / "run") == "None"
    said = run_dir_problem("/proc/trainloop/run")  # a place nobody may create a folder in, root included
    assert said.startswith("cannot create the run dir /proc/trainloop/run ("), said


@pytest.mark.slow
def test_a_second_launch_into_a_running_run_dir_is_refused(tmp_path):
    run_dir, output = tmp_path / "run", tmp_path / "first.txt"
    first = start([sys.executable, "-m", "trainloop", *SMALL, "trainer.max_steps=100000",
                   "trainer.eval_every=100000", f"hydra.run.dir={run_dir}"], output)
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists(), first, output)
        second = launch(["python", "-m", "trainloop", *SMALL, f"hydra.run.dir={run_dir}"], check=False)
    finally:
        end_family(first, stacks=False)
        first.wait()
    assert second.returncode == 2, second.stderr[-3000:]
    assert f"is in use by another run (host {socket.gethostname()}, pid {first.pid}, started" in second.stderr
    steps = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len({line.split(",")[0] for line in steps}) == len(steps)  # each step once: one writer


@pytest.mark.slow
def test_a_refused_launch_keeps_the_record_of_the_run_before(tmp_path):
    """Hydra's record of a run dir's launches (each `python -m trainloop` on a warm rank)."""
    run_dir, record = tmp_path / "run", tmp_path / "run" / ".hydra"
    warm(1, [*SMALL, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    before = {p.name: p.read_bytes() for p in record.iterdir()}
    assert sorted(before) == ["config.yaml", "hydra.yaml", "overrides.yaml"]

    # refused after the run dir is held: the checkpoint there was made with another seq_len
    refused = warm(1, [*SMALL, "data.seq_len=100000", f"hydra.run.dir={run_dir}"], cwd=tmp_path, check=False)
    assert refused.returncode == 2 and "data.seq_len: 64 -> 100000" in refused.stderr, refused.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in record.iterdir()} == before

    # a resumed launch is recorded as the current one; the first launch's files are kept
    warm(1, [*SMALL, "trainer.max_steps=5", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert "trainer.max_steps=5" in (record / "overrides.yaml").read_text()
    assert "max_steps: 5" in (record / "config.yaml").read_text()
    assert {p.name: p.read_bytes() for p in (record / "launches" / "001").iterdir()} == before


@pytest.mark.slow
def test_killing_the_launcher_ends_every_rank(tmp_path):
    run_dir, output = tmp_path / "run", tmp_path / "output.txt"
    launcher = start([*torchrun(2), *SMALL, "trainer.max_steps=100000", "trainer.eval_every=100000",
                      f"hydra.run.dir={run_dir}"], output)
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists(), launcher, output)
    except BaseException:
        end_family(launcher, stacks=False)
        raise
    ranks = family(launcher.pid)[1:]
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.5)
    running = [pid for pid in ranks if alive(pid)]
    for pid in running:
        os.kill(pid, signal.SIGKILL)
    assert not running, f"ranks {running} still ran 30 s after torchrun was killed:\n{output.read_text()[-4000:]}"
    assert "the launcher (pid" in output.read_text()
