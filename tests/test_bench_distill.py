"""scripts/bench_distill.py: its quick run trains the teacher, then the student alone, distilled by trainloop
(JSD and forward KL) and by TRL's GKDTrainer from the same starting weights, and scores every model on the
same held-out rows with one function."""

from __future__ import annotations

import json
import math

import pytest

from helpers import REPO, warm

RUNS = ("alone", "jsd", "fkl", "trl-jsd", "trl-fkl")


@pytest.mark.slow
def test_the_quick_run_scores_every_student_on_the_same_rows(tmp_path):
    """`python scripts/bench_distill.py --quick` on a warm rank (the libraries imported once per worker)."""
    out = tmp_path / "bench.json"
    proc = warm(1, ["--quick", "--json", str(out)], cwd=REPO, timeout=600, check=False,
                script=REPO / "scripts" / "bench_distill.py")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert list(results) == ["teacher", "untrained student", *(f"{name} 4" for name in RUNS)]
    for name, r in results.items():
        assert math.isfinite(r["nll"]) and r["nll"] > 0 and 0 <= r["exact"] <= 1, (name, r)
    table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(results)  # the header, its rule, a row a model
    # every student starts from the same saved weights and trains 4 steps: none scores as the untrained one
    assert all(results[f"{name} 4"]["nll"] != results["untrained student"]["nll"] for name in RUNS)
