"""The loss of an optimizer step is its summed token loss over every micro-batch and rank divided
by the step's target tokens (acceptance 4): with rows of different lengths and train_on=assistant,
micro-batches hold different numbers of targets, yet accumulation 4 x batch 1 equals batch 4, and
2 processes x batch 2 equal 1 x batch 4, in losses and weights (fp32, no dropout).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import SMALL, conversation, read_metrics, train, warm, write_rows

CHAT = ["data=chat", "data.packing=none", "data.seq_len=256", "trainer.max_steps=3",
        "trainer.eval_every=3", "trainer.eval_batches=null", "data.validation_fraction=0.08"]
# 4 validation blocks (tests/test_evaluation.py holds uneven splits; a 5th block here would come out
# of the training rows and move AdamW's near-zero gradients past the bound below)
# SGD, whose weights measure the summed gradients themselves, and AdamW, the default, which
# divides each gradient by its own size and so magnifies rounding in a near-zero one (6e-8 and
# 2.5e-7 seen after 3 steps, against the 1e-6 bound).
OPTIMIZERS = {"sgd": ["optimizer=sgd", "optimizer.lr=0.3"], "adamw": ["optimizer=adamw"]}


@pytest.fixture
def uneven_chat(tmp_path) -> Path:
    """Conversations whose assistant replies range from a few to hundreds of tokens."""
    rows = [{"messages": conversation(i)[:-2] + [{"role": "user", "content": "More?"},
                                               {"role": "assistant", "content": "Yes. " * (1 + 7 * (i % 6))}]}
            for i in range(48)]
    return write_rows(tmp_path / "chat.jsonl", rows)


def losses(run_dir: Path) -> list[tuple[str, int, float]]:
    return [(key, r["step"], r[key]) for r in read_metrics(run_dir) for key in ("loss", "eval_loss") if key in r]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "final" / "model.safetensors")


def assert_same_run(got: Path, want: Path) -> None:
    a, b = losses(got), losses(want)
    assert [(k, s) for k, s, _ in a] == [(k, s) for k, s, _ in b] and len(a) >= 4
    for (key, step, x), (_, _, y) in zip(a, b):
        assert x == pytest.approx(y, rel=1e-6, abs=1e-6), (key, step, a, b)
    wa, wb = weights(got), weights(want)
    assert wa.keys() == wb.keys()
    worst = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert worst < 1e-6, worst


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_uneven_targets_give_the_same_step_with_accumulation_and_on_two_processes(tmp_path, uneven_chat, optimizer):
    data = [f"data.path={uneven_chat}", *CHAT, *OPTIMIZERS[optimizer]]
    whole = train(tmp_path / "batch4", *data, "data.batch_size=4")
    accumulated = train(tmp_path / "accum4", *data, "data.batch_size=1", "trainer.gradient_accumulation_steps=4")
    assert_same_run(accumulated, whole)
    run_dir = tmp_path / "two"
    warm(2, [*SMALL, *data, "data.batch_size=2", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert {r["world_size"] for r in read_metrics(run_dir)} == {2}
    assert_same_run(run_dir, whole)


def test_the_logged_loss_is_the_mean_over_the_steps_target_tokens(tmp_path, uneven_chat):
    """One step of batch 4 by hand, on data of exactly 4 training blocks (any order): summed token
    losses / their target tokens, which differs from the mean of per-block means here."""
    from trainloop.config.compose import compose_config
    from trainloop.data.loaders import build_datasets, byte_level_tokenizer
    from trainloop.model.builder import build_model, build_model_config, special_token_ids

    rows = [json.loads(line) for line in uneven_chat.read_text().splitlines()][:5]
    five = write_rows(tmp_path / "five.jsonl", rows)
    data = [f"data.path={five}", *CHAT, "data.validation_fraction=0.2", "trainer.max_steps=1",
            "trainer.eval_every=1", "data.batch_size=4"]
    run_dir = train(tmp_path / "run", *data)
    cfg = compose_config([*SMALL, *data], check=False)
    tokenizer = byte_level_tokenizer()
    train_set, _ = build_datasets(cfg.data, tokenizer, cfg.trainer.seed)
    assert len(train_set) == 4
    torch.manual_seed(cfg.trainer.seed)
    model = build_model(cfg.model, build_model_config(cfg.model, len(tokenizer), special_token_ids(tokenizer)))
    summed, count, block_means = 0.0, 0, []
    with torch.no_grad():
        for i in range(4):
            block = train_set[i]
            logits = model(input_ids=block["input_ids"][None], attention_mask=block["attention_mask"][None]).logits[0]
            keep = block["labels"][1:] != -100
            token_losses = torch.nn.functional.cross_entropy(logits[:-1][keep], block["labels"][1:][keep],
                                                             reduction="none")
            summed += token_losses.sum().item()
            count += int(keep.sum())
            block_means.append(token_losses.mean().item())
    logged = next(r["loss"] for r in read_metrics(run_dir) if "loss" in r)
    assert logged == pytest.approx(summed / count, rel=1e-5)
    assert abs(sum(block_means) / 4 - summed / count) > 1e-3  # the two means really differ here
