"""One run: check the config, build everything from it, train, save. Called by __main__."""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig

from trainloop.config.compose import ConfigError, check_command_line, check_complete, validate
from trainloop.rundir import LaunchRecord, hold_run_dir, same_command

log = logging.getLogger("trainloop")


def is_main_rank() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def run(cfg: DictConfig, run_dir: str | os.PathLike, record: LaunchRecord | None = None,
        overrides: Sequence[str] = ()) -> float | None:
    """Train with `cfg`, writing into `run_dir`; return the last validation loss. `overrides`: what the
    user gave (the command line, trainloop.train's list), whose keys the chosen options must read.

    The main rank holds run_dir until the run ends (its run dir is the one every rank agrees
    on); `record`, this launch's Hydra files, is written to run_dir/.hydra once the run is
    accepted: config, data and checkpoint checked, just before the first step.
    """
    from trainloop.parallel.process_group import distributed_as_found

    from trainloop.build import settle_learning_rate

    try:
        check_command_line(cfg, overrides)
        check_complete(cfg)
        validate(cfg)
    except ConfigError as err:
        err.every_rank = True  # each rank refuses the same config: under a launcher the main rank alone says so
        raise
    settled = settle_learning_rate(cfg)  # before anything reads optimizer.lr: the checkpoint's config records it
    with hold_run_dir(run_dir) if is_main_rank() else nullcontext(), distributed_as_found():
        return train_in_run_dir(cfg, run_dir, record, settled)


def train_in_run_dir(cfg: DictConfig, run_dir: str | os.PathLike, record: LaunchRecord | None,
                     settled: str | None = None) -> float | None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # offline by default; HF_HUB_OFFLINE=0 to download

    from trainloop.build import build
    from trainloop.checkpoint.checkpointer import Checkpointer
    from trainloop.data.formats import data_format
    from trainloop.errors import Preempted
    from trainloop.export import export_model
    from trainloop.guard import StepGuard
    from trainloop.loop import TrainState, train
    from trainloop.memory.batch_size import with_batch
    from trainloop.memory.proc import host_allocator
    from trainloop.model.flops import peak_tflops
    from trainloop.observe.metrics import Metrics, library_progress_bars, shows_bar
    from trainloop.observe.trackers import Trackers
    from trainloop.parallel import build_strategy
    from trainloop.parallel.accelerator import agree_run_dir, build_accelerator
    from trainloop.preemption import Preemption

    logging.getLogger("accelerate").setLevel(logging.WARNING)  # its per-save INFO lines are noise
    bar = shows_bar(cfg.logging.progress_bar)
    library_progress_bars(bar, loads_rows=data_format(cfg.data.name).loads_rows)
    accelerator = build_accelerator(cfg)
    strategy = build_strategy(cfg, accelerator)
    run_dir = agree_run_dir(accelerator, run_dir)
    if not accelerator.is_main_process:
        log.setLevel(logging.WARNING)
    checkpointer = Checkpointer(cfg, strategy, run_dir)
    resume_from = checkpointer.find_resume()
    built = build(cfg, strategy, run_dir=run_dir, checkpointer=checkpointer, resume_from=resume_from)
    model, model_config, train_set = built.model, built.model_config, built.train_set
    recorded = cfg  # what the run's records state as its config: the batch it takes included
    if built.batch_search is not None:
        recorded = with_batch(cfg, built.batch_size, built.accumulation)
    checkpointer.record_config(recorded)
    checkpointer.objective = built.objective

    n_params, n_trained = strategy.count_parameters(model)
    experts = getattr(model_config, "num_local_experts", None)  # a mixture of experts (model.arch=mixtral)
    routing = f"; {experts} experts per block, {model_config.num_experts_per_tok} per token" if experts else ""
    log.info("run dir %s | %s | model %.2fM parameters (%.2fM trained%s) | %d train / %d valid blocks of %d tokens%s",
             run_dir, strategy.describe(model), n_params / 1e6, n_trained / 1e6, routing, len(train_set),
             len(built.valid_set), cfg.data.seq_len, f" | {settled}" if settled and cfg.model.name == "hf" else "")
    malloc = host_allocator()  # "" off Linux; __main__.with_jemalloc chose it
    if malloc:
        log.info("host malloc: %s%s", malloc, " (TRAINLOOP_MALLOC=glibc keeps glibc's)" if malloc == "jemalloc" else "")
    state = TrainState()
    if resume_from is not None:
        checkpointer.load(resume_from, state, model, built.scheduler)
    if record is not None and accelerator.is_main_process:
        record.write(run_dir)
    trackers = Trackers.start(accelerator, recorded, run_dir)  # None with logging.trackers=[]
    metrics = Metrics(run_dir, accelerator.is_main_process, cfg.trainer.max_steps, state.step,
                      bar, strategy.world_size, flops_per_token=built.flops_per_token,
                      peak_tflops=peak_tflops(accelerator.device, cfg.precision.name, cfg.logging.peak_tflops)
                      if accelerator.is_main_process else None, trackers=trackers, headline=built.objective.headline)
    if built.batch_search is not None:
        metrics.write(built.batch_search.record(strategy.dp_size))
    guard = StepGuard(cfg, strategy, checkpointer, Preemption(), built.optimizer, built.scheduler)
    try:
        with guard.preemption:  # SIGTERM/SIGUSR1/Ctrl-C: finish the step, save, raise Preempted
            eval_loss = train(cfg, strategy, built.objective, model, built.optimizer, built.scheduler,
                              built.train_loader, built.valid_loader, state, metrics, checkpointer, guard, built.samples,
                              built.harness)
            if guard.preempted_by:  # the last line says so: a job script's cue to requeue (scripts/slurm.sbatch)
                metrics.write({"step": state.step, "event": "preempted", "by": guard.preempted_by,
                               "checkpoint": str(checkpointer.last_good())})
                end_training(accelerator)
                raise Preempted(f"stopped by {guard.preempted_by} after step {state.step}, checkpoint "
                                f"saved in {checkpointer.last_good()}; run {same_command(run_dir)} again to continue")
        if state.step < cfg.trainer.max_steps:
            log.info("stopped at trainer.stop_at_step=%d of %d; run %s to continue", state.step,
                     cfg.trainer.max_steps, same_command(run_dir, "trainer.stop_at_step=null"))
        elif cfg.checkpoint.save_final_model:  # a failed export fails the run in the trackers too
            metrics.close()  # the bar ends before the export logs
            export_model(strategy, model, built.tokenizer, Path(run_dir) / "final", cfg)
    except Preempted:
        raise  # end_training above finished the trackers
    except BaseException:
        if trackers is not None:  # flushed and closed, each tracker's run marked failed where it can be
            trackers.fail()
        raise
    finally:
        metrics.close()
    end_distributed(strategy)
    return eval_loss


def end_distributed(strategy) -> None:
    """Tear the process group down only once every rank has finished every collective.

    2-process runs that had saved their final model sometimes lost rank 1 to SIGABRT at exit
    (`terminate called without an active exception`). The ranks leave the last broadcast at
    different times (the sender returns before the receiver has read), and DDP keeps the gloo
    backend and its native threads alive until the process ends whatever destroy_process_group
    does, so one rank's exit, which closes its connections, could overlap a peer still talking
    to it. After this barrier no rank has anything in flight with another.
    """
    if strategy.world_size > 1:
        strategy.accelerator.wait_for_everyone()
    end_training(strategy.accelerator)


def end_training(accelerator) -> None:
    """accelerate's end_training (the trackers finished, the process group destroyed), the group
    still referenced until the process ends: DDP's reducer must not hold its last reference."""
    from trainloop.parallel.process_group import hold_default_group

    hold_default_group()
    accelerator.end_training()
