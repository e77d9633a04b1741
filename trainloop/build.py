"""The one build: tokenizer, data, model, adapter, compile, sharding, optimizer and scheduler, in
the one order that works, for the run, the planner's measurement and the benchmarks alike.

The order matters: the adapter wraps the model (or precision=fp8 swaps its linear layers) before compile, compile comes before sharding
(torchtitan's order: the compiled blocks are sharded), the optimizer is built on the sharded
parameters, and accelerate prepares what the strategy leaves to it. What differs between callers
is given, not branched on: a run's checkpointer checks the data against its checkpoint, a
benchmark hands in blocks it tokenized once, the planner measures from `before_model` on. An
objective that keeps a frozen copy of the model (DPO's reference for a full fine-tune) takes it as
built, before compile and sharding; the strategy shards it like the policy.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

log = logging.getLogger("trainloop")


@dataclass
class Built:
    """Everything a run trains with, built from the config."""

    strategy: Any  # trainloop.parallel.Strategy
    objective: Any  # trainloop.objectives.Objective
    tokenizer: Any
    model_config: Any
    samples: Any  # trainloop.observe.samples.Samples, or None without eval.prompts
    harness: Any  # trainloop.observe.harness.Harness, or None without eval.harness.tasks
    train_set: Any
    valid_set: Any
    model: Any
    optimizer: Any
    scheduler: Any
    train_loader: Any
    valid_loader: Any
    flops_per_token: float
    batch_size: int  # the per-device micro-batch the run takes: data.batch_size, or the one trainer.auto_batch_size settled
    accumulation: int  # micro-batches per optimizer step: trainer.gradient_accumulation_steps, or the settled one
    batch_search: Any = None  # trainloop.memory.batch_size.BatchSearch with trainer.auto_batch_size


def settle_learning_rate(cfg) -> str | None:
    """Set optimizer.lr where the config sets none (None): for a pretrained model (model=hf) the
    objective's default, TRL's for the same trainer (Objective.pretrained_lr: a from-scratch rate of
    1e-3 wrecks a pretrained model within a few steps), else the optimizer's from-scratch default.
    Returns what the start-up line says of a default it took; None where the config set the rate."""
    from trainloop.objectives import OBJECTIVES
    from trainloop.optim.optimizers import optimizer_named

    if cfg.optimizer.lr is not None:
        return None
    if cfg.model.name == "hf":
        lr, source = OBJECTIVES[cfg.objective.name].pretrained_lr
        cfg.optimizer.lr = lr
        return f"lr {lr:g}: objective={cfg.objective.name}'s default for a pretrained model (TRL's {source})"
    cfg.optimizer.lr = optimizer_named(cfg.optimizer.name).scratch_lr
    return f"lr {cfg.optimizer.lr:g}: optimizer={cfg.optimizer.name}'s default for a model trained from scratch"


def build(cfg, strategy, *, run_dir=None, checkpointer=None, resume_from=None, blocks=None,
          before_model: Callable[[], None] | None = None) -> Built:
    """Build a run from `cfg` on `strategy` (trainloop.parallel.build_strategy).

    run_dir: the data is built once per node there (not inside a collective); without it, here.
    checkpointer: checks the data against the checkpoint being resumed (`resume_from`), which
    also fixes an auto batch size. blocks: (train, valid) datasets already built (a benchmark's),
    instead of building them from cfg.data. before_model: called just before the model is built.
    """
    import torch
    from accelerate.utils import set_seed

    from trainloop.data.loaders import (
        build_dataloaders, carry_chat_template, check_batch_fits, run_tokenizer, trained_chat_template,
    )
    from trainloop.data.mixture import build_training_data
    from trainloop.data.node_turns import build_once_per_node
    from trainloop.data.order import GlobalOrder
    from trainloop.errors import ConfigError
    from trainloop.memory.batch_size import batch_size_advice, settle_batch_size, tensor_core_multiple
    from trainloop.model import fp8
    from trainloop.model.adapter import apply_adapter, check_targets
    from trainloop.model.attention import training_attention, use as use_attention
    from trainloop.model.builder import build_model, build_model_config, context_length, special_token_ids
    from trainloop.model.compile import compile_model
    from trainloop.objectives import build_objective, items, prompt_tools
    from trainloop.model.flops import flops_per_token, trained_matmul_params
    from trainloop.model.vision import freeze, image_token_id, is_vision, processor_of
    from trainloop.observe.harness import Harness
    from trainloop.observe.samples import Samples
    from trainloop.optim.optimizers import build_optimizer, build_scheduler, compile_optimizer
    from trainloop.parallel import check_context_model, own_attention

    settle_learning_rate(cfg)  # a run settled it already; the planner's measurement and the benchmarks here
    accelerator = strategy.accelerator
    tokenizer = run_tokenizer(cfg)
    processor = processor_of(tokenizer)  # a vision-language model's (data=vision_chat), else None
    carry_chat_template(tokenizer, trained_chat_template(cfg.data, tokenizer))  # final/ is prompted as trained
    objective = build_objective(cfg, strategy.device)
    if objective.head == "score" and tokenizer.pad_token is None:  # where the score is read: as TRL sets it
        tokenizer.pad_token = tokenizer.eos_token
    token_ids = special_token_ids(tokenizer)
    if processor is not None:
        token_ids["image_token_id"] = image_token_id(processor)
    model_config = build_model_config(cfg.model, len(tokenizer), token_ids)
    if (processor is not None) != is_vision(model_config):
        raise ConfigError("data=vision_chat trains a vision-language model, and only it: model.arch=llava, or "
                          "model=hf with a vision-language model's directory" if processor is not None else
                          f"this model is a vision-language model ({type(model_config).__name__}): train it on "
                          "data=vision_chat")
    if cfg.data.seq_len > context_length(model_config):
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} is longer than the model's context of "
                          f"{context_length(model_config)} tokens; lower data.seq_len")
    check_targets(cfg.adapter, model_config, objective.head)
    check_context_model(cfg, model_config)
    samples = Samples.for_config(cfg, tokenizer, context_length(model_config))  # its prompts checked before compute
    harness = Harness.for_config(cfg, tokenizer)  # its tasks found and loaded before compute
    if blocks is not None:
        train_set, valid_set = blocks
    elif run_dir is not None:  # not inside a collective: tokenizing a large corpus outlasts trainer.collective_timeout_s
        train_set, valid_set, data_print = build_once_per_node(
            strategy, run_dir, partial(build_training_data, cfg.data, tokenizer, cfg.trainer.seed, prompt_tools(cfg)))
        if checkpointer is not None:
            checkpointer.check_data(data_print)
    else:
        train_set, valid_set, _ = build_training_data(cfg.data, tokenizer, cfg.trainer.seed, prompt_tools(cfg))

    if before_model is not None:
        before_model()
    set_seed(cfg.trainer.seed)
    shapes_only = strategy.builds_on_meta()  # its weights come from the main process when sharded
    with torch.device("meta") if shapes_only else nullcontext():
        model = build_model(cfg.model, model_config, cfg.precision.name, shapes_only, objective.head)
        needed = own_attention(cfg)  # the key of a layout that needs it for every objective, or None
        attention = training_attention(cfg, model_config, items(objective) is None, needed is not None)
        if attention is not None:
            use_attention(model, attention, needed or f"data.packing={cfg.data.packing}")
        if cfg.model.freeze:
            log.info("model.freeze=%s: %s parameters not trained", list(cfg.model.freeze),
                     f"{freeze(model, cfg.model.freeze):,}")
        if cfg.adapter.name != "none":
            model = apply_adapter(cfg, model, objective.head)
        if fp8.enabled(cfg):  # before compile and sharding, as torchtitan converts
            fp8.convert(cfg, model, strategy.device)
    frozen = objective.frozen_copy(model)  # a reference copy of the model as built: sharded like it below
    flops = flops_per_token(model_config, cfg.data.seq_len, model=model,  # before sharding: whole parameters
                            trained_matmul_params=trained_matmul_params(model) if cfg.adapter.name != "none" else None)
    if frozen is not None:  # a teacher's forward: counted by MFU with the policy's
        flops += objective.frozen_flops(frozen, cfg.data.seq_len)
    on_cuda = strategy.device.type == "cuda"
    make_optimizer = partial(build_optimizer, cfg.optimizer, model, on_cuda=on_cuda,
                             cpu_offload=strategy.optimizer_offloaded())
    batch_search, batch_size, accumulation = None, cfg.data.batch_size, cfg.trainer.gradient_accumulation_steps
    if cfg.trainer.auto_batch_size:  # the run takes the settled batch from here on; cfg keeps what was asked
        batch_search = settle_batch_size(cfg, strategy, objective, model, train_set, make_optimizer, resume_from)
        batch_size, accumulation = batch_search.batch_size, batch_search.accumulation
        accelerator.gradient_accumulation_steps = accumulation  # what its backward divides by
    advice = batch_size_advice({"data.batch_size": batch_size, "data.seq_len": cfg.data.seq_len,
                                "hidden size": model_config.get_text_config().hidden_size,
                                "vocab size": model_config.get_text_config().vocab_size},
                               tensor_core_multiple(cfg.precision.name, strategy.device))
    if advice and accelerator.is_main_process:  # the same advice for every rank: said once
        log.warning(advice)

    check_batch_fits(cfg, strategy.dp_size, len(train_set))  # a settled batch keeps batch x accumulation
    train_set.whole_batches(batch_size * accumulation * strategy.dp_size)  # a mixture's epochs meet
    order = GlobalOrder(len(train_set), cfg.trainer.seed, batch_size, accumulation, strategy.dp_size,
                        strategy.dp_rank, shuffle=not train_set.orders_itself)  # a mixture's schedule is its order
    train_loader, valid_loader = build_dataloaders(cfg.data, train_set, valid_set,
                                                   pin_memory=cfg.data.pin_memory and on_cuda, order=order)
    compile_model(cfg.compile, model)  # in place: parameter names keep no `_orig_mod.` prefix
    model = strategy.shard(model)  # compiled blocks, then sharded; before the optimizer
    optimizer = make_optimizer()
    # Stepped by the loop once per optimizer step; accelerate would step a prepared one once per
    # process, changing the schedule with the world size.
    scheduler = build_scheduler(cfg.scheduler, optimizer, cfg.trainer.max_steps)
    # The loaders are already this rank's share (trainloop.data.order): accelerate must not shard them again.
    model, optimizer = strategy.prepare(model, optimizer)
    compile_optimizer(cfg, optimizer)  # compile.optimizer: where it pays, its step one generated loop
    model = strategy.install(model)
    accelerator.register_for_checkpointing(scheduler)
    objective.start(strategy, model, None if frozen is None else strategy.install(strategy.prepare_frozen(frozen)),
                    train_set, valid_set, run_dir)
    return Built(strategy, objective, tokenizer, model_config, samples, harness, train_set, valid_set, model, optimizer,
                 scheduler, train_loader, valid_loader, flops, batch_size, accumulation, batch_search)
