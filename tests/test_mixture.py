"""Mixtures (data.sources): the schedule's proportions, the mixture's blocks, the refusals, and a
real run whose tokens per source follow the weights, exactly again after a resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import compose, read_metrics, reset_accelerate, train
from trainloop.config.compose import ConfigError, check_command_line, compose_config, validate
from trainloop.data.loaders import PackedBlocks
from trainloop.data.mixture import MixtureBlocks, Schedule, build_training_data


def counts_by_position(schedule: Schedule, positions: int, sources: int) -> list[list[int]]:
    """Prefix counts: row p holds how many of the first p positions each source filled."""
    rows, row = [[0] * sources], [0] * sources
    for p in range(positions):
        s, k = schedule.at(p)
        assert k == row[s], f"position {p}: source {s}'s draw {k}, expected {row[s]}"  # draws in order
        row = list(row)
        row[s] += 1
        rows.append(row)
    return rows


@pytest.mark.parametrize("weights,prefix_bound", [([0.75, 0.25], 0.5), ([3, 1], 0.5), ([0.1, 0.9], 0.5),
                                                  ([0.5, 0.3, 0.2], 1.0), ([1, 1, 1, 1, 5], 2.5)])
def test_the_schedule_keeps_the_weights_on_every_window(weights, prefix_bound):
    total, n = sum(weights), len(weights)
    rows = counts_by_position(Schedule(weights), 3000, n)
    for start in range(0, 3000, 13):
        for length in (1, 2, 3, 4, 7, 10, 64, 333, 1000):
            if start + length > 3000:
                continue
            for s in range(n):
                got = rows[start + length][s] - rows[start][s]
                bound = prefix_bound if start == 0 else 2 * prefix_bound
                assert abs(got - length * weights[s] / total) <= bound, (weights, start, length, s, got)
    assert rows[3000] == [round(3000 * w / total) for w in weights] or n > 2


def blocks(n: int, first: int) -> PackedBlocks:
    return PackedBlocks(torch.arange(first, first + 4 * n).view(n, 4))


def test_mixture_items_passes_and_epochs():
    big, small = blocks(30, 0), blocks(5, 1000)
    mix = MixtureBlocks([big, small], [0.75, 0.25], seed=7)
    assert len(mix) == 20  # the small source runs out first: 5 blocks / 0.25
    mix.whole_batches(8)
    assert len(mix) == 16
    seen = []
    for epoch in range(3):
        mix.set_epoch(epoch)
        seen += [mix[i] for i in range(len(mix))]
    assert set(seen[0]) == {"input_ids", "labels", "position_ids", "source"}
    assert seen[0]["source"].dtype == torch.long and seen[0]["source"].dim() == 0
    by_source = [[int(item["input_ids"][0]) for item in seen if int(item["source"]) == s] for s in (0, 1)]
    assert len(by_source[0]) == 36 and len(by_source[1]) == 12
    assert all(x < 1000 for x in by_source[0]) and all(x >= 1000 for x in by_source[1])
    # epochs continue the schedule: the big source repeats nothing in its first pass, the small
    # one goes through all its blocks in each pass of 5, each pass in a new order
    assert len(set(by_source[0][:30])) == 30
    passes = [by_source[1][i:i + 5] for i in (0, 5)]
    assert all(sorted(p) == [1000 + 4 * b for b in range(5)] for p in passes) and passes[0] != passes[1]
    again = MixtureBlocks([big, small], [0.75, 0.25], seed=7)
    other = MixtureBlocks([big, small], [0.75, 0.25], seed=8)
    assert [int(again[i]["input_ids"][0]) for i in range(16)] == [int(x["input_ids"][0]) for x in seen[:16]]
    assert [int(other[i]["input_ids"][0]) for i in range(16)] != [int(x["input_ids"][0]) for x in seen[:16]]


def test_the_validation_union_holds_each_held_out_block_once():
    parts = [blocks(3, 0), blocks(7, 100), blocks(1, 200)]
    union = MixtureBlocks(parts, [len(p) for p in parts], seed=1, length=11, shuffle=False)
    firsts = sorted(int(union[i]["input_ids"][0]) for i in range(11))
    assert firsts == sorted(int(p[b]["input_ids"][0]) for p in parts for b in range(len(p)))
    assert {int(union[i]["source"]) for i in range(4)} >= {0, 1}  # an eval_batches prefix reads several sources


SOURCES = "data.sources=[{{path: {a}, weight: 0.75}},{{path: {b}, weight: 0.25, name: upper}}]"


@pytest.fixture
def corpora(tmp_path: Path) -> tuple[Path, Path]:
    """Two small data=files corpora with different text (so different tokens): about 50 and 25
    blocks of 16 tokens, so 200 steps of 1 block cross epochs and re-use the small source."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"text": topics[k][:60]}) + "\n" for k in keys[:12]))
    b.write_text("".join(json.dumps({"text": topics[k][:60].upper()}) + "\n" for k in keys[30:36]))
    return a, b


def test_the_command_line_form_composes_and_is_read(corpora):
    overrides = ["data=files", SOURCES.format(a=corpora[0], b=corpora[1])]
    cfg = compose_config(overrides)
    check_command_line(cfg, overrides)
    assert [(s.path, s.weight, s.name) for s in cfg.data.sources] == [
        (str(corpora[0]), 0.75, None), (str(corpora[1]), 0.25, "upper")]
    from trainloop.checkpoint.compatibility import run_fingerprint

    assert run_fingerprint(cfg, 1)["data.sources"][1] == {"path": str(corpora[1]), "weight": 0.25, "name": "upper"}


def test_an_unnamed_source_is_keyed_by_its_stem_unless_two_are_alike(corpora, tmp_path):
    from trainloop.data.mixture import source_names

    a, b = corpora
    (tmp_path / "other").mkdir()
    other_a = tmp_path / "other" / "a.jsonl"
    cases = [(f"[{{path: {a}}},{{path: {b}, name: upper}}]", ["a", "upper"]),
             (f"[{{path: {a}}},{{path: {other_a}}},{{path: {b}}}]", [str(a), str(other_a), "b"]),
             (f"[{{path: {a}}},{{path: {b}, name: a}}]", [str(a), "a"]),
             (f"[{{path: {tmp_path / 'other'}}},{{path: '{tmp_path}/*.jsonl'}}]", ["other", f"{tmp_path}/*.jsonl"])]
    for sources, names in cases:
        assert source_names(compose("data=files", f"data.sources={sources}").data) == names


@pytest.mark.parametrize("sources,extra,says", [
    (SOURCES, ["data.path=/x.jsonl"], "data.path=/x.jsonl and data.sources are both set"),
    ("data.sources=[{{path: {a}, weight: 1}},{{path: {b}, weight: 0}}]", [],
     "data.sources[1].weight=0.0 must be a number greater than 0"),
    ("data.sources=[{{path: {a}, weight: -2}}]", [], "data.sources[0].weight=-2.0 must be a number greater than 0"),
    ("data.sources=[{{path: {a}}},{{path: {b}, name: {a}}}]", [], "repeat"),
    ("data.sources=[]", [], "data.sources=[] holds no source"),
    (SOURCES, ["data.num_workers=1", "data.persistent_workers=true"], "data.persistent_workers=true with data.sources"),
])
def test_bad_sources_are_refused(corpora, sources, extra, says):
    with pytest.raises(ConfigError) as err:
        compose_config(["data=files", sources.format(a=corpora[0], b=corpora[1]), *extra])
    assert says in str(err.value)


def test_sources_need_a_data_option_that_reads_paths(corpora):
    overrides = [SOURCES.format(a=corpora[0], b=corpora[1])]
    with pytest.raises(ConfigError, match="data.sources=.* has no effect unless data=files, chat, prompt_completion or prepared"):
        check_command_line(compose(*overrides), overrides)
    with pytest.raises(ConfigError, match="do not compose"):  # a weight must be a number
        compose_config(["data=files", "data.sources=[{path: a, weight: heavy}]"])
    with pytest.raises(ConfigError, match=r"required keys have no value: data.sources\[0\].path"):
        compose_config(["data=files", "data.sources=[{weight: 1}]"])


def test_a_missing_source_is_refused_naming_it(corpora, tmp_path):
    from trainloop.data.loaders import byte_level_tokenizer

    cfg = compose("+preset=smoke", "data=files", SOURCES.format(a=corpora[0], b=tmp_path / "nothing_here"))
    validate(cfg)
    with pytest.raises(ConfigError, match=r"data.sources\[1\] \(path .*nothing_here\): .*no such file"):
        build_training_data(cfg.data, byte_level_tokenizer(), cfg.trainer.seed)


# Acceptance check 2 (issue 15): weights 0.75 / 0.25, 200 steps. A tiny model and short blocks keep it cheap.
MIX_RUN = ["model.num_layers=1", "model.hidden_size=16", "model.intermediate_size=32", "data.seq_len=16",
           "data.batch_size=1",
           "trainer.max_steps=200", "trainer.log_every=20", "trainer.eval_every=200", "trainer.eval_batches=1",
           "checkpoint.save_final_model=false"]


@pytest.mark.slow
def test_two_sources_follow_their_weights_and_resume_exactly(tmp_path, corpora):
    mix = ["data=files", SOURCES.format(a=corpora[0], b=corpora[1]), *MIX_RUN]
    whole = read_metrics(train(tmp_path / "whole", *mix))
    split_dir = train(tmp_path / "split", *mix, "trainer.stop_at_step=90")
    split = read_metrics(train(split_dir, *mix))
    lines = [[r for r in run if "loss" in r] for run in (whole, split)]
    assert [r["step"] for r in lines[0]] == list(range(20, 201, 20))
    last = lines[0][-1]["tokens_per_source"]
    assert set(last) == {"a", "upper"}  # the unnamed source by its file's stem (a.jsonl)
    assert sum(last.values()) == lines[0][-1]["tokens_seen"] == 200 * 1 * 16
    assert abs(last["a"] / last["upper"] / 3 - 1) < 0.02, last
    # The same seed, run whole and stopped at step 90 (saved between two log lines) then resumed:
    # identical counts and losses, but the stop logs its window so far (81-90) and the resumed run
    # takes step 100's mean over 91-100 only: the two lines average to the whole run's step 100.
    stopped_at = next(r for r in lines[1] if r["step"] == 90)
    resumed = [r for r in lines[1] if r is not stopped_at]
    assert [(r["step"], r["tokens_per_source"]) for r in resumed] == [(r["step"], r["tokens_per_source"]) for r in lines[0]]
    assert [r["loss"] for r in resumed if r["step"] != 100] == [r["loss"] for r in lines[0] if r["step"] != 100]
    after = next(r for r in resumed if r["step"] == 100)
    whole_100 = next(r for r in lines[0] if r["step"] == 100)
    assert (stopped_at["loss"] + after["loss"]) / 2 == pytest.approx(whole_100["loss"], rel=1e-6)
    assert max(r["epoch"] for r in lines[0]) >= 2  # the schedule crossed epochs, the small source re-used


def test_the_run_reads_the_mixture_in_order_and_moves_it_each_epoch():
    from accelerate import Accelerator

    from trainloop.data.loaders import build_dataloaders
    from trainloop.loop import TrainState, batches_forever
    from trainloop.data.order import GlobalOrder

    reset_accelerate()
    mix = MixtureBlocks([blocks(30, 0), blocks(5, 1000)], [0.75, 0.25], seed=7)
    order = GlobalOrder(len(mix), seed=7, batch_size=4, accumulation=1, world_size=1, rank=0, shuffle=False)
    loader, _ = build_dataloaders(compose("data.batch_size=4").data, mix, mix, pin_memory=False, order=order)
    batches = batches_forever(Accelerator(cpu=True), loader, TrainState())
    steps = len(mix) // 4
    for epoch in (0, 1):
        got = torch.cat([next(batches)["input_ids"][:, 0] for _ in range(steps)])
        assert mix.epoch == epoch  # the loop hands the epoch to the mixture
        assert got.tolist() == [int(mix[i]["input_ids"][0]) for i in range(4 * steps)]  # not shuffled
