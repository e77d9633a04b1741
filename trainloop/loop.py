"""The training loop: the schedule around the step (trainloop.step): data, log, eval, save, stop."""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, field

import torch

from trainloop.data.mixture import source_names
from trainloop.memory.offload import ActivationOffload
from trainloop.model.attention import ON_HOST
from trainloop.observe.profiler import StepProfiler
from trainloop.observe.telemetry import Telemetry
from trainloop.step import train_step


@dataclass
class TrainState:
    """The trainer's own progress. Checkpointed with the model so a resume continues exactly."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0
    samples_in_epoch: int = 0  # samples of this epoch already consumed, over all ranks (trainloop.data.order)
    tokens_seen: int = 0  # over all ranks
    tokens_per_source: dict = field(default_factory=dict)  # data.sources: tokens_seen by source name
    nonfinite_steps: int = 0  # updates skipped because the loss or gradient norm was NaN/Inf

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def batches_forever(accelerator, loader, state: TrainState):
    """Yield this rank's training batches epoch after epoch, on its device, keeping
    state.epoch/samples_in_epoch exact. The loader's batch_sampler is a trainloop.data.order.GlobalOrder:
    a resumed run starts mid-epoch at a sample position, not by loading data."""
    from accelerate.utils import send_to_device

    order = loader.batch_sampler
    consumed = order.batch_size * order.world_size  # by one micro-step of every rank
    while True:
        order.set_position(state.epoch, state.samples_in_epoch)  # the order is a function of (seed, epoch)
        loader.dataset.set_epoch(state.epoch)  # a mixture: the epoch's window of its schedule
        # Starting an epoch draws a worker seed from the global torch RNG; undo that draw, so
        # dropout does not depend on where a run was resumed. The iterator starts lazily.
        rng, batches = torch.get_rng_state(), iter(loader)
        first = next(batches, None)
        torch.set_rng_state(rng)
        for batch in itertools.chain([] if first is None else [first], batches):
            state.samples_in_epoch += consumed
            yield send_to_device(batch, accelerator.device, non_blocking=accelerator.non_blocking, skip_keys=ON_HOST)
        state.epoch += 1
        state.samples_in_epoch = 0


def step_batches(batches, accumulation: int) -> list[dict]:
    """The micro-batches of one optimizer step: an epoch holds whole global batches only (trainloop.data.order)."""
    return [next(batches) for _ in range(accumulation)]


def train(cfg, strategy, objective, model, optimizer, scheduler, train_loader, valid_loader,
          state: TrainState, metrics, checkpointer, guard, samples=None, harness=None) -> float | None:
    """Run optimizer steps (trainloop.step) until trainer.max_steps (or a stop); return the last
    validation loss. `strategy` (trainloop.parallel) spreads the model over the processes,
    `objective` (trainloop.objectives) gives each micro-batch's loss; `samples` (trainloop.observe.samples,
    from eval.prompts) generates at every evaluation; `harness` (trainloop.observe.harness, from
    eval.harness) scores the model on its tasks at the steps it names."""
    tc, accelerator = cfg.trainer, strategy.accelerator
    # read once: a config lookup costs as much as a small op, and the loop reads these every step
    max_steps, stop_at_step, max_grad_norm = tc.max_steps, tc.stop_at_step, tc.max_grad_norm
    log_every, eval_every = tc.log_every, tc.eval_every
    order = train_loader.batch_sampler  # trainloop.data.order.GlobalOrder: the batch and accumulation the run takes
    tokens_per_batch = order.batch_size * objective.sequences * cfg.data.seq_len * strategy.dp_size
    batches = batches_forever(accelerator, train_loader, state)
    telemetry = Telemetry(cfg.logging.telemetry_every, accelerator.device)
    offload = ActivationOffload(tc.activation_offload, accelerator.device, say=True)  # the forward's saved tensors
    loss_sum = torch.zeros((), device=accelerator.device)  # summed on device: no sync per step
    steps, wait, tokens = 0, 0.0, 0  # since the last log line
    eval_loss, t_log = None, time.perf_counter()
    model.train()
    names = source_names(cfg.data)  # data.sources: the mixture's, counted per step
    source_tokens = torch.tensor([state.tokens_per_source.get(n, 0) for n in names], device=accelerator.device)
    # None unless logging.profile_steps
    profiler = StepProfiler.build(cfg.logging, accelerator, metrics.run_dir, state.step)
    try:
        while state.step < max_steps:
            t_data = time.perf_counter()
            group = step_batches(batches, order.accumulation) if objective.draws(state.step) else None
            wait += time.perf_counter() - t_data
            group = objective.step_batches(strategy, model, group, state.step)  # objective=grpo: its completions
            result = train_step(strategy, objective, model, optimizer, group, max_grad_norm=max_grad_norm,
                                forward_context=offload, check=guard.check, state=state, sources=len(names))
            if names:
                source_tokens += result.source_tokens
            steps += 1
            tokens += tokens_per_batch * len(group)
            state.tokens_seen += tokens_per_batch * len(group)

            guard.stepped(result.updated)  # the scheduler steps after an applied update
            loss_sum += result.loss
            state.step += 1
            metrics.advance()
            for record in checkpointer.poll(state.step):  # an asynchronous save written meanwhile: committed
                metrics.write(record)
            if telemetry.due(state.step):  # before the log line below resets the data-wait window
                telemetry.record(metrics, state.step, data_wait_frac=wait / (time.perf_counter() - t_log))
            last = state.step == max_steps
            stop = result.verdict.stop or state.step == stop_at_step
            evaluating, save_due = state.step % eval_every == 0 or last, checkpointer.due(state.step)
            if stop or evaluating or save_due or state.step % log_every == 0:
                stop = guard.settle(state) or stop  # this step's verdict, read now: the schedule needs it
            saving = save_due or last or stop
            # a stop (a signal, trainer.stop_at_step) writes the window so far: the resumed run logs the steps after it
            log_due = state.step % log_every == 0 or last or stop
            if names and (saving or log_due):  # on the host only when written: no sync per step
                state.tokens_per_source = dict(zip(names, source_tokens.tolist()))
            if log_due:
                elapsed = time.perf_counter() - t_log
                mean_loss = strategy.reduce_sum(loss_sum).item() / steps
                metrics.train(
                    state.step, loss=mean_loss, lr=scheduler.get_last_lr()[0],
                    grad_norm=None if result.grad_norm is None else float(result.grad_norm),
                    tokens_per_s=tokens / elapsed, data_wait_frac=wait / elapsed, epoch=state.epoch,
                    tokens_seen=state.tokens_seen, nonfinite_steps=state.nonfinite_steps,
                    **({"tokens_per_source": state.tokens_per_source} if names else {}),
                    **objective.window(strategy),
                )
                examples = objective.examples()  # objective=grpo: a few completions and their rewards
                if examples:
                    metrics.samples(state.step, examples)
                loss_sum.zero_()
                t_log, steps, wait, tokens = time.perf_counter(), 0, 0.0, 0
            if evaluating:
                evaluation = objective.evaluate(strategy, model, valid_loader, tc.eval_batches)
                eval_loss = evaluation["eval_loss"]
                metrics.eval(state.step, **evaluation)
                if samples is not None:
                    metrics.samples(state.step, samples.generate(strategy, model))
            if saving:
                # one save at a time: the one in flight commits first, recorded before the next begins
                for record in checkpointer.wait(state.step):
                    metrics.write(record)
                checkpointer.save(state, model)
            # after the save, which a failure here then cannot lose; not on the way out of a stop (a signal's grace)
            if harness is not None and harness.due(state.step, last) and (last or not stop):
                metrics.harness(state.step, harness.score(strategy, model))
            if profiler is not None:  # a profiled step holds its logging, eval and save too
                profiler.step(state.step)
            if stop:
                break
    finally:  # a window cut short by a stop (or an error) is saved with the steps it holds
        if profiler is not None:
            profiler.close()
    for record in checkpointer.wait(state.step):  # a save still being written commits before the run ends
        metrics.write(record)
    return eval_loss
