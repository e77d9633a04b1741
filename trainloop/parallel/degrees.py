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


# What an objective's loss may need beyond the logits of one forward of the model (its row's `needs`), as the
# dimensions that give less name it when they refuse the objective
FROZEN = "a frozen copy's forward (a reference, a teacher)"
SECOND_FORWARD = "a second forward of the policy without gradients"
GENERATION = "generation"
SCORE_HEAD = "a score head read at each row's last token"


def one_forward_only(cfg) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """The dimensions of this config that run the one forward of the model whose output the objective's loss reads
    themselves (the pipeline, across its stages, handing the last stage's output to the loss), each as (its key,
    what it is, what to set instead, what it gives beside that forward): trainloop.objectives checks what the
    objective needs against the last. The pipeline gives the forwards an objective computes before its loss
    without gradients (a frozen copy cut into the same stages, the policy's own) and a score head on its last
    stage, not generation. Tensor parallelism is not one: it splits the blocks' matrices and keeps the
    embeddings, the output layer and the loss whole on every rank of a tp group (trainloop.parallel.tensor_parallel),
    so every objective's forward, frozen copy and generation run there as on one process."""
    p, found = cfg.parallel, []
    if p.pp_size > 1:
        found.append((f"parallel.pp_size={p.pp_size}", "the pipeline", "use parallel.pp_size=1",
                      (FROZEN, SECOND_FORWARD, SCORE_HEAD, GENERATION)))
    return found


def own_attention(cfg) -> str | None:
    """The key of a dimension whose forwards attend through trainloop's training attention for every objective
    (context parallelism swaps sequence for heads around it; the pipeline's stages call the blocks themselves,
    handing them the mask it builds), or None."""
    p = cfg.parallel
    return (f"parallel.cp_size={p.cp_size}" if p.cp_size > 1 else f"parallel.pp_size={p.pp_size}" if p.pp_size > 1
            else None)


def builds_partitioned(cfg) -> str | None:
    """The key under which the model is built already partitioned (DeepSpeed's zero.Init), or None: a copy of
    the model as built cannot be made then."""
    ds = cfg.deepspeed
    return "deepspeed.zero3_init=true" if ds.stage == 3 and ds.zero3_init else None
