"""One global order of samples (issue 15, acceptance 3) and data built outside any collective (acceptance 4).

The order is a function of (seed, epoch) alone and a global batch is the same samples at any
world size, so a DDP run resumes on another number of processes when the global batch is
unchanged, and continues the same sequence: 2 processes at batch 4 then 1 at batch 8 (and 1 -> 2)
give the losses and weights of one uninterrupted process at batch 8.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from helpers import SMALL, compose, train, warm
from trainloop.checkpoint.compatibility import check_world_size_change
from trainloop.config.compose import ConfigError
from trainloop.data.order import GlobalOrder, ValidationOrder
from trainloop.parallel.zero import DeepSpeedZeRO
from trainloop.tools.verify_resume import compare

# 108 training blocks (validation holds out 78 of the 79 whole documents): 13 global batches of 8
# per epoch, so 16 steps cross an epoch's end. SGD: under
# AdamW an uninterrupted 2-process run itself differs from 1 process by 1.7e-4 in the weights (its
# first steps normalise gradients whose elements are mostly cancellation, where the 2 ranks' partial
# sums round differently), while the losses agree to 2e-7: that is DDP's rounding, not the order.
RUN = ["data.validation_fraction=0.99", "trainer.max_steps=16", "trainer.eval_every=100", "checkpoint.keep_last=1",
       "optimizer=sgd"]


def ranks(num_samples: int, batch_size: int, accumulation: int, world_size: int, epoch: int = 0, start: int = 0):
    """Each rank's micro-batches of the epoch, from sample position `start`."""
    out = []
    for rank in range(world_size):
        order = GlobalOrder(num_samples, 1234, batch_size, accumulation, world_size, rank)
        order.set_position(epoch, start)
        out.append(list(order))
    return out


def steps(num_samples: int, batch_size: int, accumulation: int, world_size: int, **position) -> list[set[int]]:
    """The samples of each optimizer step, over every rank."""
    per_rank = ranks(num_samples, batch_size, accumulation, world_size, **position)
    count = len(per_rank[0]) // accumulation
    return [{i for batches in per_rank for b in batches[s * accumulation:(s + 1) * accumulation] for i in b}
            for s in range(count)]


def test_a_global_batch_is_the_same_samples_at_any_world_size():
    one = steps(75, 8, 1, 1)
    assert len(one) == 9  # 75 // 8 whole global batches: the last 3 samples are dropped this epoch
    assert steps(75, 4, 1, 2) == one == steps(75, 2, 2, 2) == steps(75, 1, 2, 4) == steps(75, 2, 1, 4)
    seen = [i for step in one for i in step]
    assert len(seen) == len(set(seen)) == 72  # each sample once per epoch
    assert steps(75, 8, 1, 1, epoch=1) != one  # a new permutation each epoch
    # a resume from a sample position continues the same sequence, at any world size
    assert steps(75, 4, 1, 2, start=40) == one[5:] == steps(75, 8, 1, 1, start=40)
    # rank r of W takes, at each micro-step, the samples [r*B, (r+1)*B) of the step's share
    two = ranks(75, 4, 1, 2)
    straight = ranks(75, 8, 1, 1)[0]
    assert all(a + b == s for a, b, s in zip(two[0], two[1], straight, strict=True))


def evaluated(num_samples: int, batch_size: int, accumulation: int, world_size: int, max_batches=None) -> list[int]:
    """The items an evaluation counts, over every rank; every rank runs as many micro-batches."""
    orders = [ValidationOrder(num_samples, batch_size, accumulation, world_size, rank, max_batches)
              for rank in range(world_size)]
    batches = [list(order) for order in orders]
    assert len({len(b) for b in batches}) == 1 and all(len(b) == len(o) for b, o in zip(batches, orders))
    for order, mine in zip(orders, batches):  # past its counted ones, a rank re-reads item 0 (not counted)
        assert all(0 < len(b) <= batch_size for b in mine)
        assert mine[order.counted:] == [[0]] * (len(mine) - order.counted)
    return sorted(i for order, mine in zip(orders, batches) for b in mine[:order.counted] for i in b)


@pytest.mark.parametrize("n", [1, 3, 8, 30, 33])
def test_an_evaluation_counts_every_item_once_at_any_world_size(n):
    """Issue 33: the validation split is not cut to whole global batches, nor padded with counted
    repeats; trainer.eval_batches counts global batches, so caps the same items at any layout."""
    for layout in [(8, 1, 1), (4, 1, 2), (2, 2, 2), (1, 1, 4), (4, 2, 1), (3, 1, 3)]:
        assert evaluated(n, *layout) == list(range(n)), layout
    assert evaluated(n, 8, 1, 1, 2) == evaluated(n, 4, 1, 2, 2) == evaluated(n, 4, 2, 1, 2) == list(range(min(n, 16)))
    two = [list(ValidationOrder(n, 4, 1, 2, rank)) for rank in range(2)]
    straight = list(ValidationOrder(n, 8, 1, 1, 0))  # rank r takes the r-th 4 of each 8, as in training
    assert [a + b for a, b in zip(*two)][:n // 8] == straight[:n // 8]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 9, 100, 1025, 65537])
def test_the_permutation_is_a_bijection_that_changes_with_its_key(n):
    """Computed index by index (no array of the corpus's size), yet each sample exactly once."""
    import numpy as np

    from trainloop.data.order import Permutation

    image = Permutation(n, 1234, 0)[np.arange(n)]
    assert sorted(image.tolist()) == list(range(n))
    some = range(0, n, max(1, n // 300))
    assert [int(Permutation(n, 1234, 0)[i][0]) for i in some] == image[list(some)].tolist()  # alone = in a batch
    if n >= 100:
        assert not np.array_equal(image, Permutation(n, 1234, 1)[np.arange(n)])  # epoch
        assert not np.array_equal(image, Permutation(n, 4321, 0)[np.arange(n)])  # seed
        assert not np.array_equal(image, np.arange(n))


def test_each_position_is_equally_likely_over_keys():
    import numpy as np

    from trainloop.data.order import Permutation

    where = np.bincount([int(np.flatnonzero(Permutation(10, 7, key)[np.arange(10)] == 0)[0]) for key in range(4000)],
                        minlength=10)
    assert where.min() > 300 and where.max() < 500, where  # 400 expected each; 5 sigma is +-95


def fingerprint(world_size: int, batch_size: int, accumulation: int = 1) -> dict:
    return {"world_size": world_size, "data.batch_size": batch_size,
            "trainer.gradient_accumulation_steps": accumulation}


def test_another_world_size_needs_the_same_global_batch_and_ddp():
    check_world_size_change(Path("ckpt"), fingerprint(2, 4), fingerprint(1, 8), keeps_world_size=None)
    check_world_size_change(Path("ckpt"), fingerprint(2, 4, 2), fingerprint(4, 1, 4), keeps_world_size=None)
    with pytest.raises(ConfigError, match=r"2 process\(es\) x data.batch_size=4 x trainer.gradient_accumulation_steps="
                                          r"1 = 8 samples per step.*world_size: 2 -> 1.*resume with data.batch_size=8 "
                                          r"on 1 process"):
        check_world_size_change(Path("ckpt"), fingerprint(2, 4), fingerprint(1, 4), keeps_world_size=None)
    with pytest.raises(ConfigError, match=r"data.batch_size x trainer.gradient_accumulation_steps = 2"):
        check_world_size_change(Path("ckpt"), fingerprint(2, 4), fingerprint(4, 1, 3), keeps_world_size=None)
    with pytest.raises(ConfigError, match=r"world_size: 2 -> 1.*DeepSpeed ZeRO \(deepspeed.stage=2\) each rank saves "
                                          r"its own partition"):
        check_world_size_change(Path("ckpt"), fingerprint(2, 4), fingerprint(1, 8),
                                keeps_world_size=DeepSpeedZeRO.keeps_world_size(compose("deepspeed=zero2")))


def on_two_processes(run_dir: Path, *overrides: str) -> str:
    """A 2-process run; its output (rank 0 also logs into run_dir/train.log)."""
    done = warm(2, [*SMALL, *overrides, f"hydra.run.dir={run_dir}"])
    return done.stdout + done.stderr


@pytest.mark.slow
def test_a_run_moves_between_two_processes_and_one_and_stays_the_same_run(tmp_path, caplog):
    """Steps 1-4 on 2 processes at batch 4, 5-14 on 1 at batch 8 (across the epoch's end after
    step 13), 15-16 on 2 again: the losses and weights of 16 steps on 1 process at batch 8."""
    assert compose(*SMALL).model.dropout == 0  # dropout draws differ between 1 and 2 processes
    caplog.set_level(logging.INFO, logger="trainloop")
    straight = train(tmp_path / "straight", *RUN, "data.batch_size=8")
    run = tmp_path / "run"
    on_two_processes(run, *RUN, "data.batch_size=4", "trainer.stop_at_step=4")
    with pytest.raises(ConfigError, match=r"world_size: 2 -> 1.*resume with data.batch_size=8 on 1 process"):
        train(run, *RUN, "data.batch_size=4")
    train(run, *RUN, "data.batch_size=8", "trainer.stop_at_step=14")
    assert "at another world size (world_size: 2 -> 1)" in caplog.text
    assert "at step 4 (epoch 0, batch 4): sample 32 of the epoch's order" in caplog.text
    out = on_two_processes(run, *RUN, "data.batch_size=4")
    log = (run / "train.log").read_text()
    assert "at another world size (world_size: 1 -> 2)" in log, out[-3000:]
    assert "at step 14 (epoch 1, batch 1): sample 8 of the epoch's order" in log, out[-3000:]
    found = compare(straight, run, 16)
    assert found.tensors and found.agrees(1e-5), found.report(1e-5)


def slow_tokenizer(path: Path, passes: int):
    """A real tokenizer that is slow: the built-in bytes behind `passes` normalizer passes."""
    from tokenizers import normalizers

    from trainloop.data.loaders import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    tokenizer.backend_tokenizer.normalizer = normalizers.Sequence([normalizers.Replace("e", "e")] * passes)
    tokenizer.save_pretrained(path)
    return tokenizer


@pytest.mark.slow
def test_tokenizing_longer_than_the_collective_timeout_still_trains(tmp_path, monkeypatch):
    """Acceptance 4: 2 processes, trainer.collective_timeout_s=10, and a corpus whose
    tokenization takes over 30 s on rank 0 while rank 1 waits: the run starts and trains."""
    import json

    from pydoc_data.topics import topics

    tokenizer = slow_tokenizer(tmp_path / "tokenizer", passes=1000)
    texts = [topics[k] for k in sorted(topics)]
    tokenizer(texts[:1])  # warm
    # the work per character as CPU time: the run tokenizes on one thread, so its wall time is at least the same
    # work's CPU time, however loaded the machine (an estimate in wall time, taken while the other worker loaded
    # the machine, came to 1.6x the run's own, and the corpus sized on it then took 155 s). CPU time too is longer
    # while the other worker's processes share the caches: an estimate of 3 samples in a row took 1.4x the run's
    # own (its 40 s of work tokenized in 28), so the least of 8, spread over 2 s, and 45 s of work
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # as the run tokenizes: one thread
    timings = []
    for _ in range(8):
        started = time.process_time()
        tokenizer(texts[1:4])
        timings.append(time.process_time() - started)
        time.sleep(0.25)
    per_char = min(timings) / sum(map(len, texts[1:4]))
    corpus, chars, i = tmp_path / "corpus.jsonl", 0, 0
    with corpus.open("w") as f:
        while chars * per_char < 45:  # seconds of CPU work on rank 0: over 30 s of wall time with room to spare
            f.write(json.dumps({"text": texts[i % len(texts)]}) + "\n")
            chars, i = chars + len(texts[i % len(texts)]), i + 1
    run = tmp_path / "run"
    out = on_two_processes(run, "data=files", f"data.path={corpus}", f"data.tokenizer={tmp_path / 'tokenizer'}",
                   "trainer.collective_timeout_s=10", "trainer.max_steps=2", "checkpoint.save_final_model=false")
    log = (run / "train.log").read_text()
    built = float(log.split("built the data in ")[1].split(" s")[0])
    assert built > 30, f"tokenizing took {built} s, not over 3x the timeout: the test proves nothing; {out[-2000:]}"
    assert '"step": 2,' in (run / "metrics.jsonl").read_text()
    assert not (run / ".data_build").exists()


def test_a_waiting_rank_stops_when_the_builder_fails_or_dies(tmp_path):
    """The wait has no time limit, so it must end when the builder cannot finish: its failure
    (a bad config: the same one line on every rank), or its death (a zombie counts as dead)."""
    import subprocess
    import sys

    from trainloop.data.node_turns import DataBuildFailed, wait_for, write_failure

    done, failed = tmp_path / "ready", tmp_path / "failed"
    builder = subprocess.Popen([sys.executable, "-c", "pass"])  # not reaped: a zombie once it ends
    with pytest.raises(DataBuildFailed, match=rf"rank 0 \(pid {builder.pid}\) ended while building the data"):
        wait_for(done, failed, builder.pid, "rank 0")
    builder.wait()
    write_failure(failed, ConfigError("data.text_field='body' is not a column"))
    with pytest.raises(ConfigError, match="^data.text_field='body' is not a column$"):
        wait_for(done, failed, 1, "rank 0")
    failed.unlink()
    done.touch()
    wait_for(done, failed, builder.pid, "rank 0")  # ready: returns, whatever the builder does since
