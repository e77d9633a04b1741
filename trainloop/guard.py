"""The once-per-optimizer-step check: were the loss and gradient norm finite, was a stop requested.

Every rank contributes its flags (and its share of the step's loss, for the message) to one tiny
all-reduce, so all ranks take the same decision: apply the update or not (trainer.on_nonfinite=
skip), stop with an error (=stop), stop to be preempted. Under fp16 a non-finite gradient norm is
the loss scaler's business: it skips the step and lowers the scale, so only a non-finite loss
counts there.

Where the optimizer can skip an update on the device (torch's fused Adam, AdamW and SGD take the
flag as `found_inf`, as the AMP grad scaler hands it to them: `_step_supports_amp_scaling`), the
host never waits for the verdict: the device skips a non-finite update itself, and the host reads
the step's flags one step late, from a copy already on its way to pinned host memory, at the next
step's check (once that step's forward and backward are queued, so the device is never idle), or
at once where the schedule needs them (a log line, an evaluation, a save, the last step). The
non-finite count, the scheduler's step and a stop follow then, one step late at most; the bad
update is never applied. Every other optimizer (a for-loop or foreach AdamW, bitsandbytes', the
Adafactor, Muon, a DeepSpeed engine) and fp16's scaler need the verdict before the update: they
read it at once, one sync per optimizer step.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from trainloop.errors import NonFiniteError

log = logging.getLogger("trainloop")


@dataclass
class Verdict:
    update: bool  # the host calls the optimizer's step (under DeepSpeed it was already applied or skipped)
    stop: bool  # every rank agreed to stop after this step (preemption)
    skip: torch.Tensor | None = None  # read on the device: 1.0 where the update must be skipped (found_inf)


def skips_on_device(optimizer) -> bool:
    """Whether the optimizer takes a `found_inf` flag and skips its update on the device when it is set."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    return bool(getattr(inner, "_step_supports_amp_scaling", False))


def skipped_when(optimizer, skip: torch.Tensor | None):
    """The context of the optimizer's step: it skips its update where `skip` is set, on the device (as the AMP
    grad scaler has it do), with no host sync; none without `skip`."""
    return nullcontext() if skip is None else _found_inf(getattr(optimizer, "optimizer", optimizer), skip)


@contextmanager
def _found_inf(inner, skip: torch.Tensor):
    inner.found_inf = skip
    try:
        yield
    finally:
        del inner.found_inf


class StepGuard:
    def __init__(self, cfg, strategy, checkpointer, preemption, optimizer=None, scheduler=None):
        self.strategy = strategy
        self.policy = cfg.trainer.on_nonfinite
        self.scaler_owns_grads = cfg.precision.name == "fp16"
        self.checkpointer = checkpointer
        self.preemption = preemption
        self.scheduler = scheduler  # stepped once a step's update is known to be applied
        self.preempted_by: str | None = None  # set once every rank agreed to stop
        device = strategy.device
        # read one step late, where the optimizer skips on the device and fp16's scaler does not decide (a
        # DeepSpeed engine's optimizer never says it skips on the device: it steps inside backward)
        self.late = optimizer is not None and skips_on_device(optimizer) and not self.scaler_owns_grads
        self.requested = torch.zeros((), device=device)  # the preemption flag, set on the device without a copy
        self.requested_set = False  # what it holds, so that it is written only when that changes
        # each rank's share of the step's mean loss: once per data-parallel rank (tp ranks hold the same)
        self.loss_share = strategy.dp_size / strategy.world_size
        on_cuda = torch.device(device).type == "cuda"
        # the flags of the step not yet read: copied toward the host as soon as they are computed
        self.staged = torch.zeros(3, pin_memory=on_cuda)
        self.copied = torch.cuda.Event() if on_cuda else None
        self.pending: int | None = None  # the step whose flags are staged and unread

    def flags(self, step_loss: torch.Tensor, grad_norm) -> torch.Tensor:
        """[the step's mean loss, the gradient norm x the processes, stop requested], each summed over every rank:
        one all-reduce, on the device (none on one process). A sum is non-finite where any rank's term is, so
        the two sums say whether some rank's loss or norm was; the norm is already the same on every rank."""
        device = self.strategy.device
        # DeepSpeed reports no norm before its first step; unknown is not non-finite.
        grad_norm = torch.zeros((), device=device) if grad_norm is None else torch.as_tensor(grad_norm, device=device)
        requested = self.preemption.requested is not None
        if requested != self.requested_set:
            self.requested.fill_(float(requested))
            self.requested_set = requested
        loss = step_loss.detach().float()
        flags = torch.stack([loss if self.loss_share == 1 else loss * self.loss_share, grad_norm.detach().float(),
                             self.requested])
        return self.strategy.sum_over_all(flags)  # every process agrees, whatever group it is in

    def check(self, state, step_loss: torch.Tensor, grad_norm) -> Verdict:
        """Decide for the optimizer step that is about to be taken (state.step + 1)."""
        flags = self.flags(step_loss, grad_norm)
        if not self.late:
            return self.decide(state, state.step + 1, flags.tolist())  # the one host sync of the step
        stop = self.settle(state)  # the step before: its flags are computed, the copy long landed
        self.staged.copy_(flags, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.pending = state.step + 1
        return Verdict(update=True, stop=stop, skip=torch.isfinite(flags[0] + flags[1]).logical_not().float())

    def stepped(self, updated: bool | None) -> None:
        """After the optimizer's step: the scheduler steps if the update was applied. None: the device
        decided (read one step late), and settle() steps it."""
        if updated and self.scheduler is not None:
            self.scheduler.step()

    def settle(self, state) -> bool:
        """Read the staged flags of the step not yet read, if any, and act on them: count a skipped
        update, step the scheduler after an applied one, raise for trainer.on_nonfinite=stop.
        Returns whether every rank agreed to stop. Waits for the device only as far as that step."""
        if self.pending is None:
            return False
        if self.copied is not None:
            self.copied.synchronize()
        step, self.pending = self.pending, None
        verdict = self.decide(state, step, self.staged.tolist())
        if verdict.update and self.scheduler is not None:
            self.scheduler.step()
        return verdict.stop

    def decide(self, state, step: int, flags: list[float]) -> Verdict:
        """The verdict for optimizer step `step` from its reduced flags (on the host)."""
        mean_loss, grad_norm, stop = flags[0], flags[1] / self.strategy.world_size, flags[2] > 0
        bad_loss, bad_grad = not math.isfinite(mean_loss), not (math.isfinite(grad_norm) or self.scaler_owns_grads)
        if stop and self.preempted_by is None:
            self.preempted_by = self.preemption.requested or "a signal to another rank"
        if not (bad_loss or bad_grad):
            return Verdict(update=True, stop=stop)
        what = "loss" if bad_loss else "gradient norm"
        message = (f"non-finite {what} at optimizer step {step} (mean loss {mean_loss:.4g}, "
                   f"gradient norm {grad_norm:.4g})")
        if self.policy == "stop":
            raise NonFiniteError(f"{message}; stopped (trainer.on_nonfinite=stop). "
                                 f"{self.checkpointer.back_to_last_good()} (or with trainer.on_nonfinite=skip "
                                 "to skip such steps)")
        state.nonfinite_steps += 1
        log.warning("%s; update skipped (trainer.on_nonfinite=skip, %d so far)", message,
                    state.nonfinite_steps)
        # Under fp16 the scaler must still see the step to skip it and lower its scale.
        return Verdict(update=self.scaler_owns_grads, stop=stop)
