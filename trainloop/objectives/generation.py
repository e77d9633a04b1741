"""What writes sampled completions (GRPO's, and objective=distill's on-policy ones): `sampling`, the
model made ready to sample from, and the engines objective.generation chooses: `generate`, Hugging Face's
padded batch with a dynamic cache, or `continuous`, transformers' continuous batching (the engine
behind `generate_batch`): unpadded requests in a paged KV cache, scheduled token by token, so a row
that has finished leaves the batch instead of being padded along.

Beside them, what sampling rows share (grpo's and distill's): `sampling_seed` (a micro-batch's generator
seed, from where it is in the run), `generation_config`, `left_padded` prompts and the `completion_mask`.

Both engines return what `generate` returns: the left-padded prompts, then each row's completion padded on
the right with the pad token after its end-of-text, up to the longest row's (at most max_new_tokens).

Continuous batching, as this module runs it:
- uses the model's own attention (eager runs as transformers' paged eager for the call, then is put
  back; sdpa and flash_attention_2 are used as they are): greedy completions equal `generate`'s
  wherever the two kernels' sums do not tip an argmax (tests/test_generation.py checks token for token);
- samples with the same logits processors as `generate` (the effective settings: the caller's, the
  model's generation_config.json, then transformers' defaults), from a seed drawn from torch's
  generator: every request is queued before the loop starts and the cache is sized to hold all of
  them, so the schedule, and the draws, repeat; the draws are not `generate`'s (other rows, other order);
- keeps its cache in the weights' dtype, so it refuses autocast over fp32 weights (precision=bf16,
  fp16 or fp8 on one process or DDP): precision=fp32 (or weights in the compute dtype) only;
- runs each process on its own: no rank waits for another, so it cannot serve sharded weights that
  every forward gathers (FSDP2, DeepSpeed ZeRO-3, tensor parallelism: synced_gpus=True is refused).
"""

from __future__ import annotations

import copy
import hashlib
import math
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

from trainloop.errors import ConfigError

if TYPE_CHECKING:
    import torch

ENGINES = ("generate", "continuous")
KEY = "objective.generation"
MAX_BATCH_TOKENS = 8192  # transformers' default: the most prompt tokens a prefill forward takes


def length_problems(cfg) -> list[str]:
    """A tiny model's context must hold the longest prompt (data.seq_len) and objective.max_new_tokens."""
    o, m = cfg.objective, cfg.model
    if m.name == "tiny" and cfg.data.seq_len + o.max_new_tokens > m.max_position_embeddings:
        return [f"data.seq_len={cfg.data.seq_len} (the longest prompt) + objective.max_new_tokens={o.max_new_tokens} "
                f"is longer than model.max_position_embeddings={m.max_position_embeddings}; lower one of them"]
    return []


@contextmanager
def sampling(strategy, model, seed: int):
    """The model to sample from for the length of the block (the layout's: Strategy.generator): eval mode, no
    gradients, eager under a compile, and torch's generator seeded with `seed` inside a fork, so training's
    own random stream goes on as if nothing had been drawn. Training mode comes back after."""
    import torch

    eager = torch.compiler.set_stance("force_eager") if hasattr(torch.compiler, "set_stance") else nullcontext()
    devices = [strategy.device.index or 0] if strategy.device.type == "cuda" else []
    with strategy.generator(model) as module:
        module.eval()
        try:
            with torch.no_grad(), eager, torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                yield module
        finally:
            module.train()


def complete(module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, generation_config, engine: str,
             synced_gpus: bool, keys: torch.Tensor | None = None) -> torch.Tensor:
    """`module.generate(input_ids=prompt_ids, attention_mask=prompt_mask, ...)`'s output, [n, prompt
    length + the longest completion], written by `engine`. `module`: the unwrapped model (a peft
    model too); the caller sets eval mode, no_grad and the random seed as for `generate`. With `keys`
    (row_keys, one per row), engine=generate samples each row from its own key (RowDraws): the same
    tokens in any batch; continuous batching draws from the seed alone, so its rows depend on the batch."""
    if engine == "generate":
        draws = None
        if keys is not None and generation_config.do_sample:
            from transformers import LogitsProcessorList

            draws = LogitsProcessorList([RowDraws(module, generation_config, keys, prompt_ids.shape[1])])
        return module.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=generation_config,
                               synced_gpus=synced_gpus, logits_processor=draws)
    if engine != "continuous":
        raise ConfigError(f"{KEY}={engine!r} is not one of: {', '.join(ENGINES)}")
    if synced_gpus:
        raise ConfigError(f"{KEY}=continuous runs each process's requests on their own schedule and cannot keep the "
                          "processes in step, which sharded weights gathered in every forward need (FSDP2, DeepSpeed "
                          f"ZeRO-3, tensor parallelism): use {KEY}=generate")
    model = module.get_base_model() if hasattr(module, "get_base_model") else module  # peft: the LoRA-injected model
    settings = continuous_settings(model, generation_config)
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
    completions = run_continuous(model, prompts, settings)
    pad = settings.pad_token_id
    if pad is None:  # as generate: the (first) end-of-text token pads
        eos = settings.eos_token_id
        pad = eos[0] if isinstance(eos, list) else eos
    return padded(prompt_ids, completions, pad)


def continuous_settings(model, generation_config):
    """The settings `generate` would sample with (the caller's, the model's own, transformers'
    defaults), refused where continuous batching would not apply them the same way."""
    if not hasattr(model, "generate_batch"):
        raise ConfigError(f"{KEY}=continuous needs a transformers model with continuous batching (generate_batch); "
                          f"{type(model).__name__} has none: use {KEY}=generate")
    settings = model._prepare_generation_config(copy.deepcopy(generation_config))[0]
    refused = []
    if (settings.num_beams or 1) != 1:
        refused.append(f"num_beams={settings.num_beams}")
    if (settings.num_return_sequences or 1) != 1:
        refused.append(f"num_return_sequences={settings.num_return_sequences}")
    if settings.max_new_tokens is None:
        refused.append("max_new_tokens unset (continuous batching stops only at it or at end-of-text)")
    for key in ("stop_strings", "max_time"):
        if getattr(settings, key, None) is not None:
            refused.append(f"{key}={getattr(settings, key)!r}")
    # the processors continuous batching drops (or keeps untested) would sample from another distribution
    refused += [type(p).__name__ for p in model._get_logits_processor(settings)
                if getattr(p, "supports_continuous_batching", None) is not True]
    if refused:
        raise ConfigError(f"{KEY}=continuous cannot apply these generation settings as generate does: "
                          f"{', '.join(refused)}; use {KEY}=generate")
    return settings


def run_continuous(model, prompts: list[list[int]], settings) -> list[list[int]]:
    """Each prompt's generated tokens (with its end-of-text, if it wrote one), in order."""
    import torch
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    longest = max(len(p) for p in prompts) + settings.max_new_tokens
    page = ContinuousBatchingConfig.page_size
    prompt_tokens = sum(len(p) for p in prompts)
    # greedy draws nothing from the caller's generator, as generate; sampling draws its seed from it
    seed = int(torch.randint(0, 2**31 - 1, ()).item()) if settings.do_sample else 0
    # room for every request at once: none waits or is offloaded, so the schedule (and the draws) repeat
    blocks = sum(math.ceil((len(p) + settings.max_new_tokens) / page) for p in prompts)
    cb_config = ContinuousBatchingConfig(
        page_size=page, num_blocks=blocks, max_batch_tokens=max(len(prompts), min(prompt_tokens, MAX_BATCH_TOKENS)),
        safety_margin=0.0, auto_switch_to_flash=False, seed=seed,  # the model's own attention: generate's numbers
        use_cuda_graph=False)  # a manager lives for one call: graphs captured for it would not be replayed
    hints = WorkloadHints(max_prompt_length=longest - settings.max_new_tokens,
                          max_generated_length=settings.max_new_tokens, num_requests=len(prompts))
    attention, training = model.config._attn_implementation, model.training
    router_logits = getattr(model.config, "output_router_logits", False)
    if router_logits:  # an MoE's load-balancing loss reads a padded mask, which a paged batch has not
        model.config.output_router_logits = False
    devices = [model.device.index or 0] if model.device.type == "cuda" else []
    # the loop seeds torch's generators with `seed`: the caller's stream goes on as if it had not run
    with torch.random.fork_rng(devices=devices):
        manager = model.init_continuous_batching(generation_config=settings, continuous_batching_config=cb_config,
                                                 workload_hints=hints)
        try:
            manager.warmup()  # builds the cache (and seeds) here, before any request
            ids = manager.add_requests(inputs=prompts, max_new_tokens=settings.max_new_tokens)
            manager.start()  # after the requests: the first batch holds them all, every time
            results = {}
            while len(results) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    break
        finally:
            manager.stop(block=True)  # puts a switched attention back, once started
            manager.destroy()
            if model.config._attn_implementation != attention:
                model.set_attn_implementation(attention)
            if router_logits:
                model.config.output_router_logits = True
            model.train(training)
    failed = [f"{i}: {results[i].error}" for i in ids if i in results and results[i].error is not None]
    missing = [i for i in ids if i not in results]
    if any("expected to have the same dtype" in f for f in failed):
        raise ConfigError(f"{KEY}=continuous keeps its paged cache in the weights' dtype ({model.dtype}), which "
                          "autocast's 16-bit keys and values do not match: use precision=fp32, or "
                          f"{KEY}=generate")
    if failed or missing:
        raise RuntimeError(f"{KEY}=continuous: {len(failed) + len(missing)} of {len(ids)} requests did not finish "
                           f"({'; '.join(failed[:3]) or 'the generation loop stopped'}); {KEY}=generate may work")
    return [results[i].generated_tokens for i in ids]


def padded(prompt_ids: torch.Tensor, completions: list[list[int]], pad: int) -> torch.Tensor:
    """generate's layout: the prompts as given, then the completions padded on the right to the longest."""
    import torch

    width = max(len(c) for c in completions)
    out = torch.full((prompt_ids.shape[0], prompt_ids.shape[1] + width), pad, dtype=prompt_ids.dtype,
                     device=prompt_ids.device)
    out[:, :prompt_ids.shape[1]] = prompt_ids
    for row, tokens in enumerate(completions):
        out[row, prompt_ids.shape[1]:prompt_ids.shape[1] + len(tokens)] = torch.tensor(tokens, dtype=prompt_ids.dtype)
    return out


def sampling_seed(seed: int, step: int, rank: int, micro: int) -> int:
    """The generator seed of one micro-batch's sampling: a function of where it is in the run."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{step}/{rank}/{micro}".encode()).digest()[:8], "big") >> 1


# --- each row's own draws ------------------------------------------------------------------------
# Sampling a batch with torch.multinomial draws every row from one generator, so a row's tokens depend
# on the rows beside it: a prompt sampled on one of two data-parallel ranks would get other completions
# than in one process's larger batch. Drawn per row instead (Gumbel-max: the argmax of the processed
# logits plus Gumbel noise is a draw from their softmax), from a counter-based hash of the row's key,
# the token's position and the vocabulary index, a row's completion is a function of the row alone.
# The hash is exact integer arithmetic in int64 on any device: no generator state, no host read.
MASK32 = 0xFFFFFFFF


def _times(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for x in [0, 2**32), in int64 without overflow: c split into 16-bit halves."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32's constants) of each element of x (int64, in [0, 2**32))."""
    x = x ^ (x >> 16)
    x = _times(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _times(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(*parts) -> torch.Tensor:
    """Each row's key: `parts` (ints, or [rows] integer tensors, which set the rows and the device)
    hashed in order into an int64 tensor of 32-bit values."""
    import torch

    like = next(p for p in parts if isinstance(p, torch.Tensor))
    key = torch.zeros(like.shape, dtype=torch.int64, device=like.device)
    for part in parts:
        if isinstance(part, int):  # its 64 bits folded into 32
            part = torch.tensor((part % 2**64 & MASK32) ^ (part % 2**64 >> 32), device=like.device)
        key = mix32(key ^ (part.to(torch.int64) & MASK32))
    return key


def content_keys(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's key from its tokens where `mask` is 1, counted from its first: the same for a row
    however it is padded (a hash of each (place, token) pair, summed)."""
    import torch

    place = (mask.cumsum(1) - 1).to(torch.int64)
    pairs = mix32(mix32(ids.to(torch.int64) & MASK32) ^ place) * mask.to(torch.int64)
    return mix32(pairs.sum(1) & MASK32)


def row_uniforms(keys: torch.Tensor, position: int, width: int) -> torch.Tensor:
    """[rows, width] float32 uniforms in (0, 1): a function of each row's key, `position` and the column."""
    import torch

    base = mix32(keys ^ (position & MASK32))
    bits = mix32(base[:, None] ^ torch.arange(width, device=keys.device))
    return ((bits >> 8).float() + 0.5) * 2.0**-24


class RowDraws:
    """A logits processor that makes `generate`'s sampling draw each row from its own stream (above):
    it applies the sampling warpers `generate` would (temperature, top-k, top-p, ...: the effective
    settings, the model's generation_config.json included), draws the row's token by Gumbel-max from
    its key, and returns the scores with every other token at -inf, so that the draw `generate` makes
    after it (the warpers again, then multinomial) can only return that token."""

    def __init__(self, module, settings, keys: torch.Tensor, prompt_width: int):
        model = module.get_base_model() if hasattr(module, "get_base_model") else module
        sampled = model._prepare_generation_config(copy.deepcopy(settings))[0]
        greedy = copy.deepcopy(sampled)
        greedy.do_sample = False
        every = model._get_logits_processor(sampled, input_ids_seq_length=prompt_width, device=keys.device)
        processors = model._get_logits_processor(greedy, input_ids_seq_length=prompt_width, device=keys.device)
        if [type(p) for p in every[:len(processors)]] != [type(p) for p in processors]:
            raise RuntimeError("transformers' sampling warpers no longer follow its other logits processors; "
                               "trainloop's per-row draws (objectives/generation.py) need updating")
        self.warpers, self.keys, self.start = every[len(processors):], keys, prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import torch

        for warper in self.warpers:
            scores = warper(input_ids, scores)
        noise = -torch.log(-torch.log(row_uniforms(self.keys, input_ids.shape[1] - self.start, scores.shape[-1])))
        choice = (scores.float() + noise).argmax(-1, keepdim=True)
        return torch.full_like(scores, -torch.inf).scatter_(1, choice, 0.0)


def generation_config(**settings):
    """A generation config of these settings alone (transformers' defaults for the rest)."""
    from transformers import GenerationConfig

    return GenerationConfig(**settings)


def left_padded(rows: list[list[int]], pad: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows padded on the left to the longest, and their attention mask, as `like`'s dtype and device."""
    import torch

    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=like.dtype, device=like.device)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = torch.tensor(row), 1
    return ids, mask


def completion_mask(completion_ids: torch.Tensor, eos: int) -> torch.Tensor:
    """1 on each completion's tokens up to and with its first EOS (TRL's), 0 after."""
    import torch

    is_eos = completion_ids == eos
    first = torch.full((is_eos.shape[0],), is_eos.shape[1], dtype=torch.long, device=completion_ids.device)
    found = is_eos.any(1)
    first[found] = is_eos.int().argmax(1)[found]
    return (torch.arange(is_eos.shape[1], device=completion_ids.device).expand_as(is_eos) <= first[:, None]).long()
