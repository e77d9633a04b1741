"""The once-per-optimizer-step check: were the loss and gradient norm finite, was a stop requested.

Every rank contributes its flags to one tiny all-reduce, so all ranks take the same decision:
apply the update or not (trainer.on_nonfinite=skip), stop with an error (=stop), stop to be
preempted. Under fp16 a non-finite gradient norm is the loss scaler's business: it skips the
step and lowers the scale, so only a non-finite loss counts there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from trainloop.errors import NonFiniteError

log = logging.getLogger("trainloop")


@dataclass
class Verdict:
    update: bool  # apply this step's update (under DeepSpeed it was already applied or skipped)
    stop: bool  # every rank agreed to stop after this step (preemption)


class StepGuard:
    def __init__(self, cfg, strategy, checkpointer, preemption):
        self.strategy = strategy
        self.policy = cfg.trainer.on_nonfinite
        self.scaler_owns_grads = cfg.precision.name == "fp16"
        self.checkpointer = checkpointer
        self.preemption = preemption
        self.preempted_by: str | None = None  # set once every rank agreed to stop

    def check(self, state, step_loss: torch.Tensor, grad_norm) -> Verdict:
        """Decide for the optimizer step that is about to be taken (state.step + 1)."""
        device = self.strategy.device
        # DeepSpeed reports no norm before its first step; unknown is not non-finite.
        grad_norm = torch.as_tensor(0.0 if grad_norm is None else grad_norm, device=device)
        flags = torch.stack([
            (~torch.isfinite(step_loss)).float(),
            (~torch.isfinite(grad_norm)).float() * (not self.scaler_owns_grads),
            torch.tensor(float(self.preemption.requested is not None), device=device),
        ])
        flags = self.strategy.sum_over_all(flags)  # every process agrees, whatever group it is in
        # The one host sync the guard adds per optimizer step (not per micro-step).
        bad_loss, bad_grad, stop = (v > 0 for v in flags.tolist())
        if stop and self.preempted_by is None:
            self.preempted_by = self.preemption.requested or "a signal to another rank"
        if not (bad_loss or bad_grad):
            return Verdict(update=True, stop=stop)
        what = "loss" if bad_loss else "gradient norm"
        # each rank holds its share of the step's mean loss (the loop divides by the step's global units)
        mean_loss = self.strategy.reduce_sum(step_loss.detach().clone()).item()
        message = (f"non-finite {what} at optimizer step {state.step + 1} (mean loss {mean_loss:.4g}, "
                   f"gradient norm {grad_norm.item():.4g})")
        if self.policy == "stop":
            raise NonFiniteError(f"{message}; stopped (trainer.on_nonfinite=stop). "
                                 f"{self.checkpointer.back_to_last_good()} (or with trainer.on_nonfinite=skip "
                                 "to skip such steps)")
        state.nonfinite_steps += 1
        log.warning("%s; update skipped (trainer.on_nonfinite=skip, %d so far)", message,
                    state.nonfinite_steps)
        # Under fp16 the scaler must still see the step to skip it and lower its scale.
        return Verdict(update=self.scaler_owns_grads, stop=stop)
