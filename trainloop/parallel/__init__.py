"""Which parallelism runs, and every question that depends on it, answered by one Strategy.

A row of STRATEGIES is chosen from the config (parallel.pp_size > 1, parallel.ep_size > 1, parallel.tp_size > 1,
fsdp=full_shard, deepspeed=zero*, else data parallel, which is also the one-process case). Before anything is
built its class answers the Accelerator's arguments, the checks of its keys, whether its checkpoints reshard,
the planner's and `plan --suggest`'s terms (memory, traffic, layouts) and the doctor's view; once built, how the
model is wrapped or sharded, gradients synchronised and clipped, state saved and loaded, the full state dict
gathered for export, the log line, and the data-parallel size and rank that the sample order, the loss
normalisation, the batch and the checkpoint fingerprint read. Outside this package only the config's composition
and checks read the strategies' keys. A parameter's full shape and local shard are asked in
trainloop.model.tensors, never by probing parameters elsewhere. A new strategy is one module with a Strategy
subclass and one row here (docs/extending.md).
"""

from __future__ import annotations

from trainloop.parallel.base import Strategy, running
from trainloop.parallel.ddp import DataParallel
from trainloop.parallel.ep import ExpertParallel
from trainloop.parallel.degrees import builds_partitioned, context_size, one_forward_only, own_attention, splits
from trainloop.parallel.fsdp2 import FSDP2
from trainloop.parallel.hsdp import HybridShard
from trainloop.parallel.pipeline import Pipeline
from trainloop.model.tensors import full_numel, full_shape, local_shard
from trainloop.parallel.tp import FSDP2xTP
from trainloop.parallel.zero import DeepSpeedZeRO

STRATEGIES: dict[str, type[Strategy]] = {
    "ddp": DataParallel,  # deepspeed=none, fsdp=none: DistributedDataParallel, or one process
    "zero": DeepSpeedZeRO,  # deepspeed=zero1, zero2, zero3
    "fsdp2": FSDP2,  # fsdp=full_shard
    "hsdp": HybridShard,  # parallel.dp_replicate > 1 (with fsdp=full_shard): a dp_replicate x dp_shard mesh
    "fsdp2_tp": FSDP2xTP,  # parallel.tp_size > 1 (with fsdp=full_shard): a dp_shard x tp mesh
    "fsdp2_ep": ExpertParallel,  # parallel.ep_size > 1 (with fsdp=full_shard): a mixture's experts over an ep mesh
    "pipeline": Pipeline,  # parallel.pp_size > 1: a slice of the blocks on each process
}

__all__ = ["OFF", "STRATEGIES", "Strategy", "build_strategy", "builds_partitioned", "check_context_model", "chosen",
           "context_problems", "context_size", "forwards_together", "full_numel", "full_shape", "layouts", "local_shard",
           "one_forward_only", "own_attention", "problems", "row", "running", "shards_weights", "splits"]


def chosen(cfg) -> str:
    """The row of STRATEGIES the config chooses: the last whose `chooses` says so."""
    return next(name for name, strategy in reversed(STRATEGIES.items()) if strategy.chooses(cfg))


def shards_weights(cfg) -> bool:
    """The chosen row's Strategy.shards_weights."""
    return row(cfg).shards_weights(cfg)


def forwards_together(cfg) -> str | None:
    """The chosen row's Strategy.forwards_together."""
    return row(cfg).forwards_together(cfg)


def row(cfg) -> type[Strategy]:
    """The chosen strategy's class: what it answers before anything is built (planner, doctor, checks)."""
    return STRATEGIES[chosen(cfg)]


def build_strategy(cfg, accelerator) -> Strategy:
    return row(cfg)(cfg, accelerator)


def layouts(gpus_per_node: int) -> dict[str, dict]:
    """Every layout `plan --suggest` weighs, each strategy's in the table's order."""
    return {name: layout for strategy in STRATEGIES.values() for name, layout in strategy.layouts(gpus_per_node).items()}


# every strategy's keys at the values that turn it off: each layout sets all of them
OFF = {key: value for strategy in STRATEGIES.values() for key, value in strategy.off.items()}


def problems(cfg) -> list[str]:
    """Every strategy's checks: each speaks only where its own keys are set."""
    found = []
    if cfg.fsdp.name != "none" and cfg.deepspeed.stage:
        found.append(f"fsdp={cfg.fsdp.name} with deepspeed.stage={cfg.deepspeed.stage}: a run shards with FSDP2 or "
                     "with DeepSpeed ZeRO, not both; choose deepspeed=none or fsdp=none")
    for row in STRATEGIES.values():
        found += row.problems(cfg)
    return found + context_problems(cfg) + image_problems(cfg)


# the dimensions a vision-language model (a data format whose rows carry images) does not run on yet, and why
NOT_FOR_IMAGES = {
    "pp_size": "its stages pass hidden states, and the images would enter the first stage's embeddings as a second "
               "input the schedule does not carry",
    "cp_size": "the image tokens are spliced into the sequence before it would be split, and the vision tower "
               "attends within each image",
    "tp_size": "the vision tower and projector have no tensor-parallel plan",
    "ep_size": "it has no mixture of experts",
}


def image_problems(cfg) -> list[str]:
    """The dimensions refused where the rows carry images (data=vision_chat): one line each, saying why."""
    from trainloop.data.formats import FORMATS

    fmt = FORMATS.get(cfg.data.name)
    if fmt is None or not fmt.images:
        return []
    return [f"parallel.{key}={getattr(cfg.parallel, key)} with data={cfg.data.name}: not for a vision-language model "
            f"yet ({why}); set parallel.{key}=1 (DDP, FSDP2 and DeepSpeed ZeRO run it)"
            for key, why in NOT_FOR_IMAGES.items() if getattr(cfg.parallel, key) > 1]


def context_problems(cfg) -> list[str]:
    """What context parallelism (parallel.cp_size > 1, trainloop.parallel.context) cannot run with.
    The model's own heads and attention are checked when its config is built (check_context_model)."""
    cp = cfg.parallel.cp_size
    if cp == 1:
        return []
    key, found = f"parallel.cp_size={cp}", []
    if cfg.data.seq_len % cp:
        found.append(f"{key} must divide data.seq_len={cfg.data.seq_len}: each rank holds an equal slice of every "
                     f"sequence; choose data.seq_len={cfg.data.seq_len + (-cfg.data.seq_len % cp)}")
    if cfg.parallel.pp_size > 1:
        found.append(f"{key} with parallel.pp_size > 1: context parallelism runs with DDP, DeepSpeed ZeRO, FSDP2 "
                     "and FSDP2 x TP, not with a pipeline; choose parallel.pp_size=1 or parallel.cp_size=1")
    if cfg.parallel.sequence_parallel:
        found.append(f"{key} with parallel.sequence_parallel=true: the sequence is split over the cp ranks already; "
                     "set parallel.sequence_parallel=false")
    if cfg.model.attn_implementation != "sdpa":
        found.append(f"{key} attends through sdpa over the whole sequence, not model.attn_implementation="
                     f"{cfg.model.attn_implementation}: set model.attn_implementation=sdpa")
    tp = cfg.parallel.tp_size
    if cfg.model.name == "tiny" and cfg.model.num_heads % (cp * tp):
        found.append(f"{key}" + (f" x parallel.tp_size={tp}" if tp > 1 else "") + f" must divide model.num_heads="
                     f"{cfg.model.num_heads}: each rank attends with 1/cp of the heads (of its tp share)")
    if cfg.model.name == "tiny" and cfg.model.arch == "mixtral":
        found.append(f"{key} with model.arch=mixtral: the router's load-balancing loss is taken over a forward's "
                     "tokens, which context parallelism splits; choose another model.arch or parallel.cp_size=1")
    return found


def check_context_model(cfg, model_config) -> None:
    """The model's attention can be split over the context-parallel group: its heads divide, and it
    has no sliding window (whose mask is not causal alone)."""
    from trainloop.errors import ConfigError

    cp = cfg.parallel.cp_size
    if cp == 1:
        return
    tp = cfg.parallel.tp_size
    heads = getattr(model_config, "num_attention_heads", None) or getattr(model_config, "n_head", None)
    if heads is None or heads % (cp * tp):
        raise ConfigError(f"parallel.cp_size={cp}" + (f" x parallel.tp_size={tp}" if tp > 1 else "") +
                          f" must divide the model's attention heads ({heads}): each rank attends with 1/cp of "
                          "them (of its tp share); choose a parallel.cp_size that divides them")
    if getattr(model_config, "sliding_window", None) or getattr(model_config, "layer_types", None) and any(
            t != "full_attention" for t in model_config.layer_types):
        raise ConfigError(f"parallel.cp_size={cp}: this model's attention is not causal over the whole sequence "
                          "(a sliding window, or layers of other kinds), which context parallelism cannot swap in; "
                          "set parallel.cp_size=1")
