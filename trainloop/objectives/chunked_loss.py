"""The next-token loss without the full logits (trainer.loss_chunk_tokens=N; 0: the full logits).

At 128,256 tokens of vocabulary the logits of one 2,048-token sequence are 1 GiB in fp32, more
than a small model's weights, and cross-entropy adds as much again for its gradient. Here the
model's final hidden states go through the output layer N tokens at a time: the tokens without a
target (label IGNORE) are dropped first, each chunk's logits live only while the chunk is
computed, and the sums are kept in fp32.

How the hidden states are reached: for the length of one call, the output layer's forward is
replaced by one that computes the loss from its input (the final hidden states) and its weight,
and returns that loss where the model would return its logits. The model's own forward still
runs through every wrapper, so each strategy gathers the output weight as it does for the full
logits (DeepSpeed ZeRO-3 in the layer's pre-forward hook, FSDP2 in the root's forward, which
keeps the root gathered until its backward) and the gradient reaches the weight, or its shard,
the usual way. Nothing stays replaced after the call: the exported model is the trained one.
TRL's chunked SFT loss and Liger replace the whole model forward instead; this keeps one
model-agnostic seam, a plain Linear output layer.

Two autograd functions, for two kinds of caller:
- SummedNLL (causal_lm's summed loss): the gradient of the sum is known up to one scalar, so the
  forward computes it chunk by chunk (as Liger's fused linear cross-entropy does) and the
  backward only scales it. The output layer's three matmuls, as with the full logits: a
  recomputing backward would add a fourth, about a third more work at a large vocabulary.
- TokenLogps (per-token log-probabilities, DPO's): their upstream gradients differ token by
  token, so the backward recomputes each chunk's logits from the saved hidden states and the
  log-sum-exp (four matmuls).
Both hold one chunk's fp32 logits and one temporary as large at a time. torch.utils.checkpoint
per chunk would hold the recomputed chunk's log-softmax and its gradients too, and is slower:
the output layer and loss of 2,048 tokens at vocabulary 128,256 and width 256 took, in CPU-seconds
of one thread, 5.1 with the full logits, 4.7 SummedNLL, 6.4 TokenLogps, 8.3 checkpoint per chunk
of 256 (measured 2026-11-25 on the shared 2-core Xeon).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn.functional as F

from trainloop.data.tokenizer import IGNORE
from trainloop.model.output_layer import KEY, output_layer


def next_targets(labels: torch.Tensor) -> torch.Tensor:
    """Each position's target, the next label, (batch, seq): the labels shifted, an IGNORE appended
    (shifting the labels, not slicing the logits, whose slice would be a copy)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


def targets_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's logits against its target (next_targets), summed over the
    targets that are not IGNORE, in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")


def summed_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the target tokens, in fp32: position t predicts labels[:, t + 1]."""
    return targets_nll(logits, next_targets(labels))


def _this_rank(model, inputs: dict, labels: torch.Tensor):
    """(the model's inputs, each position's target) of what this rank computes: the whole rows, or, under
    context parallelism (the group installed on `model`, trainloop.parallel.context), its slice of them, whose
    targets were shifted on the whole row; and that group, or None. The inputs carry the mask `model` attends by."""
    from trainloop.model.attention import with_document_mask
    from trainloop.parallel import context

    inputs, targets = with_document_mask(model, inputs), next_targets(labels)
    cp = context.of(model)
    if cp is not None:
        inputs, targets = cp.local(inputs), cp.split(targets, IGNORE)
    return inputs, targets, cp


def next_token_nll(model, inputs: dict, labels: torch.Tensor, chunk: int, nll: Callable = targets_nll,
                   forward_nll: Callable | None = None):
    """(cross-entropy summed over the target tokens, fp32; the model's output) for one forward of
    `model(**inputs)`: position t predicts labels[:, t + 1]. chunk 0: through the full logits, and
    `nll` (targets_nll, or it compiled with the model: trainloop.model.compile.compile_loss), or
    `forward_nll`, the forward and the loss compiled as one (compile_forward_loss), whose output is None.
    Under context parallelism the output is this rank's slice's and the sum the whole rows'."""
    inputs, targets, cp = _this_rank(model, inputs, labels)
    if not chunk and forward_nll is not None:
        summed, output = forward_nll(model, inputs, targets), None
    elif not chunk:
        output = model(**inputs)
        summed = nll(output.logits, targets)
    else:
        output = _through_output_layer(model, inputs, lambda h, weight, bias: _summed(h, weight, bias, targets, chunk))
        summed = output.logits
    return (summed if cp is None else cp.total(summed)), output


def chunked_nll(hidden: torch.Tensor, weight: torch.Tensor, bias, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """summed_nll of the output layer (`weight`, `bias`) applied to `hidden`, `chunk` tokens at a
    time: the full logits never exist."""
    return _summed(hidden, weight, bias, next_targets(labels), chunk)


def _summed(hidden, weight, bias, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    h, kept, _ = _kept(hidden, targets)
    return SummedNLL.apply(h, weight, bias, kept, chunk, *_wanted(h, weight, bias))


def token_logps(model, inputs: dict, labels: torch.Tensor, chunk: int, temperature: float = 1.0,
                entropy: bool = False):
    """Each position's log-probability of the next target token, (batch, seq - 1) in fp32, 0 where
    labels[:, t + 1] is IGNORE, from one forward of `model(**inputs)`, at the sampling `temperature`
    (the logits divided by it, as TRL scores its completions). chunk 0: the full logits. Under
    context parallelism, the whole rows' from this rank's slice and the others'. entropy (chunk 0):
    also each position's entropy of the next token's distribution, in nats, with no gradient:
    (log-probabilities, entropies)."""
    length = labels.shape[1]
    inputs, targets, cp = _this_rank(model, inputs, labels)
    entropies = None
    if not chunk:
        logits = model(**inputs).logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        per_token = -F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE,
                                     reduction="none").view(targets.shape)
        if entropy:
            with torch.no_grad():
                logp = logits.log_softmax(-1)
                entropies = -(logp.exp() * logp).sum(-1)
    else:
        if temperature != 1.0 or entropy:
            raise ValueError(f"{KEY}: the chunked log-probabilities are at temperature 1 and without entropies")

        def logps(hidden, weight, bias):
            h, kept, keep = _kept(hidden, targets)
            per_target = TokenLogps.apply(h, weight, bias, kept, chunk)
            return torch.zeros(keep.shape, dtype=torch.float32, device=h.device).masked_scatter(keep, per_target)

        per_token = _through_output_layer(model, inputs, logps).logits
    if cp is not None:
        per_token = cp.gather(per_token, length)
        entropies = None if entropies is None else cp.gather(entropies, length)
    return per_token[:, :-1] if not entropy else (per_token[:, :-1], entropies[:, :-1])


@contextmanager
def computing_in_output_layer(head: torch.nn.Linear, compute: Callable):
    """For the length of the block, head(hidden) returns compute(hidden, its weight, its bias): the
    weight the strategy gathered for this call. The instance attribute shadows the class's forward
    and is deleted after, whatever happens."""
    head.forward = lambda hidden: compute(hidden, head.weight, head.bias)
    try:
        yield
    finally:
        del head.forward


def _through_output_layer(model, inputs: dict, compute: Callable):
    with computing_in_output_layer(output_layer(model), compute):
        return model(**inputs)


def _kept(hidden: torch.Tensor, targets: torch.Tensor):
    """The hidden states of the positions that predict a target token, (n, hidden), their targets
    (n,), and where they are in (batch, seq)."""
    keep = targets != IGNORE
    return hidden[keep], targets[keep], keep


def _wanted(hidden, weight, bias) -> tuple[bool, bool, bool]:
    """Which gradients the forward must prepare (none under no_grad, none for a frozen weight)."""
    on = torch.is_grad_enabled()
    return on and hidden.requires_grad, on and weight.requires_grad, on and bias is not None and bias.requires_grad


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """What the output layer's matmul would compute in: autocast's dtype, else the weight's."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def _chunk_logits(h, weight, bias, dtype) -> torch.Tensor:
    logits = torch.mm(h.to(dtype), weight.t())
    if bias is not None:
        logits = logits + bias.to(dtype)
    return logits.float()


def new_grads(hidden: torch.Tensor, weight: torch.Tensor, need_hidden: bool, need_weight: bool,
              need_bias: bool) -> tuple:
    """Room for the output layer's gradients, None where not wanted: the hidden states' in their dtype,
    the weight's and the bias's summed in fp32."""
    return (torch.empty_like(hidden) if need_hidden else None,
            torch.zeros(weight.shape, dtype=torch.float32, device=hidden.device) if need_weight else None,
            torch.zeros(weight.shape[0], dtype=torch.float32, device=hidden.device) if need_bias else None)


def add_chunk_grads(grad: torch.Tensor, h: torch.Tensor, w: torch.Tensor, rows: slice, grads: tuple) -> None:
    """One chunk's share of the output layer's gradients, from the fp32 gradient of its logits `grad`
    (h: the chunk's hidden states, w: the weight, both in the compute dtype): into `grads` (hidden's
    rows, weight, bias; None where not wanted)."""
    grad_hidden, grad_weight, grad_bias = grads
    if grad_bias is not None:
        grad_bias += grad.sum(0)
    grad = grad.to(w.dtype)
    if grad_hidden is not None:
        grad_hidden[rows] = torch.mm(grad, w)
    if grad_weight is not None:
        _accumulate(grad_weight, grad.t(), h)


def made_grads_scaled(ctx, scale: torch.Tensor) -> tuple:
    """The gradients a forward made (ctx.grads, ctx.dtypes) times the upstream gradient of its sum,
    in the parameters' dtypes: scaled in place, so a second backward through the graph is refused."""
    grad_hidden, grad_weight, grad_bias = ctx.grads
    ctx.grads = None
    weight_dtype, bias_dtype = ctx.dtypes
    if grad_hidden is not None:
        grad_hidden.mul_(scale.to(grad_hidden.dtype))
    if grad_weight is not None:
        grad_weight = grad_weight.mul_(scale).to(weight_dtype)
    if grad_bias is not None:
        grad_bias = grad_bias.mul_(scale).to(bias_dtype)
    return grad_hidden, grad_weight, grad_bias


def _accumulate(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total (fp32) += a @ b, computed in a's dtype."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    else:
        total.add_(torch.mm(a, b))


class SummedNLL(torch.autograd.Function):
    """sum over n tokens of -log softmax(h W^T + b)[target]; the gradients made in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, need_hidden, need_weight, need_bias):
        device = hidden.device
        dtype = _compute_dtype(hidden, weight)
        with torch.autocast(device.type, enabled=False):
            w = weight.to(dtype)  # one 16-bit copy under autocast, as the full logits' matmul makes
            total = torch.zeros((), dtype=torch.float32, device=device)
            grad_hidden, grad_weight, grad_bias = new_grads(hidden, weight, need_hidden, need_weight, need_bias)
            for start in range(0, hidden.shape[0], chunk):
                h, y = hidden[start:start + chunk].to(dtype), targets[start:start + chunk, None]
                logits = _chunk_logits(h, w, bias, dtype)
                lse = torch.logsumexp(logits, dim=1, keepdim=True)
                total += (lse - logits.gather(1, y)).sum()
                if not (need_hidden or need_weight or need_bias):
                    continue
                grad = logits.sub_(lse).exp_().scatter_add_(1, y, torch.full_like(y, -1, dtype=logits.dtype))
                del logits  # d(sum)/d(logits) = softmax - one-hot, in the logits' place
                add_chunk_grads(grad, h, w, slice(start, start + chunk), (grad_hidden, grad_weight, grad_bias))
                del grad  # before the next chunk's logits: two chunks' logits are never held at once
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        return *made_grads_scaled(ctx, grad_total), None, None, None, None, None


class TokenLogps(torch.autograd.Function):
    """log softmax(h W^T + b)[target] for each of n tokens; the backward recomputes the logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk):
        device = hidden.device
        dtype = _compute_dtype(hidden, weight)
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=device)
        lse = torch.empty(n, dtype=torch.float32, device=device)
        with torch.autocast(device.type, enabled=False):
            w = weight.to(dtype)
            for start in range(0, n, chunk):
                logits = _chunk_logits(hidden[start:start + chunk], w, bias, dtype)
                lse[start:start + chunk] = torch.logsumexp(logits, dim=1)
                out[start:start + chunk] = logits.gather(1, targets[start:start + chunk, None])[:, 0]
        out -= lse
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk, ctx.dtype = chunk, dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        chunk, dtype = ctx.chunk, ctx.dtype
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        device = hidden.device
        grad_hidden, grad_weight, grad_bias = new_grads(hidden, weight, need_hidden, need_weight, need_bias)
        with torch.autocast(device.type, enabled=False):
            w = weight.to(dtype)
            for start in range(0, hidden.shape[0], chunk):
                end = start + chunk
                h, y, g = hidden[start:end].to(dtype), targets[start:end, None], grad_out[start:end, None].float()
                logits = _chunk_logits(h, w, bias, dtype)
                # d(g * logp[y])/d(logits) = g * (one-hot - softmax), in the logits' place
                grad = logits.sub_(lse[start:end, None]).exp_().mul_(-g).scatter_add_(1, y, g)
                add_chunk_grads(grad, h, w, slice(start, end), (grad_hidden, grad_weight, grad_bias))
                del grad, logits  # before the next chunk's logits
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None
