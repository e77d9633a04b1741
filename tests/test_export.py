"""The final model's special tokens: the tokenizer's own ids, on config.json and
generation_config.json alike, for every architecture and tokenizer option; README's snippet on it."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from helpers import REPO, compose, ids_tokenizer, pretrained_llama, train

FAST = ["trainer.max_steps=2"]


def assert_carries_tokenizer_ids(final: Path) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(final)
    wanted = {key: getattr(tokenizer, key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = json.loads((final / "config.json").read_text())
    for name in ("config.json", "generation_config.json"):
        written = json.loads((final / name).read_text())
        assert {key: written.get(key) for key in wanted} == wanted, name
        assert all(i is None or 0 <= i < config["vocab_size"] for i in wanted.values())
    return wanted


@pytest.mark.parametrize("options", [
    ["model.arch=llama", "data.tokenizer=TOKENIZER"],
    ["model.arch=gpt2"],
    ["model.arch=gpt2", "data.tokenizer=TOKENIZER"],
    ["model=hf", "model.name_or_path=MODEL"],
], ids=["llama-tokenizer-dir", "gpt2-bytes", "gpt2-tokenizer-dir", "hf-model-dir"])
def test_export_carries_the_tokenizers_special_token_ids(tmp_path, tiny_jsonl, options):
    tokenizer, model = ids_tokenizer(tmp_path / "tokenizer"), pretrained_llama(tmp_path / "model")
    options = [o.replace("TOKENIZER", str(tokenizer)).replace("MODEL", str(model)) for o in options]
    run_dir = train(tmp_path / "run", *FAST, "data=files", f"data.path={tiny_jsonl}", "data.text_field=content",
                    *options)
    wanted = assert_carries_tokenizer_ids(run_dir / "final")
    own = "data.tokenizer" in " ".join(options) or "model=hf" in options
    assert wanted == ({"bos_token_id": 256, "eos_token_id": 257, "pad_token_id": None} if own else
                      {"bos_token_id": 256, "eos_token_id": 256, "pad_token_id": 256})


def readme_snippet() -> str:
    """README's Python block that loads `final/` and generates."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.DOTALL)
    return next(b for b in blocks if "final" in b and "generate" in b)


def test_readme_snippet_generates_past_a_hash(tmp_path):
    """The default model (Llama, built-in bytes) trained on '#'s: README's snippet must go on
    generating them. Llama's default eos id, 2, is '#' in the byte tokenizer, whose end of text is 256."""
    corpus = tmp_path / "hashes.jsonl"
    corpus.write_text("".join(json.dumps({"text": "#" * 400}) + "\n" for _ in range(40)))
    run_dir = train(tmp_path / "run", "trainer.max_steps=12", "optimizer.lr=1e-2",
                    "data=files", f"data.path={corpus}")
    assert assert_carries_tokenizer_ids(run_dir / "final")["eos_token_id"] == 256

    code = readme_snippet()
    assert '"outputs/DATE/TIME/final"' in code
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code.replace("outputs/DATE/TIME/final", str(run_dir / "final")), {})  # noqa: S102 - the README's own code
    text = printed.getvalue()
    assert text.startswith("def #") and text.count("#") > 10, text


def test_export_fails_on_an_id_outside_the_vocabulary(tmp_path):
    from trainloop.data.loaders import byte_level_tokenizer
    from trainloop.export import check_token_ids

    tokenizer = byte_level_tokenizer()
    good = {"vocab_size": 320, "bos_token_id": 256, "eos_token_id": 256, "pad_token_id": 256}
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_text(json.dumps(good))
    check_token_ids(tmp_path, tokenizer)

    (tmp_path / "generation_config.json").write_text(json.dumps({**good, "eos_token_id": 50256}))
    with pytest.raises(RuntimeError, match=r"eos_token_id=50256 is outside the vocabulary of 320"):
        check_token_ids(tmp_path, tokenizer)
    (tmp_path / "generation_config.json").write_text(json.dumps({**good, "eos_token_id": 2}))
    with pytest.raises(RuntimeError, match=r"eos_token_id=2, but the tokenizer's is 256"):
        check_token_ids(tmp_path, tokenizer)


def test_model_config_refuses_token_ids_outside_its_vocabulary():
    from trainloop.config.compose import ConfigError
    from trainloop.model.builder import build_model_config

    cfg = compose("+preset=smoke").model
    assert build_model_config(cfg, 257, {"eos_token_id": 256}).eos_token_id == 256
    with pytest.raises(ConfigError, match="outside the model's vocabulary of 320"):
        build_model_config(cfg, 257, {"eos_token_id": 50256})


def test_a_bf16_checkpoint_trains_in_fp32(tmp_path):
    """Most hub checkpoints are saved in bf16; transformers 5 would keep that dtype. model=hf
    loads them in fp32 (the weights the optimizer updates), computing in the precision group's."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainloop.model.builder import build_model, build_model_config

    path = pretrained_llama(tmp_path / "fp32")
    AutoModelForCausalLM.from_pretrained(path).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16  # what the files hold
    cfg = compose("model=hf", f"model.name_or_path={tmp_path / 'bf16'}")
    model = build_model(cfg.model, build_model_config(cfg.model, vocab_size=320))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
