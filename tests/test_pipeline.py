"""Pipeline parallelism (parallel.pp_size, issue 36) for real: 2 and 4 processes over gloo on CPU, the decoder
blocks cut into stages, torch.distributed.pipelining's schedules, compared with one process.

One 1-process run (batch 2, 4 micro-batches a step, 10 steps) is what every schedule must
reproduce on 2 processes: the same global batch, every logged loss and gradient norm within 1e-5,
the evaluation, and the exported weights within 1e-4 (relative, per tensor). A stage that saw other
data, a loss counted on two stages, or an export of one stage's blocks is off by far more.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from helpers import (
    adapter_tensors, assert_same_weights, assert_samples_are_the_final_models, compose, end_family, grad_norms,
    logits_agree, losses, pretrained_llama, ranks_of, read_metrics, reference_run, relative_difference,
    reset_accelerate, run_log, start, torchrun, train, wait_for_step, warm,
)

STEPS = 10
HALF = STEPS // 2  # where the runs evaluate, save, stop and resume
SAVED = f"step_{HALF:07d}"
RUN = ["+preset=smoke", "model.tie_embeddings=false", "model.num_layers=4", "data.batch_size=2",
       "trainer.gradient_accumulation_steps=4", f"trainer.max_steps={STEPS}", "trainer.log_every=1",
       f"trainer.eval_every={HALF}", "trainer.eval_batches=2", "logging.progress_bar=false",
       f"checkpoint.every_steps={HALF}"]
TOLERANCE = 1e-5
# each schedule also composes with more the stages must carry: gradient checkpointing and the chunked
# loss (48 of a micro-batch's 128 tokens at a time, on the last stage), regional compile (each block
# compiled; AOTAutograd's graphs, run eagerly)
SCHEDULES = {"gpipe": ["model.gradient_checkpointing=true", "trainer.loss_chunk_tokens=48"],
             "1f1b": ['eval.prompts=["The cat","Once upon"]', "eval.max_new_tokens=8"],  # generated through the stages
             "interleaved_1f1b": ["parallel.pp_stages_per_rank=2", "compile=aot_eager", "compile.regional=true"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return reference_run(tmp_path_factory, *RUN)


def launch_pp(run_dir: Path, *overrides: str) -> Path:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    warm(2, [*RUN, "parallel.pp_size=2", *overrides, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent)
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_two_stages_train_as_one_process_does(tmp_path, reference, schedule):
    run = launch_pp(tmp_path / "run", f"parallel.pp_schedule={schedule}", *SCHEDULES[schedule])
    stages = 4 if schedule == "interleaved_1f1b" else 2
    assert f"pipeline: {stages} stages over 2 processes ({schedule}), blocks per stage " in run_log(run)
    if "compile.regional=true" in SCHEDULES[schedule]:  # compiled before the cut, each block once
        assert "torch.compile: 4 LlamaDecoderLayer blocks, backend aot_eager" in run_log(run)
    for measure in (losses, grad_norms):
        got, want = measure(run), measure(reference)
        assert sorted(got) == list(range(1, STEPS + 1))
        assert max(abs(got[s] - want[s]) for s in got) < TOLERANCE, (measure.__name__, got, want)
    evals = [[r["eval_loss"] for r in read_metrics(d) if "eval_loss" in r] for d in (run, reference)]
    assert len(evals[0]) == 2 and max(abs(a - b) for a, b in zip(*evals)) < TOLERANCE
    assert_same_weights(run / "final", reference / "final")  # the stages gathered under the model's own names
    if schedule == "1f1b":
        assert_samples_are_the_final_models(run, ["The cat", "Once upon"], 8)
        # SIGTERM to one rank after step HALF: every rank stops after the same step, saves and exits
        # 75; the same command resumes and its losses are bitwise the uninterrupted run's
        stopped = tmp_path / "stopped"
        command = [*RUN, "parallel.pp_size=2", f"parallel.pp_schedule={schedule}", f"hydra.run.dir={stopped}",
                   "checkpoint.save_final_model=false"]
        proc = start([*torchrun(2), *command], tmp_path / "stopped.txt")
        try:
            wait_for_step(stopped, HALF, proc)
            os.kill(ranks_of(proc.pid)[1], signal.SIGTERM)
            proc.wait(timeout=300)
        finally:
            end_family(proc, stacks=False)
        out = (tmp_path / "stopped.txt").read_text()
        assert re.findall(r"exitcode\s+:\s*(-?\d+)", out) == ["75", "75"], out[-4000:]
        at = {int(n) for n in re.findall(r"stopped by (?:SIGTERM|a signal to another rank) after step (\d+)", out)}
        assert len(at) == 1 and HALF <= min(at) < STEPS, out[-4000:]
        warm(2, command, cwd=tmp_path)
        assert f"resumed from {stopped / 'checkpoints' / f'step_{min(at):07d}'}" in run_log(stopped)
        got, want = losses(stopped), losses(run)
        assert sorted(got) == list(range(1, STEPS + 1)) and all(got[s] == want[s] for s in got), (got, want)
        # and on one process: the stages' DCP shards load by name into the whole model
        alone = train(tmp_path / "alone", *RUN, f"checkpoint.resume={run / 'checkpoints' / SAVED}",
                      "checkpoint.save_final_model=false", small=False)
        got, want = losses(alone), losses(reference)
        assert sorted(got) == list(range(HALF + 1, STEPS + 1))
        assert max(abs(got[s] - want[s]) for s in got) < TOLERANCE, (got, want)


# FSDP2 reduce-scatters each micro-batch's gradients (fsdp.sync_each_batch=true, the default), or
# torch's PipelineStage does once per step (false); the tp mesh runs the second
FSDP = ["fsdp=full_shard"]
MESHES = {  # 4 processes: the layout's overrides, and what the run line says of it
    "replicated": (["data.batch_size=1"], "x 2 data-parallel (replicated, mesh cpu 2 pp x 2 dp_shard)"),
    "fsdp": (["data.batch_size=1", *FSDP], "x 2 data-parallel (FSDP2 on dp_shard, mesh cpu 2 pp x 2 dp_shard)"),
    "tp": (["parallel.tp_size=2", *FSDP, "fsdp.sync_each_batch=false"],
           "x 1 data-parallel (FSDP2 on dp_shard, tensor parallel, mesh cpu 2 pp x 1 dp_shard x 2 tp)"),
}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_two_stages_on_a_4_process_mesh_train_as_one_process_does(tmp_path, reference, mesh):
    """4 processes, 2 stages, and on the other mesh dimensions: 2 data-parallel ranks, each reading
    half of the global batch (1 x 4 micro-batches), the stages replicated over dp_shard (their
    gradients summed) or sharded by FSDP2 over it; or 2 tp ranks splitting each block's matrices.
    Replicated, it stops at step HALF and resumes on one process."""
    overrides, says = MESHES[mesh]
    sharded = mesh != "replicated"
    run = tmp_path / "run"
    stop = [] if sharded else [f"trainer.stop_at_step={HALF}"]
    warm(4, [*RUN, "parallel.pp_size=2", *overrides, f"hydra.run.dir={run}", *stop], cwd=tmp_path)
    assert says in run_log(run)
    got, want = losses(run), losses(reference)
    assert sorted(got) == list(range(1, (STEPS if sharded else HALF) + 1))
    assert max(abs(got[s] - want[s]) for s in got) < TOLERANCE, (got, want)
    if sharded:  # the shards gathered, the stages over pp
        assert_same_weights(run / "final", reference / "final")
    if mesh == "fsdp":  # its step-HALF checkpoint resumes under FSDP2 alone on the 4 processes (2x2 -> 1x4)
        alone = tmp_path / "fsdp_alone"
        warm(4, [*RUN, *FSDP, "data.batch_size=1", "trainer.gradient_accumulation_steps=2",
                f"checkpoint.resume={run / 'checkpoints' / SAVED}", "checkpoint.save_final_model=false",
                f"hydra.run.dir={alone}"], cwd=tmp_path)
        got = losses(alone)
        assert sorted(got) == list(range(HALF + 1, STEPS + 1)) and max(abs(got[s] - want[s]) for s in got) < TOLERANCE
    if sharded:
        return
    alone = train(tmp_path / "alone", *RUN, f"checkpoint.resume={run / 'checkpoints' / SAVED}",
                  "checkpoint.save_final_model=false", small=False)
    got = losses(alone)
    assert sorted(got) == list(range(HALF + 1, STEPS + 1)) and max(abs(got[s] - want[s]) for s in got) < TOLERANCE


@pytest.mark.slow
def test_one_process_checkpoint_resumes_on_two_stages(tmp_path, reference):
    """The other way: accelerate's whole-model files, each stage taking its blocks' weights and
    optimizer state by name, and the run going on as the one process did."""
    resumed = launch_pp(tmp_path / "resumed", f"checkpoint.resume={reference / 'checkpoints' / SAVED}",
                        "checkpoint.save_final_model=false")
    got, want = losses(resumed), losses(reference)
    assert sorted(got) == list(range(HALF + 1, STEPS + 1))
    assert max(abs(got[s] - want[s]) for s in got) < TOLERANCE, (got, want)


@pytest.mark.slow
def test_lora_on_two_stages_trains_as_one_process_and_exports_what_peft_loads(tmp_path):
    """A pretrained model from a local folder, LoRA on every projection, cut into 2 stages: the
    losses are one process's, the adapter and the merged export the same tensors, and they load
    in peft (base + adapter) and transformers (merged) to the same logits."""
    base = pretrained_llama(tmp_path / "base")
    tiny_only = ("model.tie_embeddings", "model.num_layers")
    lora = [*(o for o in RUN if not o.startswith(tiny_only)), "model=hf", f"model.name_or_path={base}", "adapter=lora",
            "optimizer.lr=1e-2",
            "trainer.max_steps=10", "trainer.eval_every=5", "checkpoint.every_steps=null"]
    alone = train(tmp_path / "alone", *lora, small=False)
    run = tmp_path / "run"
    warm(2, [*lora, "parallel.pp_size=2", f"hydra.run.dir={run}"], cwd=tmp_path)
    got, want = losses(run), losses(alone)
    assert sorted(got) == list(range(1, 11)) and max(abs(got[s] - want[s]) for s in got) < TOLERANCE, (got, want)
    assert abs(got[10] - got[1]) > 1e-3  # the adapter trained
    pairs = [(adapter_tensors(run / "final"), adapter_tensors(alone / "final"))]
    assert set(pairs[0][0]) == set(pairs[0][1]) and relative_difference(*pairs[0]) < 1e-4
    assert_same_weights(run / "final", alone / "final")
    kind, worst = logits_agree(run / "final", base)
    assert kind == "LlamaForCausalLM" and worst < 1e-4, worst


def test_the_blocks_are_balanced_over_the_stages():
    from trainloop.parallel.pipeline import stage_blocks

    assert stage_blocks(4, 2) == [range(0, 2), range(2, 4)]
    assert [len(r) for r in stage_blocks(10, 4)] == [3, 3, 2, 2]
    assert stage_blocks(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]


@pytest.mark.parametrize("overrides, says", [
    (["parallel.pp_schedule=interleaved_1f1b"], "set parallel.pp_stages_per_rank=2"),
    (["parallel.pp_stages_per_rank=2"], "use parallel.pp_schedule=interleaved_1f1b"),
    (["trainer.gradient_accumulation_steps=1"], "set trainer.gradient_accumulation_steps=2 or more"),
    (["model.num_layers=1"], "2 stages but model.num_layers=1"),
    (["deepspeed=zero2"], "with deepspeed=zero2: DeepSpeed's engine runs the whole model on each process; set "
                          "deepspeed=none"),
    (["fsdp=full_shard", "fsdp.offload=cpu"], "set fsdp.offload=none"),
    (["parallel.tp_size=2", "parallel.sequence_parallel=true", "fsdp=full_shard"],
     "set parallel.sequence_parallel=false"),
    (["objective=simpo", "data=preference", "trainer.loss_chunk_tokens=16"],
     "trainer.loss_chunk_tokens=16 with parallel.pp_size=2 and objective=simpo: the pipeline chunks the next-token "
     "loss alone"),
    (["model.tie_embeddings=true"], "set model.tie_embeddings=false"),
    (["model.arch=gpt2"], "only model.arch=llama is cut into stages"),
    (["model.attn_implementation=eager"], "needs model.attn_implementation=sdpa"),
    (["model=hf", "model.name_or_path=/some/model", "adapter=lora", "model.quantization=4bit"],
     "use model.quantization=none"),
])
def test_what_the_pipeline_cannot_run_is_refused_naming_the_key(overrides, says):
    from trainloop.config.compose import validate
    from trainloop.errors import ConfigError

    cfg = compose("+preset=smoke", "model.tie_embeddings=false", "trainer.gradient_accumulation_steps=2",
                  "parallel.pp_size=2", *overrides)
    with pytest.raises(ConfigError, match="parallel") as err:
        validate(cfg)
    assert says in str(err.value), str(err.value)


def test_a_pipeline_needs_a_multiple_of_pp_size_processes():
    from accelerate import Accelerator

    from trainloop.errors import ConfigError
    from trainloop.parallel import build_strategy

    reset_accelerate()
    cfg = compose("+preset=smoke", "model.tie_embeddings=false", "trainer.gradient_accumulation_steps=2",
                  "parallel.pp_size=2")
    with pytest.raises(ConfigError, match=r"pp_size=2 does not divide the 1 process\(es\): launch a multiple"):
        build_strategy(cfg, Accelerator(cpu=True))
