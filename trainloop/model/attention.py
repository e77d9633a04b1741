"""Training attention that needs no mask from transformers: sdpa, told what trainloop's rows are.

Given no attention mask, transformers builds one for every forward of an sdpa model, looking for
packed rows in the position ids: eager, that is a host read a forward (the step then waits for the
device); compiled, it cannot look, so it always builds a (batch, 1, seq, seq) mask, and sdpa cannot
take its flash kernel (GPT-2 124M compiled on one H200: 435,584 tokens/s with the mask, 504,300 with
sdpa's is_causal; BENCHMARKS.md). trainloop knows what its causal_lm rows are:
- a stream of tokens (data.packing=stream) is one unpadded sequence a row: "sdpa_causal", sdpa's
  is_causal with no mask;
- packed documents (data.packing=documents) restart their position ids at each document:
  "sdpa_documents", sdpa's causal kernel once a document (`document_attention`), with no
  (seq x seq) mask: memory linear in the sequence (a dense block-causal mask was 2 GiB a row at
  16,384 tokens as sdpa's float mask, and ruled out the flash kernels). Where documents end comes
  from the packer: the loader makes each token's document number on the host (`documents_of`, a
  document starts where a position is not the previous one plus one, as transformers reads them),
  and the loop leaves it there (ON_HOST), so attention reads it with no wait for the device. A
  batch whose every row is one document carries neither (trainloop.data.loaders.collate decides
  on the CPU), and sdpa runs is_causal, as transformers' eager sdpa does after its host read.
Both are registered as attention functions only, so transformers builds no mask for them at all.
Generation needs sdpa's own masks (left padding, a cache): `generating` hands the model back to
sdpa for its length. model.attn_implementation=eager or flash_attention_2, padded rows
(data.packing=none, which carry their attention mask), the objectives that do not train on token
blocks (pairs, prompts) and models with a sliding window keep transformers' own masks.
"""

from __future__ import annotations

import functools
import inspect
import logging
from contextlib import contextmanager

import torch
import torch.nn.functional as F

try:  # one flash kernel over documents laid end to end (CUDA); its causal window came in torch 2.11
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn

    if "window_size" not in inspect.signature(_varlen_attn).parameters:
        _varlen_attn = None
except ImportError:
    _varlen_attn = None

log = logging.getLogger("trainloop")

SDPA_CAUSAL, SDPA_DOCUMENTS = "sdpa_causal", "sdpa_documents"
ON_HOST = ("documents",)  # the batch keys that stay in host memory (the loop sends the rest to the device)
FOR_PACKING = {"stream": SDPA_CAUSAL, "documents": SDPA_DOCUMENTS}


def documents_of(position_ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq) int32 on the host: each token's document, counted from 0 in its row. A document starts
    where a position is not the previous one plus one, as transformers reads them; a row's first token always
    starts one. The loader makes them from its host copy of the positions (trainloop.data.sets): made from
    positions on a GPU, they would be a host read."""
    return _numbered(torch.diff(position_ids.cpu(), dim=-1) != 1)


def documents_of_mask(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """Padded rows' documents, as documents_of numbers them: each run of kept tokens one document, each run of
    padding another (its queries attend only padding, and nothing reads them). None where some row's kept
    tokens are not one run: its mask is not a document's. Made from a mask in host memory (no wait)."""
    steps = torch.diff(attention_mask, dim=-1, prepend=torch.zeros_like(attention_mask[:, :1]))
    if ((steps > 0).sum(-1) > 1).any():  # a row's kept tokens start more than once
        return None
    return _numbered(steps[:, 1:] != 0)


def _numbered(starts: torch.Tensor) -> torch.Tensor:
    """(batch, seq) int32 document numbers from (batch, seq - 1) `starts`: whether each token after the first
    starts a document (a row's first token always does)."""
    return F.pad(starts.cumsum(-1, dtype=torch.int32), (1, 0))


def spans(documents: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document in `documents` (the host tensor documents_of makes): read on
    the host, where it lives, so no wait for the device."""
    batch, seq = documents.shape
    # a document number unique over the batch: rows never share one
    keys = (documents.long() + torch.arange(batch).unsqueeze(1) * (seq + 1)).flatten()
    ends = torch.unique_consecutive(keys, return_counts=True)[1].cumsum(0).tolist()
    out, start = [], 0
    for end in ends:
        row = start // seq
        out.append((row, start - row * seq, end - row * seq))
        start = end
    return out


# One op a forward and one a backward, each a loop of sdpa's own CPU flash kernel (forward, backward) over the
# documents: the numbers sdpa gives each document alone, nothing (seq x seq) made, so memory is linear in the
# sequence. Ops of their own, so that compile traces each as one node taking the documents as a tensor (no
# recompile per batch, no graph break). In: (batch, heads, seq, dim) each (key and value with the query's heads
# or a divisor of them: the kernel groups them itself); `documents`, (batch, seq) on the host (documents_of).
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@torch.library.custom_op("trainloop::document_attention", mutates_args=(), device_types="cpu")
def _documents_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, documents: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (batch, heads, seq, dim), logsumexp (batch, heads, seq)) of causal attention inside each document.
    out is laid out (batch, seq, heads, dim), as sdpa's kernel lays it: transformers' transpose back to that
    is then no copy."""
    out = _laid_out(query)
    logsumexp = query.new_empty(query.shape[:3], dtype=torch.float32)
    for row, start, end in spans(documents):
        part = (slice(row, row + 1), slice(None), slice(start, end))
        out[part], logsumexp[part] = _FLASH_CPU(query[part], key[part], value[part], 0.0, True, scale=scale)
    return out, logsumexp


@_documents_forward.register_fake
def _(query, key, value, documents, scale):
    return _laid_out(query), query.new_empty(query.shape[:3], dtype=torch.float32)


def _laid_out(query: torch.Tensor) -> torch.Tensor:
    batch, heads, seq, dim = query.shape
    return query.new_empty(batch, seq, heads, dim).transpose(1, 2)


@torch.library.custom_op("trainloop::document_attention_backward", mutates_args=(), device_types="cpu")
def _documents_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        out: torch.Tensor, logsumexp: torch.Tensor, documents: torch.Tensor,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = [torch.empty_like(t) for t in (query, key, value)]
    for row, start, end in spans(documents):
        part = (slice(row, row + 1), slice(None), slice(start, end))
        for whole, got in zip(grads, _FLASH_CPU_BACKWARD(grad[part], query[part], key[part], value[part], out[part],
                                                         logsumexp[part], 0.0, True, scale=scale)):
            whole[part] = got
    return tuple(grads)


@_documents_backward.register_fake
def _(grad, query, key, value, out, logsumexp, documents, scale):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _keep(ctx, inputs, output):
    query, key, value, documents, scale = inputs
    ctx.save_for_backward(query, key, value, *output, documents)
    ctx.scale = scale


def _backward(ctx, grad, _):
    return (*_documents_backward(grad, *ctx.saved_tensors, ctx.scale), None, None)


_documents_forward.register_autograd(_backward, setup_context=_keep)


def _documents_loop(query, key, value, documents, scale, dropout=0.0):
    """sdpa's causal kernel (flash, where the device has one) once a document, under autograd."""
    rows = []
    for row, start, end in spans(documents):
        if row == len(rows):
            rows.append([])
        part = slice(start, end)
        rows[row].append(F.scaled_dot_product_attention(query[row, :, part], key[row, :, part], value[row, :, part],
                                                        is_causal=True, scale=scale, dropout_p=dropout,
                                                        enable_gqa=key.shape[1] != query.shape[1]))
    return torch.stack([torch.cat(parts, dim=1) for parts in rows])


def cumulative_lengths(documents: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens, longest) of `documents` (the host tensor documents_of makes) as varlen kernels take them:
    int32 offsets of every document's first token in the batch's tokens laid end to end, and the batch's
    total last; the longest document's length. Made on the host, where the documents are."""
    batch, seq = documents.shape
    found = spans(documents)
    offsets = [row * seq + start for row, start, _ in found] + [batch * seq]
    return torch.tensor(offsets, dtype=torch.int32), max(end - start for _, start, end in found)


def attention_kernel(query: torch.Tensor, dropout: float = 0.0) -> str:
    """Which kernel document_attention runs for `query`: "cpu" (sdpa's CPU flash kernel once a document, in
    one op), "varlen" (one flash kernel over every document of the batch: a CUDA GPU, half precision, no
    dropout, a head of at most 256, flash attention's GPUs (compute capability 8.0 on), a torch whose varlen
    attention takes a causal window) or "loop" (sdpa once a document: attention dropout, which the CPU
    kernel has not, fp32 on a GPU, any other device)."""
    if query.device.type == "cpu" and not dropout:
        return "cpu"
    if (_varlen_attn is not None and query.device.type == "cuda" and not dropout
            and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256
            and torch.cuda.get_device_capability(query.device) >= (8, 0)):
        return "varlen"
    return "loop"


@functools.cache
def _announce(kernel: str, device: str) -> None:
    log.info("attention over packed documents on %s: %s", device, {
        "varlen": "torch's varlen flash attention, one kernel over every document of the batch",
        "loop": "sdpa once a document (its flash kernel where it has one)"}[kernel])


def _documents_varlen(query, key, value, documents, scale):
    """torch's varlen flash attention over the batch's documents laid end to end: (batch, seq, heads, dim).
    The offsets go to the device with the batch's launch queue, never read back."""
    batch, heads, seq, dim = query.shape
    offsets, longest = cumulative_lengths(documents)
    offsets = offsets.to(query.device, non_blocking=True)
    tokens = [t.transpose(1, 2).reshape(batch * seq, t.shape[1], dim) for t in (query, key, value)]
    out = _varlen_attn(*tokens, offsets, offsets, longest, longest, scale=scale, window_size=(-1, 0),
                       enable_gqa=key.shape[1] != heads)
    return out.view(batch, seq, heads, dim)


def document_attention(query, key, value, documents: torch.Tensor, scale: float, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention inside each document, none across. Out: (batch, seq, heads, dim), as transformers'
    attention functions return it. Under autocast it computes in autocast's dtype, as sdpa does."""
    device = query.device.type
    if torch.is_autocast_enabled(device):  # a custom op is not autocast's: cast as autocast casts sdpa
        dtype = torch.get_autocast_dtype(device)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    if device == "cpu" and not dropout:  # attention_kernel's "cpu": one op, which compile traces as a node
        return _documents_forward(query, key, value, documents, scale)[0].transpose(1, 2).contiguous()
    return _documents_elsewhere(query, key, value, documents, scale, dropout)


@torch.compiler.disable
def _documents_elsewhere(query, key, value, documents, scale, dropout):
    """Off the CPU, or with dropout: the varlen kernel or the loop (attention_kernel), the one taken logged the
    first time. Their launches depend on the documents, so compile leaves them out of the graph."""
    kernel = attention_kernel(query, dropout)
    _announce(kernel, query.device.type)
    if kernel == "varlen":
        return _documents_varlen(query, key, value, documents, scale)
    return _documents_loop(query, key, value, documents, scale, dropout).transpose(1, 2).contiguous()


def padded_causal(attention_mask: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) bool: causal, over the keys a padded row's `attention_mask` keeps; a
    padding query with no key to attend (left padding) attends itself, never read, so sdpa gives
    no NaN."""
    seq = attention_mask.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device).tril()
    mask = causal & attention_mask.bool()[:, None, :]
    return (mask | torch.eye(seq, dtype=torch.bool, device=mask.device))[:, None]


def _sdpa(module, query, key, value, attention_mask, document_mask=None, documents=None, context_parallel=None,
          **kwargs):
    """sdpa over whole rows: each document causal where the caller gives the documents, with padded
    rows' mask where it gives one, else is_causal. transformers built no mask (`attention_mask` is None): a
    cached step is generation, whose rows may be padded, and is refused. `context_parallel`: the group a
    forward's inputs were split over, handed in with them (trainloop.parallel.context.ContextParallel.local):
    the rows are this rank's slices, and attention runs on the whole sequence over a share of the heads."""
    if query.shape[2] != key.shape[2]:
        raise RuntimeError(f"attention {module.config._attn_implementation} attends whole rows in training; "
                           "generation runs under trainloop.model.attention.generating, with sdpa's own masks")
    if context_parallel is not None:
        return context_parallel.attend(_attend, module, query, key, value, document_mask, documents=documents,
                                       **kwargs)
    return _attend(module, query, key, value, document_mask, documents=documents, **kwargs)


def _attend(module, query, key, value, mask, documents=None, dropout=0.0, scaling=None, **kwargs):
    """transformers' sdpa (`mask`: padded rows'), or over `documents` document_attention."""
    if documents is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return document_attention(query, key, value, documents, scale, dropout), None


def with_document_mask(model, inputs: dict) -> dict:
    """`inputs` as `model` attends by them, where it attends through one of these functions (transformers
    builds it no mask; the model hands its keyword arguments to each layer's attention): padded rows (their
    `attention_mask` goes) as documents where their mask is in host memory (documents_of_mask; a mask on a
    device: padded_causal's dense mask), or, under sdpa_documents, the documents (`documents`: the loader's
    host tensor, else made from the position ids). A batch carries position ids only where a row
    restarts them (trainloop.data.loaders.collate); without them every row is one sequence, and sdpa runs
    is_causal. Other attentions get no `documents`: transformers' masks read the position ids."""
    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
    name = getattr(config, "_attn_implementation", None)
    if name not in (SDPA_CAUSAL, SDPA_DOCUMENTS) or "document_mask" in inputs:
        return {key: value for key, value in inputs.items() if key != "documents"}
    if inputs.get("attention_mask") is not None:
        rest = {key: value for key, value in inputs.items() if key not in ("attention_mask", "documents")}
        mask = inputs["attention_mask"]
        documents = inputs.get("documents")
        if documents is None and mask.device.type == "cpu":  # on a device, reading it would wait for it
            documents = documents_of_mask(mask)
        if documents is not None:
            return {**rest, "documents": documents}
        return {**rest, "document_mask": padded_causal(mask)}
    if name != SDPA_DOCUMENTS or "position_ids" not in inputs:
        return {key: value for key, value in inputs.items() if key != "documents"}
    if inputs.get("documents") is not None:
        return inputs
    return {**inputs, "documents": documents_of(inputs["position_ids"])}


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
           else "each packed document causal, no (sequence x sequence) mask")
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
