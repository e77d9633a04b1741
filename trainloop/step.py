"""One optimizer step: a step's micro-batches become one update.

The run's loop, the batch-size trials, the planner's measurement and the benchmark scripts all
take this step, so what they measure is the step the run takes: the units over the ranks, the
loss scale, the objective's loss and penalty, backward under the strategy's gradient sync,
clipping, the guard, the optimizer step. Its input is the step's micro-batches, whole, as a
pipeline schedule would take them. Everything it returns stays on the device, and where the
optimizer skips a non-finite update on the device (trainloop.guard), the step reads nothing on the host.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from trainloop.guard import Verdict, skipped_when


@dataclass
class StepResult:
    """What one optimizer step gives the loop to log, on the device."""

    loss: torch.Tensor  # this rank's share of the step's mean loss: summed over the ranks, the step's loss
    grad_norm: torch.Tensor | None  # before clipping, over every rank (None: DeepSpeed before its first step)
    verdict: Verdict  # the guard's: was the update applied, do the ranks stop after this step
    # the optimizer applied the update: the guard let it and the fp16 loss scaler did not skip it; None: the
    # device decided (the guard's verdict.skip), and the guard reads which later
    updated: bool | None
    units: torch.Tensor  # the step's units over every rank (objective.count), what the loss is divided by
    source_tokens: torch.Tensor | None  # data.sources: the tokens each source gave over every rank (None without)


def step_units(strategy, objective, group: list[dict], sources: int = 0,
               alone: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The step's units over every rank (the objective's count: target tokens for causal_lm) and,
    for a mixture, the tokens each source gave (whole blocks, as tokens_seen counts; None without):
    one reduce (none when this process steps `alone`, or is the only one)."""
    counts = [objective.count(b) for b in group]
    count = counts[0] if len(counts) == 1 else torch.stack(counts).sum()
    if not sources:
        count = count.to(strategy.device)
        if not (alone or strategy.world_size == 1):
            count = strategy.reduce_sum(count.view(1))[0]
        return count.clamp(min=1), None
    blocks = sum(torch.bincount(b["source"], minlength=sources) for b in group)
    count = torch.cat([count.view(1), blocks * group[0]["input_ids"].shape[1]]).to(strategy.device)
    if not alone:
        count = strategy.reduce_sum(count)
    return count[0].clamp(min=1), count[1:]


def stepped_optimizer(optimizer):
    """What train_step steps and zeroes: accelerate's wrapper where it acts (fp16's grad scaler, DeepSpeed's
    engine, which steps inside backward), else the optimizer inside it, which the wrapper's step and zero_grad
    only call, after looking up a package and inspecting a signature each time (a tenth of a millisecond)."""
    from accelerate.optimizer import AcceleratedOptimizer

    if type(optimizer) is AcceleratedOptimizer and optimizer.scaler is None:
        return optimizer.optimizer
    return optimizer


def every_update(state, step_loss, grad_norm) -> Verdict:
    """The check of a step outside a run (the planner, the benchmarks): every update goes
    through, with no collective. A run's is trainloop.guard.StepGuard.check."""
    return Verdict(update=True, stop=False)


def train_step(strategy, objective, model, optimizer, group: list[dict], *, max_grad_norm: float | None = None,
               forward_context: Callable = nullcontext, check: Callable = every_update, state=None,
               sources: int = 0, alone: bool = False) -> StepResult:
    """Run one optimizer step on `group`, the step's micro-batches on this rank.

    max_grad_norm: trainer.max_grad_norm (None or 0: the norm is measured, not clipped).
    forward_context: the context each training forward runs in (activation offload; the batch-size
    trials add autocast to a model accelerate has not wrapped). check(state, step_loss, grad_norm):
    after clipping, whether the update is applied and whether to stop (a run's StepGuard.check: read
    at once, or skipped on the device and read a step later). sources: data.sources' count, to
    count each source's tokens. alone: this process steps by itself, before the model is spread
    over the ranks (the batch-size trials): no collective.
    """
    accelerator = strategy.accelerator
    max_norm = max_grad_norm or math.inf  # clipping at inf still measures the norm, for the guard
    units, source_tokens = step_units(strategy, objective, group, sources, alone)
    # the micro-batches' forwards and backwards, as the strategy runs them (one after another, or a
    # pipeline schedule's order): the gradient is the sum of the units' loss gradients / the step's units
    step_loss = strategy.forward_backward(objective, model, group, units, forward_context, alone)
    grad_norm = strategy.clip_grad_norm(model, max_norm)
    verdict = check(state, step_loss, grad_norm)  # a run's guard: ranks agree, update? stop? (1 sync)
    stepped = stepped_optimizer(optimizer)
    if verdict.update:
        with skipped_when(stepped, verdict.skip):
            stepped.step()
    stepped.zero_grad(set_to_none=True)
    updated = None if verdict.skip is not None else verdict.update and not accelerator.optimizer_step_was_skipped
    return StepResult(step_loss, grad_norm, verdict, updated, units, source_tokens)
