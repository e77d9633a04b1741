"""+preset=gpt2_124m (issue 35, item 2): GPT-2 small's shape, what nanoGPT's and llm.c's GPU figures
are quoted for, composes as documented, is planned, and trains on CPU."""

from __future__ import annotations

import pytest

from helpers import compose, read_metrics, train
from trainloop.config.compose import validate


def test_the_preset_is_gpt2_smalls_shape_with_the_speed_settings():
    cfg = compose("+preset=gpt2_124m")
    validate(cfg)
    m = cfg.model
    assert (m.arch, m.num_layers, m.hidden_size, m.num_heads, cfg.data.seq_len) == ("gpt2", 12, 768, 12, 1024)
    assert (cfg.precision.name, cfg.optimizer.name, cfg.optimizer.impl, cfg.compile.backend) == \
        ("bf16", "adamw", "fused", "inductor")
    assert cfg.trainer.auto_batch_size and cfg.data.batch_size == 16
    assert cfg.data.packing == "stream"  # a stream of tokens, as nanoGPT and llm.c read it: causal, no mask


@pytest.mark.parametrize("vocab", [257, 50257])  # trainloop's byte tokenizer; GPT-2's own
def test_the_vocabulary_is_padded_to_50304_and_the_model_holds_124m_parameters(vocab):
    import torch

    from trainloop.model.builder import build_model, build_model_config

    cfg = compose("+preset=gpt2_124m")
    config = build_model_config(cfg.model, vocab_size=vocab)
    assert config.vocab_size == 50304
    with torch.device("meta"):
        model = build_model(cfg.model, config)
    # GPT-2 small: 124,439,808 with 50,257 tokens (tied embeddings); 47 padded rows of 768 more
    assert sum(p.numel() for p in model.parameters()) == 124_439_808 + 47 * 768


def test_plan_prints_the_presets_memory(capsys):
    from trainloop.tools.plan import main as plan_main

    plan_main(["+preset=gpt2_124m"])
    out = capsys.readouterr().out
    assert "124.5M parameters" in out and "micro-batch 16 x 1024 tokens" in out
    assert "16384 tokens x 50,304" in out  # the logits of the padded vocabulary
    plan_main(["--no-presets", "--device", "cuda", "--gpu-memory", "16", "+preset=gpt2_124m"])  # too small a GPU
    out = capsys.readouterr().out
    assert "the config: does NOT fit" in out
    assert "trainer.auto_batch_size=true: the run tries micro-batch 16 (this plan) first and halves it" in out


@pytest.mark.slow
def test_the_preset_trains_on_cpu(tmp_path):
    """Its shape, bf16 and fused AdamW on this CPU; short sequences and no compile keep it to a minute: a
    CPU without bf16 instructions (AVX2 alone, as CI's) multiplies in bf16 about 24x slower than in fp32, and
    the batch search's 2 trial steps, 2 steps and an evaluation took 4 minutes at 64 tokens, 2 at 16 and
    about 1 at 8, the compute of 124M parameters a token (the full preset: `python -m trainloop
    +preset=gpt2_124m trainer.max_steps=5`, much longer)."""
    run = train(tmp_path / "run", "+preset=gpt2_124m", "trainer.max_steps=2", "trainer.log_every=1",
                "data.seq_len=8", "data.batch_size=1", "compile=none", "trainer.eval_batches=1",
                "checkpoint.save_final_model=false", "logging.trackers=[]", small=False)
    records = read_metrics(run)
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert any(r.get("event") == "auto_batch_size" for r in records)  # trainer.auto_batch_size settled it
