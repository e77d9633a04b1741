"""One run: check the config, build everything from it, train, save. Called by __main__."""

from __future__ import annotations

import logging
import os
from functools import partial
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from trainloop.config import ConfigError, validate

log = logging.getLogger("trainloop")


def check_complete(cfg: DictConfig) -> None:
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError("required keys have no value: " + ", ".join(missing)
                          + " (set them on the command line, e.g. KEY=VALUE)")


def run(cfg: DictConfig, run_dir: str | os.PathLike) -> float | None:
    """Train with `cfg`, writing into `run_dir`; return the last validation loss."""
    check_complete(cfg)
    validate(cfg)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # offline by default; HF_HUB_OFFLINE=0 to download

    from accelerate.utils import set_seed

    from trainloop.batch_size import batch_size_advice, settle_batch_size, tensor_core_multiple
    from trainloop.checkpoint import Checkpointer, Preempted, Preemption
    from trainloop.compile import compile_model
    from trainloop.data import build_dataloaders, build_datasets, build_tokenizer
    from trainloop.distributed import agree_run_dir, build_accelerator, check_batch_fits, describe_parallelism
    from trainloop.export import export_model
    from trainloop.guard import StepGuard
    from trainloop.loop import TrainState, train
    from trainloop.metrics import Metrics
    from trainloop.model import build_model, build_model_config, context_length
    from trainloop.optim import build_optimizer, build_scheduler

    logging.getLogger("accelerate").setLevel(logging.WARNING)  # its per-save INFO lines are noise
    accelerator = build_accelerator(cfg)
    run_dir = agree_run_dir(accelerator, run_dir)
    if not accelerator.is_main_process:
        log.setLevel(logging.WARNING)
    checkpointer = Checkpointer(cfg, accelerator, run_dir)
    resume_from = checkpointer.find_resume()

    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.model.name_or_path)
    model_config = build_model_config(cfg.model, len(tokenizer))
    if cfg.data.seq_len > context_length(model_config):
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} is longer than the model's context of "
                          f"{context_length(model_config)} tokens; lower data.seq_len")
    with accelerator.main_process_first():
        train_set, valid_set = build_datasets(cfg.data, tokenizer, cfg.trainer.seed)

    on_cuda = accelerator.device.type == "cuda"
    set_seed(cfg.trainer.seed)
    model = build_model(cfg.model, model_config)
    make_optimizer = partial(build_optimizer, cfg.optimizer, model, on_cuda=on_cuda,
                             cpu_offload=bool(cfg.deepspeed.stage) and cfg.deepspeed.offload_optimizer != "none")
    batch_search = None
    if cfg.trainer.auto_batch_size:  # sets data.batch_size and the accumulation in cfg
        batch_search = settle_batch_size(cfg, accelerator, model, train_set, make_optimizer, resume_from)
    advice = batch_size_advice({"data.batch_size": cfg.data.batch_size, "data.seq_len": cfg.data.seq_len,
                                "hidden size": model_config.hidden_size, "vocab size": model_config.vocab_size},
                               tensor_core_multiple(cfg.precision.name, accelerator.device))
    if advice and accelerator.is_main_process:  # the same advice for every rank: said once
        log.warning(advice)
    check_batch_fits(cfg, accelerator.num_processes, len(train_set))
    train_loader, valid_loader = build_dataloaders(cfg.data, train_set, valid_set,
                                                   pin_memory=cfg.data.pin_memory and on_cuda)
    compile_model(cfg.compile, model)  # in place: parameter names keep no `_orig_mod.` prefix
    optimizer = make_optimizer()
    scheduler = build_scheduler(cfg.scheduler, optimizer, cfg.trainer.max_steps)
    # The scheduler is stepped by the loop once per optimizer step; accelerate would step a
    # prepared one num_processes times, changing the schedule with the world size.
    model, optimizer, train_loader, valid_loader = accelerator.prepare(model, optimizer, train_loader, valid_loader)
    accelerator.register_for_checkpointing(scheduler)

    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    log.info("run dir %s | %s | model %.2fM parameters | %d train / %d valid blocks of %d tokens",
             run_dir, describe_parallelism(cfg, accelerator, model), n_params / 1e6, len(train_set),
             len(valid_set), cfg.data.seq_len)
    state = TrainState()
    if resume_from is not None:
        checkpointer.load(resume_from, state)
        from trainloop.deepspeed import restore_cpu_adam_step_count
        restore_cpu_adam_step_count(optimizer)  # bitwise resume under optimizer offload (see there)
    metrics = Metrics(run_dir, accelerator.is_main_process, cfg.trainer.max_steps, state.step,
                      cfg.logging.progress_bar, accelerator.num_processes)
    if batch_search is not None:
        metrics.write(batch_search.record(accelerator.num_processes))
    guard = StepGuard(cfg, accelerator, checkpointer, Preemption())
    try:
        with guard.preemption:  # SIGTERM/SIGUSR1/Ctrl-C: finish the step, save, raise Preempted
            eval_loss = train(cfg, accelerator, model, optimizer, scheduler, train_loader, valid_loader,
                              state, metrics, checkpointer, guard)
            if guard.preempted_by:
                accelerator.end_training()
                raise Preempted(f"stopped by {guard.preempted_by} after step {state.step}, checkpoint "
                                f"saved in {checkpointer.last_good()}; run the same command again to continue")
    finally:
        metrics.close()
    if state.step < cfg.trainer.max_steps:
        log.info("stopped at trainer.stop_at_step=%d of %d; run again with trainer.stop_at_step=null "
                 "to continue", state.step, cfg.trainer.max_steps)
    elif cfg.checkpoint.save_final_model:
        export_model(accelerator, model, tokenizer, Path(run_dir) / "final")
    accelerator.end_training()
    return eval_loss
