"""One run: check the config, build everything from it, train, save. Called by __main__."""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from functools import partial
from pathlib import Path

from omegaconf import DictConfig

from trainloop.config import check_complete, validate
from trainloop.errors import ConfigError
from trainloop.rundir import LaunchRecord, hold_run_dir

log = logging.getLogger("trainloop")


def is_main_rank() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def run(cfg: DictConfig, run_dir: str | os.PathLike, record: LaunchRecord | None = None) -> float | None:
    """Train with `cfg`, writing into `run_dir`; return the last validation loss.

    The main rank holds run_dir until the run ends (its run dir is the one every rank agrees
    on); `record`, this launch's Hydra files, is written to run_dir/.hydra once the run is
    accepted: config, data and checkpoint checked, just before the first step.
    """
    check_complete(cfg)
    validate(cfg)
    with hold_run_dir(run_dir) if is_main_rank() else nullcontext():
        return train_in_run_dir(cfg, run_dir, record)


def train_in_run_dir(cfg: DictConfig, run_dir: str | os.PathLike, record: LaunchRecord | None) -> float | None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # offline by default; HF_HUB_OFFLINE=0 to download

    import torch
    from accelerate.utils import set_seed

    from trainloop.accelerator import agree_run_dir, build_accelerator
    from trainloop.adapter import apply_adapter, check_targets
    from trainloop.batch_size import batch_size_advice, settle_batch_size, tensor_core_multiple
    from trainloop.checkpoint import Checkpointer
    from trainloop.compile import compile_model
    from trainloop.data import (build_dataloaders, build_tokenizer, carry_chat_template, check_batch_fits,
                                trained_chat_template)
    from trainloop.deepspeed import restore_cpu_adam_step_count
    from trainloop.errors import Preempted
    from trainloop.flops import flops_per_token, peak_tflops, trained_matmul_params
    from trainloop.export import export_model
    from trainloop.fsdp import builds_on_meta, shard_model
    from trainloop.guard import StepGuard
    from trainloop.loop import TrainState, train
    from trainloop.metrics import Metrics, library_progress_bars
    from trainloop.mixture import build_training_data
    from trainloop.model import build_model, build_model_config, context_length, special_token_ids
    from trainloop.node_turns import build_once_per_node
    from trainloop.optim import build_optimizer, build_scheduler
    from trainloop.order import GlobalOrder
    from trainloop.parallel import describe, full_numel
    from trainloop.preemption import Preemption
    from trainloop.samples import Samples
    from trainloop.trackers import Trackers

    logging.getLogger("accelerate").setLevel(logging.WARNING)  # its per-save INFO lines are noise
    library_progress_bars(cfg.logging.progress_bar, loads_rows=cfg.data.name != "prepared")
    accelerator = build_accelerator(cfg)
    run_dir = agree_run_dir(accelerator, run_dir)
    if not accelerator.is_main_process:
        log.setLevel(logging.WARNING)
    checkpointer = Checkpointer(cfg, accelerator, run_dir)
    resume_from = checkpointer.find_resume()

    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.model.name_or_path)
    carry_chat_template(tokenizer, trained_chat_template(cfg.data, tokenizer))  # final/ is prompted as trained
    model_config = build_model_config(cfg.model, len(tokenizer), special_token_ids(tokenizer))
    if cfg.data.seq_len > context_length(model_config):
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} is longer than the model's context of "
                          f"{context_length(model_config)} tokens; lower data.seq_len")
    check_targets(cfg.adapter, model_config)
    samples = Samples.for_config(cfg, tokenizer, context_length(model_config))  # its prompts checked before compute
    # not inside a collective: tokenizing a large corpus outlasts trainer.collective_timeout_s
    train_set, valid_set, data_print = build_once_per_node(
        accelerator, run_dir, partial(build_training_data, cfg.data, tokenizer, cfg.trainer.seed))
    checkpointer.check_data(data_print)

    on_cuda = accelerator.device.type == "cuda"
    set_seed(cfg.trainer.seed)
    shapes_only = builds_on_meta(cfg, accelerator)  # FSDP2: the main process's weights fill it in shard_model
    with torch.device("meta") if shapes_only else nullcontext():
        model = build_model(cfg.model, model_config, cfg.precision.name, shapes_only)
        if cfg.adapter.name != "none":
            model = apply_adapter(cfg, model)
    flops = flops_per_token(model_config, cfg.data.seq_len, model=model,  # before sharding: whole parameters
                            trained_matmul_params=trained_matmul_params(model) if cfg.adapter.name != "none" else None)
    make_optimizer = partial(build_optimizer, cfg.optimizer, model, on_cuda=on_cuda,
                             cpu_offload=bool(cfg.deepspeed.stage) and cfg.deepspeed.offload_optimizer != "none")
    batch_search = None
    if cfg.trainer.auto_batch_size:  # the run takes the settled batch from here on, and records it
        batch_search = settle_batch_size(cfg, accelerator, model, train_set, make_optimizer, resume_from)
        cfg.data.batch_size = batch_search.batch_size
        cfg.trainer.gradient_accumulation_steps = accelerator.gradient_accumulation_steps = batch_search.accumulation
    advice = batch_size_advice({"data.batch_size": cfg.data.batch_size, "data.seq_len": cfg.data.seq_len,
                                "hidden size": model_config.hidden_size, "vocab size": model_config.vocab_size},
                               tensor_core_multiple(cfg.precision.name, accelerator.device))
    if advice and accelerator.is_main_process:  # the same advice for every rank: said once
        log.warning(advice)
    check_batch_fits(cfg, accelerator.num_processes, len(train_set))
    if hasattr(train_set, "whole_batches"):  # a mixture's epochs meet: the loader drops no tail
        train_set.whole_batches(cfg.data.batch_size * accelerator.gradient_accumulation_steps * accelerator.num_processes)
    order = GlobalOrder(len(train_set), cfg.trainer.seed, cfg.data.batch_size, cfg.trainer.gradient_accumulation_steps,
                        accelerator.num_processes, accelerator.process_index,
                        shuffle=not getattr(train_set, "orders_itself", False))  # a mixture's schedule is its order
    train_loader, valid_loader = build_dataloaders(cfg.data, train_set, valid_set,
                                                   pin_memory=cfg.data.pin_memory and on_cuda, order=order)
    compile_model(cfg.compile, model)  # in place: parameter names keep no `_orig_mod.` prefix
    if cfg.fsdp.name != "none":  # compiled blocks, then sharded (torchtitan's order); before the optimizer
        shard_model(cfg, model, accelerator.device)
    optimizer = make_optimizer()
    scheduler = build_scheduler(cfg.scheduler, optimizer, cfg.trainer.max_steps)
    # The scheduler is stepped by the loop once per optimizer step; accelerate would step a
    # prepared one num_processes times, changing the schedule with the world size.
    # The training loader is already this rank's share of the global order: accelerate must not shard it again.
    if cfg.fsdp.name != "none":  # sharded by trainloop: accelerate must not wrap it in DDP too
        optimizer, valid_loader = accelerator.prepare(optimizer, valid_loader)
    else:
        model, optimizer, valid_loader = accelerator.prepare(model, optimizer, valid_loader)
    accelerator.register_for_checkpointing(scheduler)

    n_params = sum(full_numel(p) for p in model.parameters())
    n_trained = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
    experts = getattr(model_config, "num_local_experts", None)  # a mixture of experts (model.arch=mixtral)
    routing = f"; {experts} experts per block, {model_config.num_experts_per_tok} per token" if experts else ""
    log.info("run dir %s | %s | model %.2fM parameters (%.2fM trained%s) | %d train / %d valid blocks of %d tokens",
             run_dir, describe(cfg, accelerator, model), n_params / 1e6, n_trained / 1e6, routing, len(train_set),
             len(valid_set), cfg.data.seq_len)
    state = TrainState()
    if resume_from is not None:
        checkpointer.load(resume_from, state, model)
        restore_cpu_adam_step_count(optimizer)  # bitwise resume under optimizer offload (see there)
    if record is not None and accelerator.is_main_process:
        record.write(run_dir)
    trackers = Trackers.start(accelerator, cfg, run_dir)  # None with logging.trackers=[]
    metrics = Metrics(run_dir, accelerator.is_main_process, cfg.trainer.max_steps, state.step,
                      cfg.logging.progress_bar, accelerator.num_processes, flops_per_token=flops,
                      peak_tflops=peak_tflops(accelerator.device, cfg.precision.name, cfg.logging.peak_tflops)
                      if accelerator.is_main_process else None, trackers=trackers)
    if batch_search is not None:
        metrics.write(batch_search.record(accelerator.num_processes))
    guard = StepGuard(cfg, accelerator, checkpointer, Preemption())
    try:
        with guard.preemption:  # SIGTERM/SIGUSR1/Ctrl-C: finish the step, save, raise Preempted
            eval_loss = train(cfg, accelerator, model, optimizer, scheduler, train_loader, valid_loader,
                              state, metrics, checkpointer, guard, samples)
            if guard.preempted_by:  # the last line says so: a job script's cue to requeue (scripts/slurm.sbatch)
                metrics.write({"step": state.step, "event": "preempted", "by": guard.preempted_by,
                               "checkpoint": str(checkpointer.last_good())})
                accelerator.end_training()
                raise Preempted(f"stopped by {guard.preempted_by} after step {state.step}, checkpoint "
                                f"saved in {checkpointer.last_good()}; run the same command again to continue")
        if state.step < cfg.trainer.max_steps:
            log.info("stopped at trainer.stop_at_step=%d of %d; run again with trainer.stop_at_step=null "
                     "to continue", state.step, cfg.trainer.max_steps)
        elif cfg.checkpoint.save_final_model:  # a failed export fails the run in the trackers too
            metrics.close()  # the bar ends before the export logs
            export_model(accelerator, model, tokenizer, Path(run_dir) / "final", cfg)
    except Preempted:
        raise  # end_training above finished the trackers
    except BaseException:
        if trackers is not None:  # flushed and closed, each tracker's run marked failed where it can be
            trackers.fail()
        raise
    finally:
        metrics.close()
    end_distributed(accelerator)
    return eval_loss


def end_distributed(accelerator) -> None:
    """Tear the process group down only once every rank has finished every collective.

    2-process runs that had saved their final model sometimes lost rank 1 to SIGABRT at exit
    (`terminate called without an active exception`). The ranks leave the last broadcast at
    different times (the sender returns before the receiver has read), and DDP keeps the gloo
    backend and its native threads alive until the process ends whatever destroy_process_group
    does, so one rank's exit, which closes its connections, could overlap a peer still talking
    to it. After this barrier no rank has anything in flight with another.
    """
    if accelerator.num_processes > 1:
        accelerator.wait_for_everyone()
    accelerator.end_training()
