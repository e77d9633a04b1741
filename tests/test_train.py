"""The foundation end to end: a real run leaves metrics, checkpoints and a loadable model."""

from __future__ import annotations

import json

import pytest

from conftest import SMALL, launch, read_metrics, train


def test_run_leaves_metrics_and_a_loadable_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = train(tmp_path / "run")
    records = read_metrics(run_dir)
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert {"step", "loss", "lr", "tokens_per_s", "world_size"} <= set(steps[0])
    assert [r["step"] for r in evals] == [2, 4]
    assert all(r["eval_ppl"] == pytest.approx(2.718281828 ** r["eval_loss"]) for r in evals)

    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    prompt = tokenizer("def ", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 5
    assert (run_dir / "checkpoints" / "step_0000004" / "COMPLETE").is_file()
