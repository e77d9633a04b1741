"""scripts/bench.py's step filter, on hand-made running intervals and step end times."""

from __future__ import annotations

import pytest

from helpers import compose, reset_accelerate, script

bench = script("bench")

# The process ran alone from start to t=10 (start-up, then steps 1-5), was stopped, then had
# two turns: 20-25 and 30-40 (it exited at 40). Steps 6 and 10 were stopped part-way.
INTERVALS = [(0.0, 10.0), (20.0, 25.0), (30.0, 40.0)]
ENDS = [3.0, 4.0, 5.0, 6.0, 7.0,  # steps 1-5, in the start-up interval
        21.0, 22.0, 23.5, 24.5,  # step 6 began at 7 (before the stop), 7 is the turn's first
        31.0, 32.0, 33.0, 35.0]  # step 10 began at 24.5, 11 is the turn's first


@pytest.mark.parametrize("warmup, expected", [
    # counted by hand: steps 4, 5 | 8, 9 | 12, 13 (1 and 2, 6 and 7, 10 and 11 are out)
    (3, [1.0, 1.0, 1.5, 1.0, 1.0, 2.0]),
    (7, [1.5, 1.0, 1.0, 2.0]),  # step 7 is out twice over; step 8 is the first one past warm-up
    (8, [1.0, 1.0, 2.0]),
    (12, [2.0]),
    (13, []),
])
def test_only_whole_steps_past_warmup_and_past_each_turns_first_count(warmup, expected):
    assert bench.timed_steps(ENDS, INTERVALS, warmup) == expected


def test_a_step_across_a_stop_never_counts():
    # one step per turn: each began in the turn before, so none ran whole inside one turn
    intervals = [(0.0, 2.0), (5.0, 7.0), (10.0, 12.0), (15.0, 17.0)]
    assert bench.timed_steps([1.0, 6.0, 11.0, 16.0], intervals, warmup=1) == []


def test_a_run_never_stopped_loses_only_warmup_and_its_second_step():
    # step 1 began at process start; step 2 is the first to start inside the interval
    assert bench.timed_steps([1.0, 2.0, 3.5, 4.0, 6.0], [(0.0, 100.0)], warmup=1) == [1.5, 0.5, 2.0]


@pytest.mark.parametrize("worker", ["raw", "hf"])
def test_each_baseline_worker_trains_on_the_token_blocks_epoch_after_epoch(tmp_path, worker):
    """The raw loop's and the HF Trainer's workers, in this process, on a corpus of a few blocks of 64
    tokens, 4 at a time: 3 steps cross an epoch's end. Each logs a step per optimizer step,
    starting near ln(vocabulary), the loss of an untrained model on real tokens. (The HF worker once
    fed the Trainer trainloop's batch dicts as if they were tensors, and the raw one stopped at the
    end of its first epoch: both died on a GPU.)"""
    import json
    import math


    from pydoc_data.topics import topics

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": topics[k][:120]}) + "\n" for k in sorted(topics)[:6]))
    reset_accelerate()
    cfg = compose("model.num_layers=1", "model.hidden_size=64", "model.num_heads=2", "data=files",
                  f"data.path={corpus}", "data.seq_len=64", "data.batch_size=4", *bench.COMMON)
    out = tmp_path / "steps.jsonl"
    train_set, _ = bench.build_common(cfg)
    assert len(train_set.blocks) // 4 < 3  # fewer steps an epoch than the run takes
    {"raw": bench.worker_raw, "hf": bench.worker_hf}[worker](cfg, 3, out)
    steps = [json.loads(line) for line in out.read_text().splitlines() if "step" in json.loads(line)]
    assert [s["step"] for s in steps] == [1, 2, 3]
    vocabulary = 320  # the default byte tokenizer's
    assert abs(steps[0]["loss"] - math.log(vocabulary)) < 1.0, steps
