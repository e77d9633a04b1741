"""Exit codes tell the truth: a config Hydra rejects exits 2, as one trainloop rejects does."""

from __future__ import annotations

import pytest

from helpers import clean_env, launch
from trainloop.__main__ import exit_code_of_hydra_failure


@pytest.mark.parametrize("override, named", [
    ("trainer.no_such_key=1", "trainer.no_such_key"),  # unknown key
    ("trainer.max_steps=many", "trainer.max_steps"),  # wrong type
    ("optimizer=no_such_optimizer", "optimizer/no_such_optimizer"),  # unknown group option
])
def test_a_config_hydra_rejects_exits_2_naming_the_key(tmp_path, override, named):
    proc = launch(["python", "-m", "trainloop", override, f"hydra.run.dir={tmp_path / 'run'}"], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert named in proc.stderr


def test_with_hydra_full_error_a_rejected_config_still_exits_2(tmp_path):
    proc = launch(["python", "-m", "trainloop", "trainer.no_such_key=1", f"hydra.run.dir={tmp_path / 'run'}"],
                  check=False, env=clean_env(HYDRA_FULL_ERROR="1"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" in proc.stderr and "trainer.no_such_key" in proc.stderr


def test_an_error_after_the_run_started_keeps_hydras_exit_code():
    assert exit_code_of_hydra_failure(1, run_started=False) == 2
    assert exit_code_of_hydra_failure(1, run_started=True) == 1
    assert exit_code_of_hydra_failure(0, run_started=False) == 0  # --help, --cfg job
