"""The training loop: micro-steps under `accelerator.accumulate`, then clip, step, log, eval, save."""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import asdict, dataclass

import torch

from trainloop.telemetry import Telemetry


@dataclass
class TrainState:
    """The trainer's own progress. Checkpointed with the model so a resume continues exactly."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches of this epoch already consumed, per rank
    tokens_seen: int = 0  # over all ranks
    nonfinite_steps: int = 0  # updates skipped because the loss or gradient norm was NaN/Inf

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def batches_forever(accelerator, loader, state: TrainState):
    """Yield training batches epoch after epoch, keeping state.epoch/batches_in_epoch exact.

    A resumed run starts mid-epoch by skipping indices in the sampler, not by loading data.
    """
    while True:
        epoch_loader = loader
        if state.batches_in_epoch:
            epoch_loader = accelerator.skip_first_batches(loader, state.batches_in_epoch)
        epoch_loader.set_epoch(state.epoch)  # the shuffle order is a function of (seed, epoch)
        # Starting an epoch draws a worker seed from the global torch RNG; undo that draw, so
        # dropout does not depend on where a run was resumed. The iterator starts lazily.
        rng, batches = torch.get_rng_state(), iter(epoch_loader)
        first = next(batches, None)
        torch.set_rng_state(rng)
        for batch in itertools.chain([] if first is None else [first], batches):
            state.batches_in_epoch += 1
            yield batch
        state.epoch += 1
        state.batches_in_epoch = 0


@torch.no_grad()
def evaluate(accelerator, model, loader, max_batches: int | None) -> float:
    """Mean next-token loss over the validation split, identical on every rank."""
    model.eval()
    total = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    for i, ids in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        loss = model(input_ids=ids, labels=ids).loss
        total += torch.stack([loss.double() * ids.shape[0], torch.tensor(ids.shape[0], device=total.device)])
    model.train()
    total = accelerator.reduce(total, reduction="sum")
    return (total[0] / total[1]).item()


def train(cfg, accelerator, model, optimizer, scheduler, train_loader, valid_loader,
          state: TrainState, metrics, checkpointer, guard) -> float | None:
    """Run optimizer steps until trainer.max_steps (or a stop); return the last validation loss."""
    tc = cfg.trainer
    tokens_per_batch = cfg.data.batch_size * cfg.data.seq_len * accelerator.num_processes
    batches = batches_forever(accelerator, train_loader, state)
    telemetry = Telemetry(cfg.logging.telemetry_every, accelerator.device)
    max_norm = tc.max_grad_norm or math.inf  # clipping at inf still measures the norm, for the guard
    loss_sum = torch.zeros((), device=accelerator.device)  # summed on device: no sync per step
    step_loss = torch.zeros((), device=accelerator.device)
    micro, wait, tokens = 0, 0.0, 0  # since the last log line
    eval_loss, t_log = None, time.perf_counter()
    model.train()
    while state.step < tc.max_steps:
        t_data = time.perf_counter()
        ids = next(batches)
        wait += time.perf_counter() - t_data
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)  # under DeepSpeed this also steps at the boundary
            step_loss += loss.detach()
            if accelerator.sync_gradients:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
                verdict = guard.check(state, step_loss, grad_norm)  # ranks agree: update? stop? (1 sync)
                if verdict.update:
                    optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        micro += 1
        tokens += tokens_per_batch
        state.tokens_seen += tokens_per_batch
        if not accelerator.sync_gradients:
            continue

        if verdict.update and not accelerator.optimizer_step_was_skipped:
            scheduler.step()
        loss_sum += step_loss
        step_loss.zero_()
        state.step += 1
        metrics.advance()
        if telemetry.due(state.step):  # before the log line below resets the data-wait window
            telemetry.record(metrics, state.step, data_wait_frac=wait / (time.perf_counter() - t_log))
        last = state.step == tc.max_steps
        if state.step % tc.log_every == 0 or last:
            elapsed = time.perf_counter() - t_log
            mean_loss = accelerator.reduce(loss_sum, reduction="mean").item() / micro
            metrics.train(
                state.step, loss=mean_loss, lr=scheduler.get_last_lr()[0],
                grad_norm=None if grad_norm is None else float(grad_norm),
                tokens_per_s=tokens / elapsed, data_wait_frac=wait / elapsed, epoch=state.epoch,
                tokens_seen=state.tokens_seen, nonfinite_steps=state.nonfinite_steps,
            )
            loss_sum.zero_()
            t_log, micro, wait, tokens = time.perf_counter(), 0, 0.0, 0
        if state.step % tc.eval_every == 0 or last:
            eval_loss = evaluate(accelerator, model, valid_loader, tc.eval_batches)
            metrics.eval(state.step, eval_loss=eval_loss, eval_ppl=math.exp(min(eval_loss, 50.0)))
        stop = verdict.stop or state.step == tc.stop_at_step
        if checkpointer.due(state.step) or last or stop:
            checkpointer.save(state, model)
        if stop:
            break
    return eval_loss
