"""Model FLOPs per token (trainloop.model.flops) against torch's own flop counter, and tflops/mfu in metrics.jsonl."""

from __future__ import annotations

import pytest

from helpers import compose, read_metrics, train


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_formula_matches_the_flop_counter(arch):
    """Forward + backward of the built-in tiny model, counted by torch.utils.flop_counter, within
    10% of the PaLM formula; at seq_len 256 attention is over a fifth of the FLOPs, so leaving it
    out would miss. Eager attention: the counter does not see CPU sdpa's fused kernel."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from trainloop.model.flops import flops_per_token
    from trainloop.model.builder import build_model, build_model_config

    seq_len = 256
    cfg = compose("+preset=smoke", f"model.arch={arch}", f"data.seq_len={seq_len}",
                  "model.attn_implementation=eager").model
    config = build_model_config(cfg, 256)
    model = build_model(cfg, config)
    ids = torch.randint(0, 256, (2, seq_len))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    measured = counter.get_total_flops() / ids.numel()
    formula = flops_per_token(config, seq_len)
    assert formula == pytest.approx(measured, rel=0.10)
    without_attention = formula - 12 * config.num_hidden_layers * config.hidden_size * seq_len
    assert without_attention < 0.9 * measured  # the attention term matters at this seq_len


def test_moe_and_lora_count_what_they_compute():
    """A mixture counts its routed experts, not all of them; a frozen base costs 4x, not 6x."""
    from trainloop.model.flops import flops_per_token, matmul_params
    from trainloop.model.builder import build_model_config

    dense = build_model_config(compose("+preset=smoke").model, 256)
    moe_cfg = compose("+preset=smoke", "model.arch=mixtral").model
    moe = build_model_config(moe_cfg, 256)
    per_expert = 3 * moe.hidden_size * moe.intermediate_size * moe.num_hidden_layers
    router = moe.hidden_size * moe.num_local_experts * moe.num_hidden_layers
    assert moe.num_local_experts > moe.num_experts_per_tok
    assert matmul_params(moe) == matmul_params(dense) + (moe.num_experts_per_tok - 1) * per_expert + router
    full = flops_per_token(dense, 64)
    lora = flops_per_token(dense, 64, trained_matmul_params=1000)
    assert full - lora == 2 * matmul_params(dense) - 6 * 1000


def test_train_lines_carry_tflops_and_mfu(tmp_path):
    lines = [r for r in read_metrics(train(tmp_path / "peak", "logging.peak_tflops=1",
                                           "trainer.max_steps=4", "trainer.log_every=2")) if "loss" in r]
    assert len(lines) == 2
    assert all(r["tflops"] > 0 and r["mfu"] == pytest.approx(r["tflops"] / 1) for r in lines)
    lines = [r for r in read_metrics(train(tmp_path / "cpu", "trainer.max_steps=2",
                                           "trainer.log_every=2")) if "loss" in r]
    assert lines and all(r["tflops"] > 0 and r["mfu"] is None for r in lines)


def test_a_peak_that_is_not_positive_is_refused():
    from trainloop.config.compose import ConfigError, validate

    with pytest.raises(ConfigError, match=r"logging.peak_tflops=0.0 must be greater than 0, or null"):
        validate(compose("logging.peak_tflops=0"))
    validate(compose("logging.peak_tflops=312"))
