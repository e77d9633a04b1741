"""Telemetry lines in metrics.jsonl from a real run, and the once-only GPU warnings."""

from __future__ import annotations

import logging

import psutil
import pytest
import torch

from helpers import read_metrics, train
from trainloop.observe.hardware import GpuReading
from trainloop.observe.telemetry import Telemetry


def test_a_run_with_telemetry_records_rss_and_data_wait(tmp_path):
    """Acceptance 4: on CPU, every telemetry_every steps: the process's RSS and the data-wait fraction."""
    run_dir = train(tmp_path / "run", "logging.telemetry_every=2", "trainer.max_steps=5",
                    "checkpoint.save_final_model=false")
    records = read_metrics(run_dir)
    samples = [r for r in records if r.get("event") == "telemetry"]
    assert [r["step"] for r in samples] == [2, 4]
    own_rss = psutil.Process().memory_info().rss  # the run was in this process
    for r in samples:
        assert 100 * 1024**2 < r["rss_bytes"] <= 2 * own_rss
        assert 0.0 < r["data_wait_frac"] < 1.0
        if not torch.cuda.is_available():
            assert not any(key.startswith("gpu_") for key in r)
    # the same window as the train line of that step (log_every=1), sampled a moment earlier
    train_lines = {r["step"]: r for r in records if "loss" in r}
    for r in samples:
        assert r["data_wait_frac"] == pytest.approx(train_lines[r["step"]]["data_wait_frac"], rel=0.5)


def test_without_telemetry_no_lines(tmp_path):
    run_dir = train(tmp_path / "run", "trainer.max_steps=2", "checkpoint.save_final_model=false")
    assert not [r for r in read_metrics(run_dir) if r.get("event") == "telemetry"]


def test_a_throttling_gpu_is_warned_about_once(caplog):
    telemetry = Telemetry(every=1, device=torch.device("cpu"))
    hot = GpuReading(index=0, name="NVIDIA A100-SXM4-80GB", temperature_c=88, throttle_mask=0x40,
                     sm_clock_mhz=900, max_sm_clock_mhz=1410)
    with caplog.at_level(logging.WARNING, logger="trainloop"):
        for _ in range(3):
            telemetry.warn_once(hot)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2  # the temperature and the throttling, each once
    assert any("88 C" in m for m in messages) and any("throttling" in m for m in messages)
