"""The suite's own safety net: a test that hangs fails alone, with every thread's stack, under the
project's pytest configuration (pytest-timeout, [tool.pytest.ini_options] in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO, clean_env

HANGS = '''
import time

import trainloop.parallel.accelerator  # noqa: F401 - conftest's autouse fixture imports it (torch): at collection, untimed


def test_hangs():
    time.sleep(120)  # past the time-out


def test_runs_after_it():
    pass
'''


@pytest.mark.slow
def test_a_test_past_the_time_out_fails_alone_with_its_stack(tmp_path):
    (tmp_path / "test_hangs.py").write_text(HANGS)
    # the project's ini and conftest (as a plugin: the file is not under tests/) with a 2 s limit, on
    # one xdist worker as CI runs them
    done = subprocess.run([sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir",
                           str(tmp_path), "-p", "conftest", "-o", "timeout=2", "-n", "1", "-p", "no:cacheprovider",
                           str(tmp_path / "test_hangs.py")], capture_output=True, text=True,
                          # a guard, not the check: three pytest processes (the controller, the worker and
                          # its replacement) each import torch and the conftest; 65-70 s in CI runs, and one
                          # past 100 s with the other worker's processes on both cores
                          timeout=300, env=clean_env(PYTHONPATH=str(REPO / "tests")))
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-4000:]
    assert "Timeout (0:00:02)!" in out, out[-4000:]  # faulthandler's dump, every thread's stack
    line = HANGS.splitlines().index("    time.sleep(120)  # past the time-out") + 1
    assert f'test_hangs.py", line {line} in test_hangs' in out, out[-4000:]
    assert "worker 'gw0' crashed while running 'test_hangs.py::test_hangs'" in out, out[-4000:]
    assert "1 failed, 1 passed" in out, out[-4000:]  # the worker is replaced and the suite goes on
