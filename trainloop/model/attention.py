"""Training attention that needs no mask from transformers: sdpa, told what trainloop's rows are.

Given no attention mask, transformers builds one for every forward of an sdpa model, looking for
packed rows in the position ids: eager, that is a host read a forward (the step then waits for the
device); compiled, it cannot look, so it always builds a (batch, 1, seq, seq) mask, and sdpa cannot
take its flash kernel (GPT-2 124M compiled on one H200: 435,584 tokens/s with the mask, 504,300 with
sdpa's is_causal; BENCHMARKS.md). trainloop knows what its causal_lm rows are:
- a stream of tokens (data.packing=stream) is one unpadded sequence a row: "sdpa_causal", sdpa's
  is_causal with no mask;
- packed documents (data.packing=documents) restart their position ids at each document:
  "sdpa_documents", sdpa with the block-causal mask the caller builds on the device from the
  position ids once per forward (`with_document_mask`; a document starts where a position is not
  the previous one plus one, as transformers reads them), no host read. A batch whose every row is
  one document carries no position ids (trainloop.data.loaders.collate decides on the CPU), and
  sdpa runs is_causal, as transformers' eager sdpa does after its host read.
Both are registered as attention functions only, so transformers builds no mask for them at all.
Generation needs sdpa's own masks (left padding, a cache): `generating` hands the model back to
sdpa for its length. model.attn_implementation=eager or flash_attention_2, padded rows
(data.packing=none, which carry their attention mask), the objectives that do not train on token
blocks (pairs, prompts) and models with a sliding window keep transformers' own masks.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

log = logging.getLogger("trainloop")

SDPA_CAUSAL, SDPA_DOCUMENTS = "sdpa_causal", "sdpa_documents"
FOR_PACKING = {"stream": SDPA_CAUSAL, "documents": SDPA_DOCUMENTS}


def block_causal(position_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) bool, True where a query may attend: an earlier or the same position of
    its own document."""
    first = position_ids[:, :1] - 1
    document = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    same = document[:, :, None] == document[:, None, :]
    seq = position_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal)[:, None]


def padded_causal(attention_mask: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) bool: causal, over the keys a padded row's `attention_mask` keeps; a
    padding query with no key to attend (left padding) attends itself, never read, so sdpa gives
    no NaN."""
    seq = attention_mask.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device).tril()
    mask = causal & attention_mask.bool()[:, None, :]
    return (mask | torch.eye(seq, dtype=torch.bool, device=mask.device))[:, None]


def _sdpa(module, query, key, value, attention_mask, document_mask=None, context_parallel=None, **kwargs):
    """sdpa over whole rows: with the documents' (or padded rows') mask where the caller gives one,
    else is_causal. transformers built no mask (`attention_mask` is None): a cached step is
    generation, whose rows may be padded, and is refused. `context_parallel`: the group a forward's
    inputs were split over, handed in with them (trainloop.parallel.context.ContextParallel.local): the
    rows are this rank's slices, and attention runs on the whole sequence over a share of the heads."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] != key.shape[2]:
        raise RuntimeError(f"attention {module.config._attn_implementation} attends whole rows in training; "
                           "generation runs under trainloop.model.attention.generating, with sdpa's own masks")
    if context_parallel is not None:
        return context_parallel.attend(sdpa_attention_forward, module, query, key, value, document_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, document_mask, **kwargs)


def with_document_mask(model, inputs: dict) -> dict:
    """`inputs` with the mask `model` attends by, where it attends through one of these functions
    (transformers builds it none), built once for every layer (the model hands its keyword arguments
    to each layer's attention): padded rows' (an `attention_mask`, which goes), or, under
    sdpa_documents, the documents' block-causal mask from the position ids. A batch carries position
    ids only where a row restarts them (trainloop.data.loaders.collate); without them every row is
    one sequence, and sdpa runs is_causal."""
    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
    name = getattr(config, "_attn_implementation", None)
    if name not in (SDPA_CAUSAL, SDPA_DOCUMENTS) or "document_mask" in inputs:
        return inputs
    if inputs.get("attention_mask") is not None:
        rest = {key: value for key, value in inputs.items() if key != "attention_mask"}
        return {**rest, "document_mask": padded_causal(inputs["attention_mask"])}
    if name != SDPA_DOCUMENTS or "position_ids" not in inputs:
        return inputs
    return {**inputs, "document_mask": block_causal(inputs["position_ids"])}


def register() -> None:
    """Makes both names attention implementations transformers models take (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(SDPA_CAUSAL, _sdpa)  # with_document_mask gives this one no mask
    AttentionInterface.register(SDPA_DOCUMENTS, _sdpa)


def training_attention(cfg, model_config, blocks: bool, needed: bool = False) -> str | None:
    """The attention a run's training forwards take instead of transformers' sdpa, or None. `blocks`: the
    objective trains on the data's token blocks (trainloop.objectives.items(row) is None: causal_lm, and
    distill, whose teacher attends as its student), whose packing says where documents end; other rows
    come whole, padded, with their attention mask. `needed`: a layout needs one for every objective
    (trainloop.parallel.own_attention: context parallelism swaps sequence for heads around attention, the
    pipeline's stages hand the blocks its mask; their checks refuse what cannot: another implementation, a
    sliding window)."""
    if needed:
        return FOR_PACKING.get(cfg.data.packing, SDPA_CAUSAL) if blocks else SDPA_CAUSAL
    if not blocks or cfg.model.attn_implementation != "sdpa":
        return None
    if getattr(model_config, "sliding_window", None):  # its mask is not causal alone
        return None
    return FOR_PACKING.get(cfg.data.packing)


def use(model, name: str, why: str) -> None:
    """The model attends through `name` from its next forward, `why` (the key that chose it: its
    exported config.json names no implementation, transformers loads it with its default, sdpa)."""
    register()
    model.set_attn_implementation(name)
    how = ("no mask but padded rows'" if name == SDPA_CAUSAL
           else "the documents' block-causal mask built from the position ids")
    log.info("attention: sdpa with %s, none from transformers (%s)", how, why)


@contextmanager
def generating(module):
    """sdpa's own attention and masks for the length of a generation (left padding, a cache)."""
    name = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if name not in (SDPA_CAUSAL, SDPA_DOCUMENTS):
        yield
        return
    module.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        module.set_attn_implementation(name)
