"""The efficiency toolbox, run for real on CPU: precision, optimizers, memory savers, attention, compile."""

from __future__ import annotations

import contextlib
import json
import logging
import math

import pytest
import torch

from helpers import SMALL, compose, launch, read_metrics, reference_run, reset_accelerate, train
from trainloop.config.compose import ConfigError, validate

STEPS = ["trainer.max_steps=5", "trainer.eval_every=5"]
# The smallest model that still has the parts under test: one block, 32 wide.
SMALLEST = ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "data.seq_len=32",
            "data.batch_size=8"]


def losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def saved_keys(run_dir) -> dict[str, list[str]]:
    """Tensor names in the final model and in every checkpoint's model file."""
    from safetensors import safe_open

    keys = {}
    for file in [*run_dir.glob("final/*.safetensors"), *run_dir.glob("checkpoints/step_*/model*.safetensors")]:
        with safe_open(file, framework="pt") as f:
            keys[str(file.relative_to(run_dir))] = list(f.keys())
    return keys


def optimizer_state(run_dir) -> dict:
    """The optimizer state of the last checkpoint, as accelerate saved it."""
    step = sorted(run_dir.glob("checkpoints/step_*"))[-1]
    state = torch.load(step / "optimizer.bin", weights_only=False)["state"]
    # bitsandbytes packs its quantized tensors into one entry of each parameter's state
    return {i: {**s, **s.get("__bnb_optimizer_quant_state__", {})} for i, s in state.items()}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """fp32 AdamW, SDPA, no compile: what every option is compared with."""
    return losses(reference_run(tmp_path_factory, *STEPS, small=True))


def trains(losses_: list[float]) -> bool:
    return len(losses_) == 5 and all(math.isfinite(x) for x in losses_) and losses_[-1] < losses_[0]


# --- optimizers ---------------------------------------------------------------------------------

# Each optimizer leaves its own state in the checkpoint: proof that it is the one that ran.
OPTIMIZER_STATE = {
    "adafactor": ("exp_avg_sq_row", torch.float32),
    "adamw8bit": ("state1", torch.uint8),
    "paged_adamw8bit": ("state1", torch.uint8),
    "sgd": ("momentum_buffer", torch.float32),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OPTIMIZER_STATE))
def test_optimizer_trains_5_steps(tmp_path, name):
    run_dir = train(tmp_path / "run", *STEPS, f"optimizer={name}")
    assert trains(losses(run_dir)), losses(run_dir)
    key, dtype = OPTIMIZER_STATE[name]
    states = optimizer_state(run_dir).values()
    assert any(key in s and s[key].dtype == dtype for s in states), [sorted(s) for s in states][:3]


@pytest.mark.slow
def test_optimizer_state_bytes_per_parameter():
    """Acceptance 2: measured on the live optimizers after one step of the tiny model."""
    from trainloop.model.builder import build_model, build_model_config
    from trainloop.optim.optimizers import build_optimizer, optimizer_state_bytes

    measured = {}
    for name in ("adamw", "adamw8bit", "adafactor", "sgd"):
        cfg = compose(f"optimizer={name}")  # the default tiny model, ~4M parameters
        torch.manual_seed(0)
        model = build_model(cfg.model, build_model_config(cfg.model, vocab_size=257))
        optimizer = build_optimizer(cfg.optimizer, model, on_cuda=False)
        ids = torch.randint(0, 257, (2, 32))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        measured[name] = optimizer_state_bytes(optimizer)

    assert measured["adamw"].per_param == pytest.approx(8.0, abs=0.01)  # exp_avg + exp_avg_sq in fp32
    assert measured["adamw"].quantized_params == 0
    eight_bit = measured["adamw8bit"]
    assert eight_bit.quantized_params > 0.99 * eight_bit.params  # all but the small vectors
    assert 2.0 <= eight_bit.per_quantized_param <= 2.2  # two uint8 states + block absmax
    assert measured["adafactor"].per_param < 0.5  # factored second moment only: well under 4
    assert measured["sgd"].per_param == pytest.approx(4.0, abs=0.01)  # one momentum buffer


@pytest.mark.slow
def test_deepspeed_offload_takes_cpu_adam_only(monkeypatch, deepspeed_ops):
    """Under optimizer offload the state lives in CPU memory and DeepSpeed's CPU Adam steps it."""
    from trainloop.model.builder import build_model, build_model_config
    from trainloop.optim.optimizers import build_optimizer, optimizer_state_bytes

    with pytest.raises(ConfigError, match="optimizer=adafactor with deepspeed.offload_optimizer"):
        validate(compose("deepspeed=zero2", "deepspeed.offload_optimizer=cpu", "optimizer=adafactor"))
    cfg = compose("+preset=smoke", "deepspeed=zero2", "deepspeed.offload_optimizer=cpu")
    validate(cfg)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # what build_accelerator sets on a machine without CUDA
    model = build_model(cfg.model, build_model_config(cfg.model, 257))
    optimizer = build_optimizer(cfg.optimizer, model, on_cuda=False, cpu_offload=True)
    ids = torch.randint(0, 257, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert type(optimizer).__name__ == "DeepSpeedCPUAdam"
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert optimizer_state_bytes(optimizer).per_param == pytest.approx(8.0, abs=0.01)


# --- precision ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_bf16_trains_on_cpu_close_to_fp32(tmp_path, baseline):
    bf16 = losses(train(tmp_path / "run", *STEPS, "precision=bf16"))
    assert trains(bf16)
    assert bf16 != baseline  # autocast really ran the matmuls in bf16
    assert max(abs(a - b) for a, b in zip(bf16, baseline)) < 0.05


def test_fp16_on_cpu_is_refused_before_training(tmp_path):
    with pytest.raises(ConfigError, match="precision=fp16 needs a CUDA GPU"):
        train(tmp_path / "run", "precision=fp16")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# --- memory savers ------------------------------------------------------------------------------

def test_gradient_checkpointing_gives_the_same_loss(tmp_path, baseline):
    """Acceptance 3: recomputing activations changes memory, not the numbers (fp32, same seed)."""
    from trainloop.model.builder import build_model, build_model_config

    cfg = compose("+preset=smoke", "model.gradient_checkpointing=true")
    model = build_model(cfg.model, build_model_config(cfg.model, 257))
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    checkpointed = losses(train(tmp_path / "run", *STEPS, "model.gradient_checkpointing=true"))
    assert len(checkpointed) == 5
    assert max(abs(a - b) for a, b in zip(checkpointed, baseline)) < 1e-5


def test_batch_search_trials_leave_the_weights_alone():
    """With room for the largest candidate the search takes it at once, and changes no weight."""
    from functools import partial

    from trainloop.parallel.accelerator import build_accelerator
    from trainloop.memory.batch_size import search_batch_size
    from trainloop.model.builder import build_model, build_model_config
    from trainloop.objectives import build_objective
    from trainloop.optim.optimizers import build_optimizer
    from trainloop.parallel import build_strategy

    cfg = compose("+preset=smoke", "data.seq_len=128")
    reset_accelerate()
    strategy = build_strategy(cfg, build_accelerator(cfg))  # the trials are the run's step, on its strategy
    model = build_model(cfg.model, build_model_config(cfg.model, 257))
    before = [p.detach().clone() for p in model.parameters()]
    samples = torch.randint(0, 257, (64, 128))
    make_optimizer = partial(build_optimizer, cfg.optimizer, model, on_cuda=False)
    roomy = search_batch_size(strategy, model, build_objective(cfg, "cpu"), make_optimizer, samples, 32,
                              contextlib.nullcontext, budget=2**30)
    assert [(t["batch_size"], t["fits"]) for t in roomy.tried] == [(32, True)]
    assert (roomy.batch_size, roomy.accumulation) == (32, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


def test_batch_candidates_divide_the_effective_batch():
    from trainloop.memory.batch_size import candidates

    assert list(candidates(32, 1000)) == [32, 16, 8, 4, 2, 1]
    assert list(candidates(24, 1000)) == [24, 12, 6, 3, 1]
    assert list(candidates(12, 10)) == [6, 3, 1]  # no larger than the training set


@pytest.mark.slow
def test_auto_batch_size_halves_on_real_oom_and_keeps_the_effective_batch(tmp_path):
    """Acceptance 4. A 12 MiB budget for what a step adds is enforced by the allocator itself
    (RLIMIT_DATA), so batch 32 of 128-token blocks really fails to allocate; the search halves to
    a batch that fits, raises accumulation, says so in the log and metrics.jsonl, and training
    then runs exactly as with that batch set by hand. A fresh process, so that the heap it starts
    from is not one that earlier tests have grown (freed heap memory counts as already held)."""
    common = [*STEPS, "data.seq_len=128"]
    proc = launch(["python", "-m", "trainloop", *SMALL, *common, "data.batch_size=32",
                   "trainer.auto_batch_size=true", "trainer.auto_batch_size_budget_mb=12",
                   f"hydra.run.dir={tmp_path / 'auto'}"], cwd=tmp_path)
    auto_dir = tmp_path / "auto"
    record = next(r for r in read_metrics(auto_dir) if r.get("event") == "auto_batch_size")
    batch, accumulation = record["batch_size"], record["gradient_accumulation_steps"]
    sizes = [t["batch_size"] for t in record["tried"]]
    assert sizes[0] == 32 and all(b == a // 2 for a, b in zip(sizes, sizes[1:]))
    assert [t["fits"] for t in record["tried"]] == [False] * (len(sizes) - 1) + [True]
    assert all("can't allocate memory" in t["error"] for t in record["tried"][:-1])
    assert batch == sizes[-1] < 32 and batch * accumulation == 32 and record["effective_batch_size"] == 32
    assert f"auto batch size: per-device batch {batch} x {accumulation} accumulation steps" in proc.stdout + proc.stderr
    last = sorted(auto_dir.glob("checkpoints/step_*"))[-1]
    saved = (last / "config.yaml").read_text()
    assert f"batch_size: {batch}\n" in saved and f"gradient_accumulation_steps: {accumulation}\n" in saved
    fingerprint = json.loads((last / "trainer_state.json").read_text())["fingerprint"]  # says the same
    assert (fingerprint["data.batch_size"], fingerprint["trainer.gradient_accumulation_steps"]) == (batch, accumulation)

    by_hand = train(tmp_path / "by_hand", *common, f"data.batch_size={batch}",
                    f"trainer.gradient_accumulation_steps={accumulation}")
    assert losses(auto_dir) == pytest.approx(losses(by_hand), abs=1e-5)

    # Resumed without a budget (where batch 32 would fit), the run keeps the checkpoint's batch:
    # the data order of the steps already taken depends on it.
    train(auto_dir, *common, "trainer.max_steps=7", "data.batch_size=32", "trainer.auto_batch_size=true",
          "checkpoint.resume=auto")
    resumed = [r for r in read_metrics(auto_dir) if r.get("event") == "auto_batch_size"][-1]
    assert (resumed["batch_size"], resumed["gradient_accumulation_steps"], resumed["tried"]) == (batch, accumulation, [])
    assert [r["step"] for r in read_metrics(auto_dir) if "loss" in r][-2:] == [6, 7]


def test_batch_size_advice_names_sizes_off_the_multiple(tmp_path, caplog):
    from trainloop.memory.batch_size import batch_size_advice, tensor_core_multiple

    assert tensor_core_multiple("bf16", torch.device("cpu")) is None  # no tensor cores: no advice
    sizes = {"data.batch_size": 12, "data.seq_len": 128, "hidden size": 100, "vocab size": 320}
    advice = batch_size_advice(sizes, 8)
    assert "data.batch_size=12" in advice and "hidden size=100" in advice and "seq_len" not in advice
    assert batch_size_advice(sizes, 4) is None
    assert batch_size_advice({"data.batch_size": 64, "vocab size": 300}, 64) == "vocab size=300 not a multiple " \
        "of 64: GPU matrix multiplies (tensor cores) run fastest when batch, sequence, hidden and vocabulary " \
        "sizes are multiples of 64"
    assert batch_size_advice({"data.batch_size": 64, "vocab size": 320}, 64) is None
    with caplog.at_level(logging.WARNING, logger="trainloop"):
        train(tmp_path / "run", "trainer.max_steps=1", "data.batch_size=6", "checkpoint.save_final_model=false")
    assert batch_size_advice(sizes, None) is None
    assert "not a multiple of" not in caplog.text  # on this CPU-only machine


# --- attention ----------------------------------------------------------------------------------

def test_eager_attention_matches_sdpa(tmp_path, baseline):
    eager = losses(train(tmp_path / "run", *STEPS, "model.attn_implementation=eager"))
    assert len(eager) == 5
    assert max(abs(a - b) for a, b in zip(eager, baseline)) < 1e-4


def test_flash_attention_2_unavailable_says_so():
    from trainloop.model.builder import build_model, build_model_config

    cfg = compose("+preset=smoke", "model.attn_implementation=flash_attention_2")
    with pytest.raises(ConfigError, match=r"model.attn_implementation='flash_attention_2' is not available "
                                          r"here: .*Use model.attn_implementation=sdpa or eager"):
        build_model(cfg.model, build_model_config(cfg.model, 257))


# --- torch.compile ------------------------------------------------------------------------------

def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    yield
    torch._dynamo.reset()


def test_regional_compile_compiles_each_block_and_keeps_names():
    from trainloop.model.compile import compile_model
    from trainloop.model.builder import build_model, build_model_config

    cfg = compose("+preset=smoke", "compile=aot_eager", "compile.regional=true")
    model = build_model(cfg.model, build_model_config(cfg.model, 257))
    names = list(model.state_dict())
    compile_model(cfg.compile, model)
    blocks = list(model.model.layers)
    assert len(blocks) == 2 and all(b._compiled_call_impl is not None for b in blocks)
    assert model._compiled_call_impl is None and model.model._compiled_call_impl is None
    assert list(model.state_dict()) == names


@pytest.mark.slow
@pytest.mark.parametrize("regional", [False, True], ids=["whole", "regional"])
def test_aot_eager_compile_trains_like_eager(tmp_path, baseline, fresh_dynamo, regional):
    run_dir = train(tmp_path / "run", *STEPS, "compile=aot_eager", f"compile.regional={regional}")
    assert compiled_graphs() >= 1
    assert max(abs(a - b) for a, b in zip(losses(run_dir), baseline)) < 1e-5
    keys = saved_keys(run_dir)
    assert "final/model.safetensors" in keys and len(keys) >= 2
    assert not [k for names in keys.values() for k in names if "_orig_mod" in k]


@pytest.mark.slow
def test_inductor_compile_trains_and_saves_plain_names(tmp_path, fresh_dynamo):
    """The one inductor test (C++ code generation takes tens of seconds on CPU): smallest model, and
    token blocks packed as one stream, whose batches carry no position ids or document mask: one
    training graph of the model, not one more for the batches that have them."""
    small = [*STEPS, *SMALLEST, "trainer.eval_batches=1", "data.packing=stream"]
    eager = losses(train(tmp_path / "eager", *small))
    run_dir = train(tmp_path / "inductor", *small, "compile=inductor")
    assert compiled_graphs() >= 1
    assert max(abs(a - b) for a, b in zip(losses(run_dir), eager)) < 1e-4
    keys = saved_keys(run_dir)
    assert "final/model.safetensors" in keys and any(k.startswith("checkpoints/") for k in keys)
    assert not [k for names in keys.values() for k in names if "_orig_mod" in k]
    final = json.loads((run_dir / "final" / "config.json").read_text())
    assert final["num_hidden_layers"] == 1


@pytest.mark.slow
def test_the_compiled_optimizer_steps_as_the_eager_one_does(tmp_path, baseline, fresh_dynamo, caplog):
    """compile.optimizer=true under aot_eager (traced into graphs, run eagerly: no code generation): the
    same losses as the eager run, through graphs of the optimizer's own (the model's are counted apart)."""
    from torch._dynamo.utils import counters

    with caplog.at_level(logging.INFO, logger="trainloop"):
        run_dir = train(tmp_path / "run", *STEPS, "compile=aot_eager", "compile.optimizer=true")
    assert "torch.compile: the optimizer's step too (AdamW), backend aot_eager" in caplog.text
    assert max(abs(a - b) for a, b in zip(losses(run_dir), baseline)) < 1e-5
    graphs = counters["stats"]["unique_graphs"]
    counters.clear()
    torch._dynamo.reset()
    train(tmp_path / "model_only", *STEPS, "compile=aot_eager", "compile.optimizer=false")
    assert graphs > counters["stats"]["unique_graphs"] > 0


@pytest.mark.parametrize("overrides,compiled", [
    (["compile=inductor", "optimizer.impl=for_loop"], True),  # null: inductor, AdamW's for-loop, whole parameters
    (["compile=inductor", "optimizer=sgd"], True),
    (["compile=inductor"], False),  # optimizer.impl=auto: one fused kernel already
    (["compile=aot_eager", "optimizer.impl=for_loop"], True),  # traced as inductor would, to debug what it compiles
    (["compile=aot_eager", "optimizer=adafactor"], False),  # not torch's: transformers'
    (["compile=inductor", "compile.optimizer=false"], False),
    ([], False),
])
def test_the_optimizer_compiles_where_it_pays(overrides, compiled):
    from trainloop.optim.optimizers import build_optimizer, compile_optimizer

    cfg = compose(*overrides)
    optimizer = build_optimizer(cfg.optimizer, torch.nn.Linear(2, 2), on_cuda=False)
    compile_optimizer(cfg, optimizer)
    assert ("step" in vars(optimizer)) == compiled  # the instance's own step: the compiled one


def test_compile_settings_that_cannot_work_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="compile.mode=max-autotune is an inductor setting"):
        validate(compose("compile=aot_eager", "compile.mode=max-autotune"))
    with pytest.raises(ConfigError, match="compile.regional=true needs a compile backend"):
        validate(compose("compile.regional=true"))
    with pytest.raises(ConfigError, match="compile.optimizer=true compiles torch's own optimizers .*"
                                          "optimizer=adafactor is not one: set compile.optimizer=false"):
        validate(compose("compile=inductor", "compile.optimizer=true", "optimizer=adafactor"))
    with pytest.raises(ConfigError, match="compile.optimizer=true needs a compile backend"):
        validate(compose("compile.optimizer=true"))
    with pytest.raises(ConfigError, match="trainer.auto_batch_size with DeepSpeed"):
        validate(compose("deepspeed=zero2", "trainer.auto_batch_size=true"))
    with pytest.raises(ConfigError, match="compile=cudagraphs records CUDA graphs and needs a CUDA GPU"):
        train(tmp_path / "run", "compile=cudagraphs")


# --- presets ------------------------------------------------------------------------------------

def test_presets_are_the_guides_recipes():
    saver = compose("+preset=memory_saver")
    assert (saver.precision.name, saver.model.gradient_checkpointing, saver.optimizer.name) == \
        ("bf16", True, "adamw8bit")
    assert saver.trainer.gradient_accumulation_steps > 1
    speed = compose("+preset=speed")
    assert (speed.precision.name, speed.precision.tf32, speed.optimizer.name, speed.optimizer.impl) == \
        ("bf16", True, "adamw", "fused")
    assert (speed.model.attn_implementation, speed.compile.backend) == ("sdpa", "inductor")
    validate(saver)
    validate(speed)


def test_memory_saver_preset_trains_on_cpu(tmp_path):
    """bf16 + gradient checkpointing + 8-bit AdamW + accumulation, all at once."""
    run_dir = train(tmp_path / "run", "+preset=[smoke,memory_saver]", *SMALL[1:], *STEPS, small=False)
    assert trains(losses(run_dir))
    assert any("state1" in s for s in optimizer_state(run_dir).values())
