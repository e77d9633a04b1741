"""scripts/bench_dpo.py: its quick run trains both sides for real (trainloop's objective=dpo, reward, kto
and distill and TRL's DPOTrainer, RewardTrainer, KTOTrainer and GKDTrainer) and prints a table with finite,
positive figures; and its table, on hand-made measurements, shows trainloop / TRL and says why a side did not run."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

from helpers import REPO, clean_env, script

bench_dpo = script("bench_dpo")

MIB = 2**20
LORA, FULL = bench_dpo.ROWS["lora"][0], bench_dpo.ROWS["full"][0]
MEASURED = ("lora", "full", "reward", "kto", "distill")


@pytest.mark.slow
def test_the_quick_run_measures_both_sides_on_the_same_sequences(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "scripts/bench_dpo.py", "--quick", "--rows", *MEASURED,
                           "--json", str(out)], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "sequences: every one 64 tokens on both sides (no padding)" in proc.stdout  # TRL pads to the longest
    assert re.search(r"trained parameters: lora [\d,]+ on both sides, full [\d,]+ on both sides, reward [\d,]+ on "
                     r"both sides, kto [\d,]+ on both sides, distill [\d,]+ on both sides", proc.stdout)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    for name in (bench_dpo.ROWS[row][0] for row in MEASURED):
        cells = rows[name].strip("| ").split(" | ")[1:]  # steps, ratio, peaks, ratio, wall steps; building
        figures = [float(x.replace(",", "")) for cell in cells for x in re.findall(r"\d[\d,]*(?:\.\d+)?", cell)]
        assert len(figures) == 10 and all(math.isfinite(x) and x > 0 for x in figures[:8]), rows[name]
    results = json.loads(out.read_text())["results"]
    for row in MEASURED:
        ours, trl = results[row]["trainloop"], results[row]["trl"]
        assert ours["trained_params"] == trl["trained_params"]
        assert ours["steps_timed"] == trl["steps_timed"] == 2
        if row in ("lora", "full", "kto"):  # the policy starts as its reference: DPO's log 2, KTO's 0.5 a row
            assert math.isclose(ours["loss_first"], math.log(2) if row != "kto" else 0.5, rel_tol=1e-5)
    assert results["lora"]["trl"]["reference"] == "adapters disabled"
    assert results["lora"]["trl"]["trained_params"] < results["full"]["trl"]["trained_params"]


def measured(step_ms: float, peak_mib: float) -> dict:
    return {"step_s": step_ms / 1000, "wall_step_s": 2 * step_ms / 1000, "training_bytes": peak_mib * MIB,
            "building_bytes": MIB}


def test_the_table_is_trainloop_over_trl_and_a_failed_side_says_why():
    results = {"lora": {"trainloop": measured(800, 230), "trl": measured(1000, 345)},
               "full": {"trainloop": measured(900, 300), "trl": {"failed": "ImportError: no module named trl"}}}
    lines = bench_dpo.table(results).splitlines()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines[2:]}
    assert "| 800 ms | 1,000 ms | 0.80x | 230.0 MiB | 345.0 MiB | 0.67x | 1,600 ms | 2,000 ms |" in rows[LORA]
    assert "not run: trl: ImportError: no module named trl" in rows[FULL]


def test_a_median_over_repeats_and_a_failed_repeat_fails_the_side():
    runs = [{**measured(ms, mib), "cpu_step_s": ms / 1000} for ms, mib in [(800, 200), (700, 260), (900, 230)]]
    s = bench_dpo.summarize(runs)
    assert s["step_s"] == 0.8 and s["training_bytes"] == 230 * MIB and len(s["runs"]) == 3
    assert bench_dpo.summarize([*runs, {"failed": "exit -9"}])["failed"] == "exit -9"
