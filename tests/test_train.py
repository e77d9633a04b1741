"""The foundation end to end: a real run leaves metrics, checkpoints and a loadable model."""

from __future__ import annotations

import re

import pytest

from helpers import SMALL, compose, launch, read_metrics, reset_accelerate, train, warm


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


@pytest.mark.parametrize("method", ["forkserver", "fork"])
def test_loader_workers_load_the_batches_one_process_loads(method):
    """DataLoader workers start from a fork server by default (data.multiprocessing_context), not
    by forking a training process whose other threads may hold locks; either way two workers
    deliver the same batches, in the same order, as loading in the training process."""
    import torch

    from trainloop.data.loaders import PackedBlocks, build_dataloaders

    blocks = PackedBlocks(torch.arange(40 * 8).view(40, 8))

    def epoch(*overrides):
        cfg = compose("data.batch_size=4", *overrides).data
        train_loader, valid_loader = build_dataloaders(cfg, blocks, blocks, pin_memory=False)
        torch.manual_seed(0)  # the shuffle order
        return train_loader, [b["input_ids"].clone() for b in train_loader], [b["input_ids"].clone() for b in valid_loader]

    _, train_alone, valid_alone = epoch()
    loader, train_workers, valid_workers = epoch("data.num_workers=2", f"data.multiprocessing_context={method}")
    assert loader.multiprocessing_context.get_start_method() == method
    assert len(train_alone) == 10 and all(torch.equal(a, b) for a, b in zip(train_alone, train_workers, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(valid_alone, valid_workers, strict=True))
    assert compose().data.multiprocessing_context == "forkserver"


@pytest.mark.slow
def test_a_default_run_says_only_what_matters(tmp_path):
    """A run without DeepSpeed never imports it (its "Setting accelerator to CPU" banner), saving a
    model with tied embeddings does not warn about them, and a CPU gets no tensor-core advice."""
    run_dir = tmp_path / "run"
    done = launch(["python", "-m", "trainloop", "+preset=smoke", "trainer.max_steps=2", "logging.progress_bar=false",
                   f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    lines = (done.stdout + done.stderr).splitlines()
    assert any("saved the final model" in line for line in lines)
    noise = [line for line in lines if "deepspeed" in line.lower() or "Setting accelerator to" in line
             or "Removed shared tensor" in line
             or "tensor cores" in line or "not a multiple of" in line]
    assert not noise, "\n".join(noise)


def test_an_in_process_run_leaves_torch_distributed_as_it_found_it(tmp_path):
    """An FSDP2 run without a launcher makes a 1-process group and exports LOCAL_RANK for it; when it
    fails (or ends) neither is left, so the next 1-process run is no DDP group of one (whose reducer
    once hung freeing its gloo group at the end of tests/test_distributed.py's reference). The run is
    refused at its checkpoint check, after the group is made: no step is trained."""
    import os

    import torch.distributed as dist
    from accelerate.utils import DistributedType

    from trainloop.parallel.accelerator import build_accelerator
    from trainloop.parallel.process_group import PROCESS_GROUP_ENV
    from trainloop.config.compose import ConfigError

    env = {k: os.environ.get(k) for k in PROCESS_GROUP_ENV}
    assert not dist.is_initialized()
    (tmp_path / "run" / "checkpoints" / "step_0000001").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step_0000001" / "COMPLETE").touch()
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        train(tmp_path / "run", "fsdp=full_shard", "checkpoint.resume=null")
    assert not dist.is_initialized()
    assert {k: os.environ.get(k) for k in PROCESS_GROUP_ENV} == env
    reset_accelerate()
    accelerator = build_accelerator(compose(*SMALL))  # what the next 1-process run starts with
    assert (accelerator.distributed_type, accelerator.num_processes) == (DistributedType.NO, 1)
    assert not dist.is_initialized()


@pytest.mark.parametrize("bar", ["default", "forced"])
def test_train_log_holds_every_step_and_eval_and_a_file_gets_no_bar_unless_forced(tmp_path, bar):
    """Issue 58, item 7. Output to files, as under nohup or SLURM: by default no bar, so no carriage-return
    frames, and each step and eval a line; logging.progress_bar=true draws the bar there anyway, the step
    lines in it, not repeated as lines. train.log holds a line for every log step and every eval either way."""
    run_dir = tmp_path / "run"
    done = warm(1, ["+preset=smoke", "trainer.max_steps=4", "trainer.log_every=1", "trainer.eval_every=2",
                    "trainer.eval_batches=1", "checkpoint.save_final_model=false", f"hydra.run.dir={run_dir}",
                    *(["logging.progress_bar=true"] if bar == "forced" else [])], cwd=tmp_path)
    log = (run_dir / "train.log").read_text()
    assert re.findall(r"\] - step (\d+)  loss ", log) == ["1", "2", "3", "4"], log
    assert re.findall(r"\] - step (\d+): eval_loss ", log) == ["2", "4"], log
    shown = done.stdout + done.stderr
    assert re.findall(r"step (\d+): eval_loss ", shown) == ["2", "4"], shown
    if bar == "default":
        assert "\r" not in shown and re.findall(r"step (\d+)  loss ", shown) == ["1", "2", "3", "4"], shown
    else:
        assert re.search(r"\r.*4/4 \[", shown) and not re.search(r"step \d+  loss ", shown), shown
