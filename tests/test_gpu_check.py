"""scripts/gpu_check.sh (issue 28, item 6): its CPU form runs, and its report names every check.

The GPU form cannot run here; what can be checked of it on a CPU is that every check's GPU
command composes into a config trainloop accepts, so that whoever is lent a GPU is not stopped by
a typo in a key.
"""

from __future__ import annotations

import dataclasses
import re
import sys

import pytest


from helpers import REPO, clean_env, compose, launch
from trainloop.config.compose import check_command_line, validate

sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402

STATUS = re.compile(r"^\| (?P<name>[^|]+?) \| (?P<status>ran|failed|skipped) \|", re.M)


@pytest.mark.slow
def test_the_quick_cpu_form_exits_0_and_its_report_names_every_check(tmp_path):
    proc = launch(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--quick", "--out", str(tmp_path)],
                  env=clean_env(PYTHON=sys.executable), timeout=300)
    report = tmp_path / "gpu_check_report.md"
    assert proc.stdout.strip().splitlines()[-1] == f"report: {report}"
    rows = {m["name"]: m["status"] for m in STATUS.finditer(report.read_text())}
    assert list(rows) == [c.name for c in gpu_check.CHECKS]  # every check, once, in order
    assert rows["bf16"] == "ran" and rows["fp8"] == "ran", rows
    assert set(rows.values()) == {"ran", "skipped"}, rows
    text = report.read_text()
    for check in gpu_check.CHECKS:  # each GPU-only path skipped says why
        if check.cpu is None:
            assert f"| {check.name} | skipped | 0 |" in text and "no CUDA GPU: " + check.cpu_why[:30] in text
    fp8_row = next(line for line in text.splitlines() if line.startswith("| fp8 |"))
    assert "emulated" in fp8_row and "RSS" in fp8_row and "(step 4)" in fp8_row  # figures were read


def test_a_failed_check_is_reported_with_the_end_of_its_output(tmp_path):
    """A check that fails (here: a key this trainloop does not have) is a row and a section with
    its command and last lines, and the exit code is 1."""
    bf16 = next(c for c in gpu_check.CHECKS if c.name == "bf16")
    broken = dataclasses.replace(bf16, name="broken", cpu=["precision=bf16", "trainer.no_such_key=1"])
    machine = gpu_check.read_machine()
    outcome = gpu_check.run_check(broken, machine, tmp_path, quick=False, left=120)
    assert outcome.status == "failed" and outcome.why == "exit code 2", outcome
    assert "no_such_key" in outcome.tail
    text = gpu_check.report([outcome], machine, 1.0, quick=False)
    assert "| broken | failed |" in text and "### broken: exit code 2" in text and "trainer.no_such_key=1" in text


FORMS = [(c, gpu) for c in gpu_check.CHECKS if not c.command for gpu in (True, False) if gpu or c.cpu is not None]


@pytest.mark.parametrize("check,gpu", FORMS, ids=[f"{c.name}-{'gpu' if gpu else 'cpu'}" for c, gpu in FORMS])
def test_every_command_composes_into_a_config_trainloop_accepts(check, gpu):
    machine = gpu_check.Machine(gpu, "a GPU" if gpu else "a CPU", (9, 0) if gpu else None, flash_attn=gpu)
    base = (gpu_check.GPU_BASE if gpu else gpu_check.CPU_BASE) if check.base else []
    overrides = [*base, *(check.gpu if gpu else check.cpu), *gpu_check.EVERY_RUN]
    if check.adapt is not None:
        overrides, _ = check.adapt(machine, overrides)
    overrides = [o.replace("MODEL_DIR", "/some/model") for o in overrides]
    cfg = compose(*overrides)
    validate(cfg)
    check_command_line(cfg, overrides)
    if cfg.model.name == "tiny":  # the build's own check: a sequence the model has positions for
        assert cfg.data.seq_len <= cfg.model.max_position_embeddings


def test_the_bench_methods_rows_it_asks_for_exist():
    import bench_methods

    assert set(gpu_check.GPU_METHODS) <= {m.name for m in bench_methods.METHODS}


def test_every_command_names_a_script_or_a_test_that_exists():
    """A command check runs a script of scripts/, or pytest on tests that a `-k` selects: each is there."""
    for check in (c for c in gpu_check.CHECKS if c.command):
        if check.gpu[:2] == ["-m", "pytest"]:
            path = REPO / next(a for a in check.gpu if a.startswith("tests/"))
            selected = check.gpu[check.gpu.index("-k") + 1]
            assert re.search(rf"^def test_\w*{selected}\w*\(", path.read_text(), re.M), (check.name, selected)
        else:
            assert (REPO / check.gpu[0]).is_file(), check.name
