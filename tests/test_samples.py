"""eval.prompts: at every evaluation the model completes each prompt greedily, into metrics.jsonl.

The completions written at the last evaluation are checked against what `transformers` generates
from the exported final/ (the same weights) for the same prompt. The 2-process runs (DDP, ZeRO-3,
FSDP2, where every rank takes part in each forward) are test_moe's, which generate too.
"""

from __future__ import annotations


import pytest

from helpers import assert_samples_are_the_final_models, compose, read_metrics, sample_lines, train

PROMPTS = ["def ", "The "]
MAX_NEW_TOKENS = 8
SAMPLED = [f"eval.prompts=[{','.join(repr(p) for p in PROMPTS)}]", f"eval.max_new_tokens={MAX_NEW_TOKENS}"]


def test_samples_at_every_evaluation_are_final_models_and_leave_training_as_it_was(tmp_path):
    sampled = train(tmp_path / "sampled", "trainer.max_steps=6", *SAMPLED)
    assert len(sample_lines(sampled)) == 3  # steps 2, 4 and 6
    assert_samples_are_the_final_models(sampled, PROMPTS, MAX_NEW_TOKENS)
    # greedy decoding in eval mode draws no random numbers: the run trains as one without samples
    plain = train(tmp_path / "plain", "trainer.max_steps=6", "checkpoint.save_final_model=false")
    assert [(r["step"], r["loss"]) for r in read_metrics(sampled) if "loss" in r] == \
        [(r["step"], r["loss"]) for r in read_metrics(plain) if "loss" in r]


@pytest.mark.parametrize("overrides, message", [
    (["eval.prompts=['']"], r"eval.prompts\[0\]='' is no token at all"),
    (["eval.prompts=['def ']", "eval.max_new_tokens=2000"],
     r"eval.prompts\[0\] is 4 tokens and eval.max_new_tokens=2000: together longer than the model's context of 1024"),
])
def test_prompts_that_cannot_be_completed_are_refused(overrides, message):
    from trainloop.config.compose import ConfigError
    from trainloop.data.loaders import build_tokenizer
    from trainloop.observe.samples import Samples

    cfg = compose("+preset=smoke", *overrides)
    with pytest.raises(ConfigError, match=message):
        Samples.for_config(cfg, build_tokenizer(None, None), context=1024)


def test_max_new_tokens_without_prompts_is_refused_naming_eval_prompts():
    from trainloop.config.compose import ConfigError, check_command_line

    overrides = ["eval.max_new_tokens=8"]
    with pytest.raises(ConfigError, match=r"eval.max_new_tokens=8 has no effect unless eval.prompts=\[...\]"):
        check_command_line(compose(*overrides), overrides)
    overrides.append("eval.prompts=['def ']")
    check_command_line(compose(*overrides), overrides)
