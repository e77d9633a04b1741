"""The parallel section's degrees, read here and nowhere else outside trainloop.parallel and the config's
composition: what splits one replica (pipeline, tensor, context), and what that means for the rest of
trainloop (an objective's loss, a message). Reads the config only: it imports nothing, so any layer may ask it."""

from __future__ import annotations


SPLITS = ("pp_size", "tp_size", "cp_size")  # the degrees that split one replica: its layers, their matrices, its sequences


def splits(cfg) -> list[str]:
    """The parallel.* degrees above 1 that split one replica's model or its sequences (pipeline, tensor,
    context), as KEY=VALUE: what a message names when the rest of trainloop cannot run split."""
    return [f"parallel.{key}={getattr(cfg.parallel, key, 1)}" for key in SPLITS if getattr(cfg.parallel, key, 1) > 1]


def context_size(cfg) -> int:
    """How many processes split each sequence (parallel.cp_size; 1: none): a forward's tokens per rank are
    data.seq_len / this, and its checkpoints hold a partition per rank of that group."""
    return cfg.parallel.cp_size


def one_forward_only(cfg) -> list[tuple[str, str, str]]:
    """The dimensions of this config that give an objective's loss the logits of one forward of the model and
    nothing else (the pipeline runs that forward across its stages and hands the last stage's logits to the
    objective's loss), each as (its key, what it is, what to set instead): trainloop.objectives checks what the
    objective needs beyond them. Tensor parallelism is not one: it splits the blocks' matrices and keeps the
    embeddings, the output layer and the loss whole on every rank of a tp group (trainloop.parallel.tensor_parallel),
    so every objective's forward, frozen copy and generation run there as on one process."""
    p, found = cfg.parallel, []
    if p.pp_size > 1:
        found.append((f"parallel.pp_size={p.pp_size}", "the pipeline", "use parallel.pp_size=1"))
    return found


def builds_partitioned(cfg) -> str | None:
    """The key under which the model is built already partitioned (DeepSpeed's zero.Init), or None: a copy of
    the model as built cannot be made then."""
    ds = cfg.deepspeed
    return "deepspeed.zero3_init=true" if ds.stage == 3 and ds.zero3_init else None
