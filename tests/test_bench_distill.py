"""scripts/bench_distill.py: its quick run trains the teacher, then the student alone, distilled by trainloop
(JSD and forward KL) and by TRL's GKDTrainer from the same starting weights, and scores every model on the
same held-out rows with one function."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from helpers import REPO, clean_env

RUNS = ("alone", "jsd", "fkl", "trl-jsd", "trl-fkl")


@pytest.mark.slow
def test_the_quick_run_scores_every_student_on_the_same_rows(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "scripts/bench_distill.py", "--quick", "--json", str(out)], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert list(results) == ["teacher", "untrained student", *(f"{name} 4" for name in RUNS)]
    for name, r in results.items():
        assert math.isfinite(r["nll"]) and r["nll"] > 0 and 0 <= r["exact"] <= 1, (name, r)
    table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(results)  # the header, its rule, a row a model
    # every student starts from the same saved weights and trains 4 steps: none scores as the untrained one
    assert all(results[f"{name} 4"]["nll"] != results["untrained student"]["nll"] for name in RUNS)
