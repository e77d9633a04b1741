"""precision=fp8 (issue 28, item 3): torchao's float8 training, emulated on this CPU.

On a CPU torchao's Float8LinearConfig(emulate=True) casts inputs and weights to float8_e4m3fn and
output gradients to float8_e5m2 with their dynamic per-tensor scales, then multiplies the
dequantized values in fp32: the rounding of fp8 training, without fp8 hardware. A GPU's figures
come from scripts/gpu_check.sh.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from helpers import compose, read_metrics, train
from trainloop.config.compose import ConfigError, validate

# 50 steps of 2 x 32 tokens; one evaluation at the end
FIFTY = ["data.seq_len=32", "data.batch_size=2", "trainer.max_steps=50", "trainer.log_every=10", "trainer.eval_every=50"]


def step_losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run_dir) if "loss" in m}


def swapped(*overrides: str):
    """The smoke model, built and converted as a run would on this CPU."""
    from trainloop.model import fp8
    from trainloop.model.builder import build_model, build_model_config

    cfg = compose("+preset=smoke", "precision=fp8", *overrides)
    validate(cfg)
    model = build_model(cfg.model, build_model_config(cfg.model, vocab_size=257))
    return model, fp8.convert(cfg, model, torch.device("cpu"))


def test_the_swap_leaves_the_output_layer_and_layers_not_divisible_by_16_in_bf16():
    from torchao.float8.float8_linear import Float8Linear

    model, converted = swapped("model.intermediate_size=200")  # the MLP's 200 is no multiple of 16
    kinds = {name: type(m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    attention = {n for n in kinds if ".self_attn." in n}
    assert len(attention) == 8 and set(converted) == attention
    assert all(kinds[n] is Float8Linear for n in attention)
    assert all(kinds[n] is torch.nn.Linear for n in kinds if n not in attention), kinds  # MLP and lm_head
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].self_attn.q_proj.config.emulate  # no float8 matmul on a CPU


def test_fp8_skip_small_uses_torchaos_thresholds():
    """torchao's tensorwise thresholds (measured on H100): a layer converts unless in_features <=
    4096 and out_features <= 1024. A 1-layer, 1024-wide model, built on the meta device."""
    from trainloop.model import fp8
    from trainloop.model.builder import build_model, build_model_config

    cfg = compose("+preset=smoke", "precision=fp8", "precision.fp8_skip_small=true", "model.num_layers=1",
                  "model.hidden_size=1024", "model.num_heads=8")
    with torch.device("meta"):
        model = build_model(cfg.model, build_model_config(cfg.model, vocab_size=257))
        converted = fp8.convert(cfg, model, torch.device("cpu"))
    assert sorted(converted) == ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]  # 1024 -> 4096

    with pytest.raises(ConfigError, match="precision.fp8_skip_small=false"):
        swapped("precision.fp8_skip_small=true")  # the smoke model: every layer is small


@pytest.mark.slow
def test_fp8_trains_within_5_percent_of_bf16_resumes_exactly_and_exports_plain_linear_weights(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    bf16 = train(tmp_path / "bf16", *FIFTY, "precision=bf16")
    fp8 = train(tmp_path / "fp8", *FIFTY, "precision=fp8", "checkpoint.every_steps=40")
    at_50 = step_losses(fp8)[50], step_losses(bf16)[50]
    print(f"step 50: fp8 loss {at_50[0]:.4f}, bf16 {at_50[1]:.4f} ({at_50[0] / at_50[1] - 1:+.2%})")
    assert abs(at_50[0] - at_50[1]) <= 0.05 * at_50[1], at_50
    assert at_50[0] < step_losses(fp8)[10] - 0.5  # it learned
    assert step_losses(fp8) != step_losses(bf16)  # float8 rounding shows: the layers were swapped

    # a new run from the step-40 checkpoint: steps 41-50 and the weights exactly as the straight run's
    resumed = train(tmp_path / "resumed", *FIFTY, "precision=fp8",
                    f"checkpoint.resume={fp8 / 'checkpoints' / 'step_0000040'}")
    assert step_losses(resumed)[50] == step_losses(fp8)[50]
    straight, again = load_file(fp8 / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert straight.keys() == again.keys() and all(torch.equal(straight[k], again[k]) for k in straight)

    # final/ is a plain transformers model: nn.Linear layers, the trained weights, no torchao in its config
    config = json.loads((fp8 / "final" / "config.json").read_text())
    assert "quantization_config" not in config and "torchao" not in json.dumps(config)
    model = AutoModelForCausalLM.from_pretrained(fp8 / "final")
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linear and all(type(m) is torch.nn.Linear for m in linear)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in straight.items())
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.arange(16).unsqueeze(0)).logits).all()


@pytest.mark.parametrize("overrides,key", [
    (["deepspeed=zero2"], "deepspeed.stage"),
    (["adapter=lora"], "adapter=lora"),
    (["model.arch=gpt2"], "model.arch=gpt2"),
])
def test_refused_in_one_line_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        validate(compose("+preset=smoke", "precision=fp8", *overrides))
    lines = [line for line in str(err.value).splitlines() if "precision=fp8" in line]
    assert len(lines) == 1 and key in lines[0], str(err.value)


def test_refused_without_torchao(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # Python's own "not importable" marker
    with pytest.raises(ConfigError, match=r"precision=fp8 needs torchao .*pip install 'trainloop\[fp8\]'"):
        validate(compose("+preset=smoke", "precision=fp8"))
    validate(compose("+preset=smoke", "precision=bf16"))  # only fp8 needs it


def test_fp8_keys_are_refused_without_precision_fp8():
    from trainloop.config.compose import check_command_line

    for key in ("precision.fp8_emulate=true", "precision.fp8_skip_small=true"):
        overrides = ["precision=bf16", key]
        with pytest.raises(ConfigError, match="has no effect unless precision=fp8"):
            check_command_line(compose(*overrides), overrides)


def test_fp8_under_fsdp2_trains(tmp_path):
    """FSDP2 shards the swapped blocks (weights gathered in bf16, not torchao's float8 all-gather)."""
    run = train(tmp_path / "fsdp", "fsdp=full_shard", "precision=fp8", "data.seq_len=32")
    assert all(v == v for v in step_losses(run).values()) and len(step_losses(run)) == 4
