"""trainer.loss_chunk_tokens (issue 28, item 1): the loss taken N tokens at a time equals the loss
through the full logits, and so do its gradients, within 1e-6 in fp32 (relative: a tensor's
largest difference over its largest value): text and chat data (masked tokens), tied and untied
output layers, LoRA, GPT-2 and Mixtral (its router's penalty), the per-token log-probabilities DPO
scores with, evaluation, and FSDP2 on 2 processes. The output layer is left as it was, and what cannot work is refused by name.

Real parts only: the composed config, the run's data and model builders, FSDP2 on 2 warm ranks.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch

from helpers import OBJECTIVE_NEEDS, compose, conversation, read_metrics, train, warm, write_rows
from trainloop.config.compose import ConfigError, validate
from trainloop.objectives import build_objective

TOLERANCE = 1e-6
CHUNK = 24  # 4 rows x 63 targets: 11 chunks, the last one short


def loss_and_grads(objective, model, batch) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    summed = objective.batch_loss(model, batch).summed
    summed.backward()
    return summed.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def worst_difference(got: dict, want: dict) -> float:
    assert set(got) == set(want) and want
    return max(((got[k] - want[k]).abs().max() / want[k].abs().max().clamp(min=1e-30)).item() for k in want)


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> list[str]:
    path = write_rows(tmp_path_factory.mktemp("chat") / "chat.jsonl", [{"messages": conversation(i)} for i in range(80)])
    return ["data=chat", f"data.path={path}"]


@functools.cache
def batch_of(*data_overrides: str) -> tuple[dict, int]:
    """4 training blocks of the run's own data and the tokenizer's size, built once per process."""
    from trainloop.data.loaders import build_tokenizer
    from trainloop.data.mixture import build_training_data

    cfg = compose("+preset=smoke", *data_overrides)
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.model.name_or_path)
    train_set, _, _ = build_training_data(cfg.data, tokenizer, cfg.trainer.seed)
    items = [train_set[i] for i in range(4)]
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}, len(tokenizer)


def model_for(cfg, vocab: int, untied: bool = False):
    """The run's model (with its adapter), from a fixed seed; untied: its own output weight."""
    from trainloop.model.adapter import apply_adapter
    from trainloop.model.builder import build_model, build_model_config

    config = build_model_config(cfg.model, vocab)
    config.tie_word_embeddings = not untied
    torch.manual_seed(0)
    model = build_model(cfg.model, config)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) != untied
    return apply_adapter(cfg, model) if cfg.adapter.name != "none" else model


def full_and_chunked(*overrides: str, data: tuple[str, ...] = (), untied: bool = False):
    """(the objective with the full logits, the chunked one, the model, a batch of 4 blocks)."""
    cfg = compose("+preset=smoke", *data, *overrides)
    batch, vocab = batch_of(*data)
    model = model_for(cfg, vocab, untied)
    full = build_objective(cfg, "cpu")
    cfg.trainer.loss_chunk_tokens = CHUNK
    validate(cfg)
    return full, build_objective(cfg, "cpu"), model, batch


@pytest.mark.parametrize("case", ["tied", "untied", "chat", "lora", "gpt2", "mixtral"])
def test_the_chunked_loss_and_its_gradients_equal_the_full_logits(case, chat_data):
    overrides = {"lora": ["adapter=lora"], "gpt2": ["model.arch=gpt2"], "mixtral": ["model.arch=mixtral"]}
    full, chunked, model, batch = full_and_chunked(*overrides.get(case, []), data=chat_data if case == "chat" else (),
                                                   untied=case == "untied")
    if case == "chat":  # the prompts' tokens carry no loss: dropped before the output layer
        assert 0 < (batch["labels"][:, 1:] != -100).sum() < batch["labels"][:, 1:].numel()
    want_loss, want = loss_and_grads(full, model, batch)
    got_loss, got = loss_and_grads(chunked, model, batch)
    assert abs(got_loss - want_loss) / want_loss < TOLERANCE, (got_loss, want_loss)
    if case == "lora":  # only the adapters train; the output layer is frozen and gets no gradient
        assert all("lora_" in name for name in want)
    assert worst_difference(got, want) < TOLERANCE
    if case == "mixtral":  # the router's penalty comes from the same forward
        assert chunked.batch_loss(model, batch).penalty.item() == pytest.approx(
            full.batch_loss(model, batch).penalty.item(), rel=TOLERANCE)
    with torch.no_grad():  # evaluation: the same sum, no gradient prepared
        assert chunked.eval_sums(model, batch)[0].item() == pytest.approx(want_loss.item(), rel=TOLERANCE)


def test_per_token_log_probabilities_and_their_gradients_equal_the_full_logits(chat_data):
    """What DPO sums per completion: each token's log-probability, 0 where the label is masked."""
    from trainloop.objectives.chunked_loss import token_logps
    from trainloop.objectives.causal_lm import model_inputs

    _, _, model, batch = full_and_chunked(data=chat_data)
    weights = torch.randn(batch["labels"].shape[0], batch["labels"].shape[1] - 1, generator=torch.Generator().manual_seed(0))
    results = []
    for chunk in (0, CHUNK):
        model.zero_grad(set_to_none=True)
        logps = token_logps(model, model_inputs(batch), batch["labels"], chunk)
        (logps * weights).sum().backward()  # a different upstream gradient for every token
        results.append((logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (want, want_grads), (got, got_grads) = results
    assert (got[batch["labels"][:, 1:] == -100] == 0).all()
    assert (got - want).abs().max() / want.abs().max() < TOLERANCE
    assert worst_difference(got_grads, want_grads) < TOLERANCE


def test_the_output_layer_is_left_as_it_was():
    from trainloop.objectives.chunked_loss import computing_in_output_layer, output_layer

    full, chunked, model, batch = full_and_chunked()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    chunked.batch_loss(model, batch).summed.backward()
    head = output_layer(model)
    assert "forward" not in vars(head) and head(torch.zeros(1, 64)).shape == (1, model.config.vocab_size)
    with pytest.raises(RuntimeError, match="inside"), computing_in_output_layer(head, lambda *a: 0):
        raise RuntimeError("inside")
    assert "forward" not in vars(head)
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)


def test_a_run_trains_with_it_and_exports_the_plain_model(tmp_path, chat_data):
    """The loop's own steps with chunks (chat rows), and final/ a model whose forward gives logits again."""
    from transformers import AutoModelForCausalLM

    run_dir = train(tmp_path / "run", *chat_data, f"trainer.loss_chunk_tokens={CHUNK}")
    losses = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0]
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert type(final.lm_head) is torch.nn.Linear and "forward" not in vars(final.lm_head)
    assert final(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, final.config.vocab_size)


def test_what_cannot_work_is_refused_by_name():
    from trainloop.objectives import OBJECTIVES

    refused = [(["trainer.loss_chunk_tokens=-1"], "must be 0"),
               (["trainer.loss_chunk_tokens=16", "compile=inductor"], "compile.regional=true")]
    # an objective reads the key once it scores tokens through trainloop.objectives.chunked_loss (its row says so)
    refused += [(["trainer.loss_chunk_tokens=16", f"objective={name}", *OBJECTIVE_NEEDS[name]], "only for now")
                for name, row in OBJECTIVES.items() if not row.chunks_loss]
    for overrides, says in refused:
        with pytest.raises(ConfigError, match=says):
            validate(compose("+preset=smoke", *overrides))
    for name in (name for name, row in OBJECTIVES.items() if row.chunks_loss):
        validate(compose("+preset=smoke", "trainer.loss_chunk_tokens=16", f"objective={name}", *OBJECTIVE_NEEDS[name]))
    validate(compose("+preset=smoke", "trainer.loss_chunk_tokens=16", "compile=inductor", "compile.regional=true"))
    # an output layer LoRA adapts is no plain Linear: said at the first forward, naming the key
    cfg = compose("+preset=smoke", "adapter=lora", "adapter.target_modules=[q_proj,lm_head]",
                  "trainer.loss_chunk_tokens=16")
    batch, vocab = batch_of()
    with pytest.raises(ConfigError, match="trainer.loss_chunk_tokens"):
        build_objective(cfg, "cpu").batch_loss(model_for(cfg, vocab), batch)


@pytest.mark.slow
def test_fsdp2_on_two_processes_equals_the_full_logits(tmp_path, chat_data):
    """Each rank's loss and the gathered gradients (the output weight's too, a DTensor shard that
    the root's forward gathers) equal the full logits' on the same sharded model, on chat rows; so
    do DPO's per-token log-probabilities and their gradients (a backward that recomputes)."""

    out = tmp_path / "fsdp.json"
    warm(2, [str(out), *chat_data], cwd=Path(__file__).parent, timeout=300, script=Path(__file__))
    found = json.loads(out.read_text())
    assert found["world_size"] == 2 and found["sharded_head"]
    print(found)
    assert all(found[key] < TOLERANCE for key in ("loss", "grads", "logps", "logps_grads")), found


def fsdp_worker(out: str, *overrides: str) -> None:
    """On 2 ranks (helpers.warm): the run's own build with fsdp=full_shard; one batch through both losses."""
    from torch.distributed.tensor import DTensor

    from trainloop.parallel.accelerator import build_accelerator
    from trainloop.build import build
    from trainloop.objectives.chunked_loss import output_layer, token_logps
    from trainloop.objectives.causal_lm import model_inputs
    from trainloop.parallel import build_strategy
    from trainloop.run import end_distributed

    cfg = compose("+preset=[smoke,fsdp]", f"trainer.loss_chunk_tokens={CHUNK}", *overrides)
    validate(cfg)
    strategy = build_strategy(cfg, build_accelerator(cfg))
    built = build(cfg, strategy)
    model, chunked = built.model, built.objective
    batch = {k: v.to(strategy.device) for k, v in next(iter(built.train_loader)).items()}
    cfg.trainer.loss_chunk_tokens = 0
    results = []
    for objective in (build_objective(cfg, strategy.device), chunked):
        loss, grads = loss_and_grads(objective, model, batch)
        results.append((strategy.reduce_sum(loss), {k: v.full_tensor() for k, v in grads.items()}))
    (want_loss, want), (got_loss, got) = results
    weights = torch.randn(batch["labels"].shape[0], batch["labels"].shape[1] - 1,
                          generator=torch.Generator().manual_seed(strategy.dp_rank))
    logps = []  # DPO's per-token log-probabilities: their backward recomputes from the gathered weight
    for chunk in (0, CHUNK):
        model.zero_grad(set_to_none=True)
        per_token = token_logps(model, model_inputs(batch), batch["labels"], chunk)
        (per_token * weights).sum().backward()
        logps.append((per_token.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}))
    (want_logps, want_grads), (got_logps, got_grads) = logps
    found = {"world_size": strategy.world_size, "sharded_head": isinstance(output_layer(model).weight, DTensor),
             "loss": (abs(got_loss - want_loss) / want_loss).item(), "grads": worst_difference(got, want),
             "logps": ((got_logps - want_logps).abs().max() / want_logps.abs().max()).item(),
             "logps_grads": worst_difference(got_grads, want_grads)}
    if strategy.accelerator.is_main_process:
        Path(out).write_text(json.dumps(found))
    end_distributed(strategy)


if __name__ == "__main__":
    fsdp_worker(*sys.argv[1:])
