"""The generalized Jensen-Shannon divergence between a student's and a teacher's next-token
distributions (objective=distill), as TRL 1.16 defines it (GKDTrainer.generalized_jsd_loss, the
DistillationTrainer's chunked kernel): both sets of logits divided by the temperature T, p the
student's softmax, q the teacher's, and at beta in (0, 1) the mixture m = (1 - beta) p + beta q,

    beta KL(q || m) + (1 - beta) KL(p || m);

at beta = 0 the forward KL(q || p), at beta = 1 the reverse KL(p || q). Summed over the target
tokens (the positions whose next label is not IGNORE), in fp32.

Two ways through the output layers, as for the next-token loss (trainloop/objectives/chunked_loss.py):
- trainer.loss_chunk_tokens=0: both models' full logits, and autograd;
- N > 0: the teacher's final hidden states at the target positions are taken from its output
  layer's input (with the weight its strategy gathered for the call, copied where the strategy
  frees it after: ZeRO-3, FSDP2), then the student's output layer computes the divergence from
  its input N tokens at a time (ChunkedDivergence): neither model's full logits exist. The
  gradient of a sum is known up to one scalar, so each chunk's is made in the forward, as
  SummedNLL makes cross-entropy's: d/dz of the per-token divergence, z the student's tempered
  logits, is p - q at beta 0 and p (r - sum p r) otherwise, with r = (1 - beta) (log p - log m),
  or log p - log q at beta 1; the logits' gradient is that over T.
Beside the divergence, both compute the student's and the teacher's cross-entropy of the target
tokens at temperature 1 (no gradient): the eval line's eval_nll, and how good the teacher is.
"""

from __future__ import annotations

import math

import torch

from trainloop.data.tokenizer import IGNORE
from trainloop.objectives.chunked_loss import (
    _chunk_logits, _compute_dtype, _this_rank, _through_output_layer, _wanted, add_chunk_grads, made_grads_scaled,
    new_grads, output_layer,
)


def token_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                     temperature: float) -> torch.Tensor:
    """Each row's divergence (the module docstring's), fp32, through autograd: logits (n, vocab)."""
    s = (student_logits.float() / temperature).log_softmax(-1)
    t = (teacher_logits.float() / temperature).log_softmax(-1)
    if beta == 0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1:
        return (s.exp() * (s - t)).sum(-1)
    m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
    return beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)


def divergence_sums(student, teacher, inputs: dict, labels: torch.Tensor, beta: float, temperature: float,
                    chunk: int, copy_head: bool = False) -> torch.Tensor:
    """[divergence summed over the target tokens (with its gradient), the student's summed
    cross-entropy of them, the teacher's] fp32, from one forward of each model on `inputs` (the
    teacher's without gradients). chunk: trainer.loss_chunk_tokens (0: the full logits).
    copy_head: the teacher's strategy frees its gathered output weight after the forward.
    Under context parallelism both models run this rank's slice of the rows (the teacher's attention
    swaps heads over the same group) and the sums are the whole rows', summed over the group."""
    from trainloop.model.attention import with_document_mask

    student_inputs, targets, cp = _this_rank(student, inputs, labels)
    teacher_inputs = student_inputs if cp is not None else with_document_mask(teacher, inputs)
    keep = targets != IGNORE
    wanted = targets[keep]
    if not chunk:
        with torch.no_grad():
            t_logits = teacher(**teacher_inputs).logits[keep].float()
        s_logits = student(**student_inputs).logits[keep].float()
        summed = token_divergence(s_logits, t_logits, beta, temperature).sum()
        with torch.no_grad():
            nll = torch.stack([summed_ce(s_logits, wanted), summed_ce(t_logits, wanted)])
        sums = torch.cat([summed[None], nll])
        return sums if cp is None else cp.total(sums)

    held = {}

    def take(hidden, weight, bias):
        held["hidden"] = hidden[keep]
        held["weight"], held["bias"] = (x if x is None or not copy_head else x.detach().clone() for x in (weight, bias))
        return hidden.new_zeros(())

    output_layer(teacher)  # refused unless a plain Linear with nothing applied to its logits after
    with torch.no_grad():
        _through_output_layer(teacher, teacher_inputs, take)

    def divergence(hidden, weight, bias):
        h = hidden[keep]
        return ChunkedDivergence.apply(h, weight, bias, held["hidden"], held["weight"], held["bias"], wanted, beta,
                                       temperature, chunk, *_wanted(h, weight, bias))

    sums = _through_output_layer(student, student_inputs, divergence).logits
    return sums if cp is None else cp.total(sums)


def summed_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the rows, fp32."""
    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum")


class ChunkedDivergence(torch.autograd.Function):
    """[sum over n tokens of the divergence, the student's cross-entropy sum, the teacher's], from
    the student's (hidden, weight, bias) and the teacher's, `chunk` tokens at a time; the
    divergence's gradients made in the forward (the cross-entropies have none)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, t_hidden, t_weight, t_bias, targets, beta, temperature, chunk,
                need_hidden, need_weight, need_bias):
        device = hidden.device
        dtype, t_dtype = _compute_dtype(hidden, weight), _compute_dtype(t_hidden, t_weight)
        sums = torch.zeros(3, dtype=torch.float32, device=device)
        grads = need_hidden or need_weight or need_bias
        with torch.autocast(device.type, enabled=False):
            w, t_w = weight.to(dtype), t_weight.to(t_dtype)
            grad_hidden, grad_weight, grad_bias = new_grads(hidden, weight, need_hidden, need_weight, need_bias)
            for start in range(0, hidden.shape[0], chunk):
                end = start + chunk
                h, y = hidden[start:end].to(dtype), targets[start:end, None]
                logits = _chunk_logits(h, w, bias, dtype)
                t_logits = _chunk_logits(t_hidden[start:end], t_w, t_bias, t_dtype)
                s, t = logits.log_softmax(-1), t_logits.log_softmax(-1)
                sums[1] -= s.gather(1, y).sum()
                sums[2] -= t.gather(1, y).sum()
                if temperature != 1:
                    s, t = logits.div_(temperature).log_softmax(-1), t_logits.div_(temperature).log_softmax(-1)
                del logits, t_logits
                divergence, grad = _divergence_and_grad(s, t, beta)
                sums[0] += divergence.sum()
                del s, t
                if not grads:
                    continue
                grad = grad.div_(temperature)  # d/d(logits) of the tempered logits' divergence
                add_chunk_grads(grad, h, w, slice(start, end), (grad_hidden, grad_weight, grad_bias))
                del grad  # before the next chunk's logits
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return sums

    @staticmethod
    def backward(ctx, grad_sums):  # the cross-entropies are metrics: their gradients are not taken
        return *made_grads_scaled(ctx, grad_sums[0]), *([None] * 10)


def _divergence_and_grad(s: torch.Tensor, t: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's divergence of the log-softmaxes s (student) and t (teacher), and its gradient with
    respect to the student's tempered logits (the module docstring's); s is consumed."""
    p = s.exp()
    if beta == 0:
        q = t.exp()
        return (q * (t - s)).sum(-1), p.sub_(q)
    if beta == 1:
        r = s.sub_(t)  # log p - log q
        divergence = (p * r).sum(-1)
        return divergence, r.sub_(divergence[:, None]).mul_(p)
    m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
    q = t.exp()
    teacher_side = (q * (t - m)).sum(-1)
    r = s.sub_(m)  # log p - log m
    student_side = (p * r).sum(-1)
    return beta * teacher_side + (1 - beta) * student_side, r.sub_(student_side[:, None]).mul_(p).mul_(1 - beta)
