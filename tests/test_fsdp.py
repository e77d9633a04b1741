"""FSDP2 for real: torch's fully_shard applied by trainloop, 2 CPU processes over gloo under
warm ranks (tests/warm_ranks.py) and `accelerate launch --multi_gpu`, and one process.

Each run trains the smoke model for 10 steps and is compared step by step with one process at
batch 8 without FSDP (fp32): the losses and gradient norms must agree to 1e-5 relative, and the
exported weights to 1e-4 (relative, per tensor), so the gathered state dict is the whole trained model, not one rank's
shard nor a replica that trained alone (what accelerate's FSDP plugin does on CPU).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from helpers import (
    TWO_PROCESS_RUN, TWO_PROCESS_STEPS, WEIGHT_TOLERANCE, accelerate_launch, assert_same_weights, compose,
    grad_norms, launch, losses, pretrained_llama, read_metrics, reference_run, relative_difference, run_log,
    safetensors_of, train, warm,
)
from trainloop.config.compose import ConfigError, validate

TOLERANCE = 1e-5
FSDP_LINE = "FSDP2 full_shard over 2 shard(s) (DTensor placements Shard(dim=0), mesh cpu (2,); 3 modules sharded"


def assert_same_curve(run_dir: Path, reference: Path) -> None:
    """Losses and gradient norms of every step agree with the reference run's."""
    for measure in (losses, grad_norms):
        got, want = measure(run_dir), measure(reference)
        assert sorted(got) == list(range(1, TWO_PROCESS_STEPS + 1)), got
        worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
        assert worst < TOLERANCE, f"{measure.__name__}: largest relative difference {worst:.2e}: {got} vs {want}"


SAMPLE = 'eval.prompts=["Hello"]'  # greedy samples at every evaluation
# lm-evaluation-harness at the end, a multiple-choice and a generation task: every rank in every forward
HARNESS = ["eval.harness.tasks=[pydoc_order,pydoc_words]", "eval.harness.limit=20"]


def launch_fsdp(tmp_path: Path, launcher: str, presets: str, *extra: str, batch: int = 4) -> Path:
    """2 processes on warm ranks, or under `accelerate launch` (launcher "accelerate")."""
    run_dir = tmp_path / "run"
    args = [f"+preset=[{presets}]", *TWO_PROCESS_RUN, f"data.batch_size={batch}", *extra, f"hydra.run.dir={run_dir}"]
    if launcher == "accelerate":
        launch([*accelerate_launch(2), *args], cwd=tmp_path)
    else:
        warm(2, args, cwd=tmp_path)
    assert [p.parent for p in tmp_path.rglob("metrics.jsonl")] == [run_dir]
    assert {r["world_size"] for r in read_metrics(run_dir)} == {2}
    return run_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One process at batch 8, no FSDP: what 2 FSDP processes at batch 4 must reproduce."""
    return reference_run(tmp_path_factory, "+preset=smoke", *TWO_PROCESS_RUN, "data.batch_size=8")


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory) -> Path:
    return reference_run(tmp_path_factory, "+preset=[smoke,lora]", *TWO_PROCESS_RUN, "data.batch_size=8", SAMPLE, *HARNESS)


@pytest.mark.slow
def test_fsdp_regionally_compiled_matches_one_process_and_exports_the_gathered_weights(tmp_path, reference):
    """Acceptance 1, 4 and 5 in one launch: 2 processes, 2 shards, each block compiled with inductor
    and then sharded (torchtitan's order); the same losses, norms and final weights as 1 x 8."""
    run_dir = launch_fsdp(tmp_path, "warm", "smoke,fsdp", "compile=inductor", "compile.regional=true")
    log = run_log(run_dir)
    assert FSDP_LINE in log and "compute in float32" in log and "backend gloo" in log, log[-3000:]
    assert "torch.compile: 2 LlamaDecoderLayer blocks, backend inductor" in log
    # rank 1 held no weights of its own: the same curve and weights as 1 process come from rank 0's
    assert "1 of 2 processes built the model on the meta device and received their shards" in log
    assert_same_curve(run_dir, reference)
    assert_same_weights(run_dir / "final", reference / "final")


@pytest.mark.slow
def test_accelerate_launch_fsdp_lora_matches_one_process_and_exports_the_adapter(tmp_path, lora_reference):
    """Acceptance 1 and 5 under `accelerate launch --multi_gpu` (on CPU: accelerate's own FSDP
    would not engage), with a LoRA adapter applied before sharding: the adapter written is
    complete and is what one process at batch 8 trained, here as 2 micro-batches of 2 on each
    process, each micro-batch's gradients reduce-scattered into the shards (fsdp.sync_each_batch)."""
    run_dir = launch_fsdp(tmp_path, "accelerate", "smoke,fsdp,lora", SAMPLE, *HARNESS,
                          "trainer.gradient_accumulation_steps=2", batch=2)
    assert FSDP_LINE in run_log(run_dir)
    # peft's generate goes around the sharded root's forward: the samples gather its weights themselves
    samples = [[r["samples"] for r in read_metrics(d) if r.get("event") == "samples"] for d in (run_dir, lora_reference)]
    assert samples[0] == samples[1] and samples[0], samples
    assert "1 of 2 processes built the model on the meta device" in run_log(run_dir)  # with the adapter
    assert_same_curve(run_dir, lora_reference)
    adapter, want = safetensors_of(run_dir / "final" / "adapter"), safetensors_of(lora_reference / "final" / "adapter")
    assert adapter and set(adapter) == set(want) and all(t.numel() for t in adapter.values())
    assert any(t.abs().sum() > 0 for k, t in adapter.items() if "lora_B" in k)  # it trained from zero
    worst = relative_difference(adapter, want)
    assert worst < WEIGHT_TOLERANCE, worst
    assert_same_weights(run_dir / "final", lora_reference / "final")  # the merged model
    assert_same_harness_scores(run_dir, lora_reference, tmp_path)


def assert_same_harness_scores(run_dir: Path, lora_reference: Path, tmp_path: Path) -> None:
    """eval.harness, issue 40's check 2: the 2 FSDP2 processes log the scores one process logs, within 1e-6,
    and those are the merged export's (final/) as `python -m trainloop.evaluate` scores it."""
    import json

    from trainloop.tools.evaluate import main

    (got,), (want,) = ([r for r in read_metrics(d) if r.get("event") == "harness"] for d in (run_dir, lora_reference))
    keys = [k for k in want if "/" in k]
    assert {"pydoc_order/acc", "pydoc_order/acc_norm", "pydoc_words/exact_match"} <= set(keys), want
    assert all(abs(got[k] - want[k]) <= 1e-6 for k in keys), (got, want)
    main([str(lora_reference), "--tasks", "pydoc_order,pydoc_words", "--limit", "20",
          "--output", str(tmp_path / "r.json")])
    merged = json.loads((tmp_path / "r.json").read_text())["results"]
    assert all(abs(merged[k.split("/")[0]][k.split("/")[1] + ",none"] - want[k]) <= 1e-6 for k in keys), (merged, want)


@pytest.mark.slow
def test_a_pretrained_model_is_loaded_by_the_main_process_alone(tmp_path):
    """model=hf on 2 FSDP2 processes: rank 1 builds the pretrained model's shapes on the meta
    device and receives its shards from rank 0, which loaded the weights: the same curve and
    final weights as 1 process at batch 8 loading them itself."""

    model = f"model.name_or_path={pretrained_llama(tmp_path / 'pretrained')}"
    reference = train(tmp_path / "one", "+preset=smoke", "model=hf", model, *TWO_PROCESS_RUN, "data.batch_size=8", small=False)
    (tmp_path / "two").mkdir()
    run_dir = launch_fsdp(tmp_path / "two", "warm", "smoke,fsdp", "model=hf", model)
    assert "1 of 2 processes built the model on the meta device and received their shards" in run_log(run_dir)
    assert_same_curve(run_dir, reference)
    assert_same_weights(run_dir / "final", reference / "final")


def test_one_process_fsdp_whole_model_compiled(tmp_path, reference, caplog):
    """Without a launcher FSDP2 runs on a 1-process group of its own; the whole model compiled
    (aot_eager: dynamo traces around FSDP2's hooks without inductor's code generation)."""
    torch._dynamo.reset()  # graphs another in-process test compiled must not be reused here
    try:
        with caplog.at_level(logging.INFO, logger="trainloop"):
            run_dir = train(tmp_path, "+preset=[smoke,fsdp]", *TWO_PROCESS_RUN, "data.batch_size=8", "compile=aot_eager",
                            "checkpoint.save_final_model=false", small=False)
    finally:
        torch._dynamo.reset()
    log = caplog.text
    assert "FSDP2 full_shard over 1 shard(s)" in log and "torch.compile: whole model" in log
    assert_same_curve(run_dir, reference)


@pytest.mark.parametrize("overrides,key", [
    (["precision=fp16"], "precision=fp16"),
    (["trainer.auto_batch_size=true"], "trainer.auto_batch_size"),
    (["model=hf", "model.name_or_path=/m", "adapter=lora", "model.quantization=4bit", "precision=bf16"],
     "model.quantization=4bit"),
    (["deepspeed=zero3"], "deepspeed.stage=3"),
    (["optimizer=adamw8bit"], "optimizer=adamw8bit"),
    (["optimizer=adafactor"], "optimizer=adafactor"),
])
def test_what_fsdp_cannot_run_is_refused_before_compute(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as refused:
        validate(compose("+preset=fsdp", *overrides))
    assert "fsdp=full_shard" in str(refused.value)


@pytest.mark.parametrize("preset", ["fsdp", "smoke"])
def test_accelerates_own_fsdp_flag_is_refused(preset):
    """`accelerate launch --use_fsdp` would have accelerate wrap the model too (on GPUs) or
    nothing at all (on CPU): trainloop shards it itself, so the flag stops the run."""
    from trainloop.parallel.accelerator import check_launcher_env

    with pytest.raises(ConfigError, match="--use_fsdp") as refused:
        check_launcher_env(compose(f"+preset={preset}"), {"ACCELERATE_USE_FSDP": "true"})
    assert ("+preset=fsdp" in str(refused.value)) == (preset != "fsdp")
    check_launcher_env(compose(f"+preset={preset}"), {"ACCELERATE_USE_FSDP": "false"})
