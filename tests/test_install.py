"""A plain (non-editable) `pip install .` ships the configs, and runs from any directory."""

from __future__ import annotations

import sys
import zipfile

import pytest

from helpers import REPO, clean_env, launch, read_metrics


@pytest.mark.slow
def test_wheel_ships_configs_and_runs_outside_the_checkout(tmp_path):
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    build = launch([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(REPO)])
    # setuptools' warnings (a config group not listed as a package, a deprecated field) reach the user
    # in every `pip install` and `bash scripts/setup.sh`
    warned = [line for line in (build.stdout + build.stderr).splitlines() if "Warning" in line]
    assert not warned, "the build warns:\n" + "\n".join(warned)
    wheel = next(wheels.glob("trainloop-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"trainloop/conf/{p.relative_to(REPO / 'conf')}" for p in (REPO / "conf").rglob("*.yaml")}
    assert shipped and shipped <= names, f"configs missing from the wheel: {sorted(shipped - names)}"
    code = {f"trainloop/{p.relative_to(REPO / 'trainloop')}" for p in (REPO / "trainloop").rglob("*.py")}
    assert code <= names, f"modules missing from the wheel (a package not in pyproject.toml?): {sorted(code - names)}"
    tasks = {f"trainloop/examples/harness/{p.name}" for p in (REPO / "examples" / "harness").glob("*.*")}
    assert tasks and tasks <= names, f"harness tasks missing from the wheel: {sorted(tasks - names)}"

    launch([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)])
    env = clean_env(PYTHONPATH=str(target))
    where = launch(["python", "-c", "import trainloop; print(trainloop.__file__)"], cwd=elsewhere, env=env)
    assert where.stdout.strip().startswith(str(target)), "the installed copy, not the checkout, must run"
    job = launch(["python", "-m", "trainloop", "+preset=smoke", "--cfg", "job"], cwd=elsewhere, env=env)
    assert "hidden_size: 64" in job.stdout

    run_dir = elsewhere / "run"
    launch(["python", "-m", "trainloop", "+preset=smoke", "trainer.max_steps=2", "logging.progress_bar=false",
            f"hydra.run.dir={run_dir}"], cwd=elsewhere, env=env)
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [2]
    assert (run_dir / "final" / "model.safetensors").is_file()
