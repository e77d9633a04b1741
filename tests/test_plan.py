"""trainloop.tools.plan: predicted bytes against live objects, saved tensors, RSS and the ZeRO paper."""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch

from conftest import SMALL, clean_env, compose, launch
from trainloop.optim import OPTIMIZERS
from trainloop.tools.plan import ModelShape, activation_bytes, main, model_shape, plan_memory


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind these tensors (shared ones counted once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def build_and_step(cfg):
    """The run's own builders, then one real forward, backward and optimizer step."""
    from trainloop.data import build_tokenizer
    from trainloop.model import build_model, build_model_config
    from trainloop.optim import build_optimizer

    torch.manual_seed(0)
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.model.name_or_path)
    model = build_model(cfg.model, build_model_config(cfg.model, len(tokenizer)))
    optimizer = build_optimizer(cfg.optimizer, model, on_cuda=False)
    ids = torch.randint(0, len(tokenizer), (cfg.data.batch_size, cfg.data.seq_len))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_model_state_bytes_are_exact_for_the_tiny_model(optimizer):
    cfg = compose(*SMALL, f"optimizer={optimizer}")
    plan = plan_memory(cfg, model_shape(cfg), world_size=1, device="cpu")
    model, opt = build_and_step(cfg)
    params = list(model.parameters())
    states = [v for state in opt.state.values() for v in state.values()]

    assert plan.get("parameters") == storage_bytes(params)
    assert plan.get("gradients") == storage_bytes(p.grad for p in params)
    assert plan.get("optimizer states") == storage_bytes(states) > 0


def test_the_meta_model_has_the_live_model_shape():
    cfg = compose(*SMALL, "model.arch=gpt2")
    shape = model_shape(cfg)
    model, _ = build_and_step(cfg)
    assert shape.shapes == [tuple(p.shape) for p in model.parameters()]
    assert shape.num_params == sum(p.numel() for p in model.parameters())


def saved_activation_bytes(cfg, autocast: bool) -> int:
    """Bytes autograd keeps for the backward pass after one forward: the activations."""
    from trainloop.data import build_tokenizer
    from trainloop.model import build_model, build_model_config

    tokenizer = build_tokenizer(None, None)
    model = build_model(cfg.model, build_model_config(cfg.model, len(tokenizer)))
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, len(tokenizer), (cfg.data.batch_size, cfg.data.seq_len))
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
        model(input_ids=ids, labels=ids).loss
    return sum(n for ptr, n in saved.items() if ptr not in params)


# Shapes unlike the ones the coefficients were read from: odd widths, 3 heads, a narrow MLP.
SHAPE = ["model.num_layers=3", "model.hidden_size=96", "model.num_heads=3", "model.intermediate_size=200",
         "data.seq_len=48", "data.batch_size=3"]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("variant", ["fp32", "bf16", "checkpointing", "eager"])
def test_activation_estimate_matches_the_saved_tensors(arch, variant):
    extra = {"fp32": [], "bf16": ["precision=bf16"], "checkpointing": ["model.gradient_checkpointing=true"],
             "eager": ["model.attn_implementation=eager"]}[variant]
    cfg = compose(*SMALL, *SHAPE, f"model.arch={arch}", *extra)
    half = variant == "bf16"
    predicted, _ = activation_bytes(model_shape(cfg), cfg.data.batch_size, cfg.data.seq_len, half=half,
                                    autocast=half, checkpointing=cfg.model.gradient_checkpointing,
                                    attention=cfg.model.attn_implementation)
    measured = saved_activation_bytes(cfg, autocast=half)
    assert predicted == pytest.approx(measured, rel=0.05)


def test_checkpointing_keeps_far_fewer_activations():
    cfg = compose(*SMALL, *SHAPE)
    shape = model_shape(cfg)
    args = (shape, cfg.data.batch_size, cfg.data.seq_len, False, False)
    without, _ = activation_bytes(*args, checkpointing=False, attention="sdpa")
    kept, recomputed = activation_bytes(*args, checkpointing=True, attention="sdpa")
    assert kept + recomputed < without
    assert recomputed == pytest.approx((without - kept) / shape.num_layers, rel=0.1)


def zero_plan(stage: int, psi: int, world_size: int, **deepspeed):
    """A bf16 ZeRO plan for a model of `psi` parameters (the paper's mixed-precision Adam setting)."""
    cfg = compose(*SMALL, f"deepspeed=zero{stage}", "precision=bf16",
                  *(f"deepspeed.{k}={v}" for k, v in deepspeed.items()))
    shape = ModelShape("llama", 1, 64, 256, 2, 2, 320, [(psi,)], 0, 0)
    return plan_memory(cfg, shape, world_size, "cuda")


@pytest.mark.parametrize("stage, expected_gb", [(1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage, expected_gb):
    """ZeRO paper, Figure 1: 7.5B parameters, 64 GPUs, K = 12 per stage (in 1e9 bytes)."""
    plan = zero_plan(stage, 7_500_000_000, 64)
    states = sum(plan.get(w) for w in ("parameters", "gradients", "optimizer states"))
    assert round(states / 1e9, 1) == expected_gb


def test_7b_llama_zero3_offload_on_8_processes_gives_the_paper_formula(capsys):
    layers, h, inter, heads = 32, 4096, 11008, 32
    assert main(["--json", "--no-presets", "--world-size", "8", "--device", "cuda", "--gpu-memory", "80",
                 "+preset=zero3_offload", "precision=bf16", f"model.num_layers={layers}",
                 f"model.hidden_size={h}", f"model.intermediate_size={inter}", f"model.num_heads={heads}"]) == 0
    plan = json.loads(capsys.readouterr().out)["config"]["plan"]
    vocab = 320  # the built-in byte tokenizer's 257 tokens, padded to model.vocab_multiple=64
    psi = layers * (4 * h * h + 3 * h * inter + 2 * h) + vocab * h + h  # tied embedding, RMSNorm weights
    assert plan["num_params"] == psi
    lines = {x["what"]: x for x in plan["lines"]}
    nd = 8
    # ZeRO-3 (P_os+g+p): (2 + 2 + K) * psi / Nd with K = 12, all moved to CPU memory by the offload
    for what, per_param in (("parameters", 2), ("gradients", 2), ("optimizer states", 12)):
        assert lines[what]["bytes"] == pytest.approx(per_param * psi / nd, abs=per_param * nd)
        assert lines[what]["where"] == "cpu"
    model_states = sum(lines[w]["bytes"] for w in ("parameters", "gradients", "optimizer states"))
    assert model_states == pytest.approx(16 * psi / nd, abs=16 * nd)
    assert plan["peak"]["cpu"] == model_states
    on_gpu = {x["what"] for x in plan["lines"] if x["where"] == "gpu"}  # the working set only
    assert on_gpu == {"reduce bucket", "gathered parameters", "activations"}


def test_presets_are_compared_with_numbers(capsys):
    assert main(["--world-size", "2", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "zero3_offload: fits" in out
    assert "zero3_nvme: does not apply" in out and "nvme_path" in out
    assert "CPU RAM:" in out and "for 2 process(es)" in out


def test_a_model_too_large_for_this_machine_does_not_fit(capsys):
    assert main(["--no-presets", "model.num_layers=48", "model.hidden_size=4096", "model.num_heads=32"]) == 0
    assert "the config: does NOT fit" in capsys.readouterr().out


def test_bad_overrides_exit_2_with_the_key(capsys):
    assert main(["--no-presets", "optimizer.name=lion"]) == 2
    assert "optimizer.name='lion'" in capsys.readouterr().err


@pytest.mark.slow
def test_predicted_training_memory_of_a_100m_model_is_within_15_percent_of_rss():
    """fp32 AdamW on CPU: peak RSS during 2 real steps minus RSS just before the model is built."""
    proc = launch(["python", "-m", "trainloop.plan", "--json", "--no-presets", "--measure", "2",
                   "model.num_layers=10", "model.hidden_size=768", "model.num_heads=12",
                   "data.seq_len=64", "data.batch_size=2"], env=clean_env(OMP_NUM_THREADS="2"), timeout=300)
    report = json.loads(proc.stdout)
    assert 90e6 < report["config"]["plan"]["num_params"] < 110e6
    measured = report["measured"]
    assert measured["cpu_training_bytes"] > 1e9
    assert math.isclose(measured["predicted_bytes"], measured["cpu_training_bytes"], rel_tol=0.15), measured
