"""objective.generation (issue 38, item 5): transformers' continuous batching writes the greedy
completions `generate` writes, token for token and in the same padded layout; its sampling repeats
from a seed; and the model trains afterwards as it did before.

Real parts only: the composed config, the built-in byte-level tokenizer, a tiny transformers Llama
whose weights are drawn wide (std 0.2) so that its greedy completions wander over the vocabulary and
some of them write end-of-text early, rather than repeat one token as a near-identity model does.
"""

from __future__ import annotations

import pytest
import torch
from helpers import compose

from trainloop.errors import ConfigError
from trainloop.objectives.generation import complete

WORDS = "apple river stone cloud green quick seven maple lantern copper ocean violet amber birch coral delta".split()
NEW = 32


def tiny_model(*overrides: str):
    from trainloop.data.loaders import byte_level_tokenizer
    from trainloop.model.builder import build_model, build_model_config, special_token_ids

    cfg = compose("+preset=smoke", *overrides)
    tokenizer = byte_level_tokenizer()
    torch.manual_seed(1)
    model = build_model(cfg.model, build_model_config(cfg.model, len(tokenizer), special_token_ids(tokenizer)))
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 2:
                weight.normal_(0, 0.2)
    return model, tokenizer


@pytest.fixture(scope="module")
def llama():
    return tiny_model()


def left_padded(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """16 prompts of 8 to 24 tokens, padded on the left with the tokenizer's pad, as data=prompts pads them."""
    ids = [tokenizer(f"Write {w}:" * (1 + i % 3))["input_ids"] for i, w in enumerate(WORDS)]
    width = max(len(x) for x in ids)
    prompt_ids = torch.full((len(ids), width), tokenizer.pad_token_id)
    prompt_mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, x in enumerate(ids):
        prompt_ids[row, width - len(x):], prompt_mask[row, width - len(x):] = torch.tensor(x), 1
    return prompt_ids, prompt_mask


def settings(**sampling):
    from trainloop.objectives.generation import generation_config

    # pad 0 is not end-of-text (256): a finished row's padding shows as itself; use_cache: the tiny
    # model's config says no cache (for training), which would make generate recompute every prefix
    return generation_config(max_new_tokens=NEW, pad_token_id=0, eos_token_id=256, use_cache=True, **sampling)


def test_continuous_writes_generates_greedy_completions(llama):
    model, tokenizer = llama
    prompt_ids, prompt_mask = left_padded(tokenizer)
    greedy = settings(do_sample=False)
    model.eval()
    with torch.no_grad():
        expected = complete(model, prompt_ids, prompt_mask, greedy, "generate", synced_gpus=False)
        state = torch.get_rng_state()
        got = complete(model, prompt_ids, prompt_mask, greedy, "continuous", synced_gpus=False)
    assert torch.equal(torch.get_rng_state(), state)  # greedy draws nothing from the caller's generator
    completions = expected[:, prompt_ids.shape[1]:]
    stopped = (completions == 256).any(1)
    assert 1 <= stopped.sum() < len(stopped) and completions.shape[1] == NEW  # some end early, some run to the cap
    assert (completions[stopped][:, -1] == 0).all()  # and generate pads them
    assert all(len(set(row.tolist())) > 8 for row in completions[~stopped])  # the completions wander
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert torch.equal(got, expected)


def test_continuous_sampling_repeats_from_the_seed(llama):
    model, tokenizer = llama
    prompt_ids, prompt_mask = left_padded(tokenizer)
    sampling = settings(do_sample=True, temperature=0.9, top_p=0.95, top_k=0)

    def sample(seed: int) -> torch.Tensor:
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(seed)
            return complete(model, prompt_ids, prompt_mask, sampling, "continuous", synced_gpus=False)

    first, again, other = sample(7), sample(7), sample(8)
    assert torch.equal(first, again)
    assert torch.equal(first[:, :prompt_ids.shape[1]], prompt_ids)
    width = min(first.shape[1], other.shape[1])
    assert not torch.equal(first[:, :width], other[:, :width])


def test_an_eager_model_trains_as_before_after_continuous():
    """Eager attention runs as paged eager for the call; the model's attention, mode and gradients come back."""
    model, tokenizer = tiny_model("model.attn_implementation=eager")
    prompt_ids, prompt_mask = left_padded(tokenizer)
    batch = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(0))

    def loss_and_grads():
        model.zero_grad()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    model.train()
    loss, grads = loss_and_grads()
    model.eval()
    with torch.no_grad():
        expected = complete(model, prompt_ids, prompt_mask, settings(do_sample=False), "generate", synced_gpus=False)
    model.train()
    with torch.no_grad():
        got = complete(model, prompt_ids, prompt_mask, settings(do_sample=False), "continuous", synced_gpus=False)
    assert torch.equal(got, expected)
    assert model.config._attn_implementation == "eager" and model.training
    after, grads_after = loss_and_grads()
    assert torch.equal(after, loss) and all(torch.equal(a, b) for a, b in zip(grads_after, grads))


@pytest.mark.parametrize("engine, synced, sampling, says", [
    ("continuous", True, {}, r"objective.generation=continuous .* sharded weights .*use objective.generation=generate"),
    ("continuous", False, {"repetition_penalty": 1.2}, r"RepetitionPenaltyLogitsProcessor; use objective.generation"),
    ("vllm", False, {}, r"objective.generation='vllm' is not one of: generate, continuous"),
])
def test_what_continuous_refuses(llama, engine, synced, sampling, says):
    model, tokenizer = llama
    prompt_ids, prompt_mask = left_padded(tokenizer)
    with pytest.raises(ConfigError, match=says):
        complete(model, prompt_ids, prompt_mask, settings(do_sample=False, **sampling), engine, synced_gpus=synced)


def test_continuous_refuses_autocast_over_fp32_weights(llama):
    """precision=bf16 on one process or DDP: accelerate runs the fp32 model's forward under autocast,
    whose bf16 keys and values the paged cache (in the weights' fp32) cannot take."""
    model, tokenizer = llama
    model.eval()  # as GRPO generates (the module fixture's mode depends on which test ran before on this worker)
    prompt_ids, prompt_mask = left_padded(tokenizer)
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)  # as accelerate wraps it
    try:
        with pytest.raises(ConfigError, match=r"paged cache in the weights' dtype .* use precision=fp32"):
            complete(model, prompt_ids, prompt_mask, settings(do_sample=False), "continuous", synced_gpus=False)
    finally:
        del model.forward
    assert model.config._attn_implementation == "sdpa" and not model.training


def test_each_row_draws_the_same_tokens_in_any_batch(llama):
    """With keys (GRPO's and on-policy distill's sampling), a row's completion is a function of its prompt
    and key alone: the 16 rows sampled together, or as two batches of 8 in another order (another padding
    width, other neighbours), write the same tokens; other keys write other ones."""
    from trainloop.objectives.generation import row_keys

    model, tokenizer = llama
    prompt_ids, prompt_mask = left_padded(tokenizer)
    sampling = settings(do_sample=True, temperature=0.9, top_p=0.95, top_k=0)
    keys = row_keys(5, 3, torch.arange(len(prompt_ids)))

    def sample(rows, keys, seed=0):
        keep = prompt_mask[rows].any(0)  # trimmed to the rows' own longest, as grpo trims a micro-batch
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(seed)  # the micro-batch generator a rank seeds: the rows must not depend on it
            out = complete(model, prompt_ids[rows][:, keep], prompt_mask[rows][:, keep], sampling, "generate",
                           synced_gpus=False, keys=keys[rows])
        return [row[:(row == 256).int().argmax() + 1 if (row == 256).any() else NEW].tolist()
                for row in out[:, int(keep.sum()):]]

    model.eval()
    together = sample(torch.arange(16), keys)
    odd, even = torch.arange(15, 0, -2), torch.arange(0, 16, 2)
    apart = dict(zip([*odd.tolist(), *even.tolist()], sample(odd, keys, seed=1) + sample(even, keys, seed=2)))
    assert [apart[i] for i in range(16)] == together
    other = sample(torch.arange(16), row_keys(5, 4, torch.arange(len(prompt_ids))))
    assert sum(a != b for a, b in zip(other, together)) >= 12


def test_row_draws_sample_the_softmax_and_keys_ignore_padding():
    """Gumbel-max over the hashed uniforms draws each token at its softmax probability (40,000 keys, 4
    tokens: within 0.01); the hash is exact integer arithmetic (lowbias32, as Python computes it); a row's
    content key is the same however far it is padded on the left, and another token changes it."""
    from trainloop.objectives.generation import content_keys, mix32, row_keys, row_uniforms

    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    uniforms = row_uniforms(row_keys(1, torch.arange(40_000)), 0, 4)
    assert 0 < uniforms.min() and uniforms.max() < 1
    drawn = (logits - torch.log(-torch.log(uniforms))).argmax(-1)
    assert torch.allclose(torch.bincount(drawn, minlength=4) / 40_000, torch.softmax(logits, 0), atol=0.01)

    def lowbias32(x: int) -> int:
        x ^= x >> 16
        x = x * 0x7FEB352D & 0xFFFFFFFF
        x ^= x >> 15
        x = x * 0x846CA68B & 0xFFFFFFFF
        return x ^ x >> 16

    values = [0, 1, 2**31, 2**32 - 1, 123456789]
    assert mix32(torch.tensor(values)).tolist() == [lowbias32(v) for v in values]
    ids = torch.tensor([[0, 0, 5, 6, 7], [0, 5, 6, 7, 8], [5, 6, 7, 9, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    narrow = content_keys(torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long))
    keys = content_keys(ids, mask)
    assert keys[0] == narrow[0] and len(set(keys.tolist())) == 3
