"""scripts/bench_parallel.py's summary and table, on hand-made measurements of 2 processes."""

from __future__ import annotations

from helpers import script

bench_parallel = script("bench_parallel")

MIB = 2**20


def measured(training: list[int], peak: list[int], seconds: list[float]) -> dict:
    """Two processes' results as measure_training and compare give them (MiB)."""
    return {"per_process": [{"cpu_training_bytes": t * MIB, "peak_rss": p * MIB, "rss_before": 500 * MIB,
                             "predicted_bytes": t * MIB, "tokens_per_step": 512, "step_seconds": seconds}
                            for t, p in zip(training, peak)]}


def test_the_larger_process_and_the_median_step_count():
    s = bench_parallel.summary(measured([400, 450], [900, 950], [1.0, 4.0, 2.0]))
    assert s["training_peak"] == 450 * MIB and s["peak_rss"] == 950 * MIB
    assert s["step_s"] == 2.0 and s["tokens_per_s"] == 256.0  # the median of both processes' 6 steps


def test_ratios_are_against_ddp_and_a_failed_strategy_says_why():
    results = {"ddp": measured([1000, 1000], [1500, 1500], [2.0]),
               "zero3": {"failed": "exit 1: deepspeed is not installed"},
               "fsdp": measured([450, 500], [1000, 990], [4.0])}
    rows = {row.split(" | ")[0].lstrip("| "): row for row in bench_parallel.table(results).splitlines()[2:]}
    assert "| 0.50x |" in rows["FSDP2 (fully_shard)"] and "| 0.67x |" in rows["FSDP2 (fully_shard)"]
    assert "| 1.00x |" in rows["DDP"]
    assert "failed: exit 1: deepspeed is not installed" in rows["DeepSpeed ZeRO-3"]


def test_the_context_parallel_rows_are_against_cp_1():
    results = {"ddp": measured([1000, 1000], [1500, 1500], [2.0]),
               "cp1": measured([3200, 3200], [5000, 5000], [2.0]),
               "cp2": measured([1900, 1880], [3400, 3400], [2.0])}
    rows = {row.split(" | ")[0].lstrip("| "): row for row in bench_parallel.table(results).splitlines()[2:]}
    assert "| 1.00x |" in rows[bench_parallel.STRATEGIES["cp1"][0]]  # its own base, not DDP's 0.31x
    assert "| 0.59x |" in rows[bench_parallel.STRATEGIES["cp2"][0]] and "| 0.68x |" in rows[
        bench_parallel.STRATEGIES["cp2"][0]]
