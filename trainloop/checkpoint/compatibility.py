"""What a checkpoint must agree with to be resumed: the run's fingerprint (what is trained, on
what, for which loss, with which optimizer), the keys that may change on a resume, the batch when the
world size changes, and the format the strategy saved it in. A resume that changes anything else is
refused in one line naming the keys."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import OmegaConf

from trainloop.errors import ConfigError
from trainloop.objectives import keys_read

log = logging.getLogger("trainloop")

# DataLoader mechanics: they change how blocks reach the model, never which blocks or in what order.
DATA_MECHANICS = ("num_proc", "num_workers", "pin_memory", "persistent_workers", "prefetch_factor",
                  "multiprocessing_context")

# What may change when a run resumes: how long it trains and at what learning rate, how a step is
# computed, what is logged, evaluated and saved; never the model, adapter, data, loss or optimizer it
# trains with. A section named here may change whole, a key alone. run_fingerprint records the rest of
# RECORDED's sections and, of the others, the world size and FINGERPRINT_KEYS: a resume that changes
# one is refused. Every config key is one or the other (tests/test_fingerprint.py); README says which.
MAY_CHANGE_ON_RESUME = (
    "optimizer.lr", "scheduler", "trainer.max_steps",  # the schedule, from the configured lr (optim.keep_configured_lr)
    "trainer.max_grad_norm", "trainer.stop_at_step", "trainer.on_nonfinite", "trainer.collective_timeout_s",
    "trainer.log_every", "trainer.eval_every", "trainer.eval_batches", "logging", "eval",  # what is logged, evaluated
    "checkpoint",  # when it saves, what it keeps and resumes
    "precision", "compile", "optimizer.impl", "trainer.loss_chunk_tokens", "trainer.activation_offload",  # how
    "trainer.auto_batch_size", "trainer.auto_batch_size_budget_mb",  # the batch it settles is recorded
    "model.attn_implementation", "model.gradient_checkpointing",  # the same weights, another kernel or memory
    *(f"data.{key}" for key in DATA_MECHANICS),
    "objective.precompute_reference",  # DPO's reference log-probs, of the same starting model, kept or recomputed
    "deepspeed", "fsdp", "parallel",  # the strategy's settings but its files' format (FINGERPRINT_KEYS) and dp size
)
# What is trained, on what, for which loss; and the optimizer's hyperparameters, which its loaded
# state would silently put back (its lr excepted: keep_configured_lr)
RECORDED = ("data", "model", "adapter", "objective", "optimizer")
FINGERPRINT_KEYS = ("trainer.gradient_accumulation_steps",
                    "trainer.seed",  # the data order is a function of (seed, epoch)
                    "deepspeed.stage", "fsdp.name")  # the format of the model and optimizer files (trainloop.parallel.dcp)


def may_change_on_resume(key: str) -> bool:
    return key in MAY_CHANGE_ON_RESUME or key.partition(".")[0] in MAY_CHANGE_ON_RESUME


def run_fingerprint(cfg, world_size: int) -> dict:
    """What a checkpoint must agree with to be resumed exactly (the data's own content is added
    by Checkpointer.check_data once it is built): every key of RECORDED's sections but those that
    MAY_CHANGE_ON_RESUME, of the objective only those it reads (trainloop.objectives.keys_read)."""
    recorded = {f"{section}.{key}": value for section in RECORDED
                for key, value in OmegaConf.to_container(cfg[section], resolve=True).items()}
    read = keys_read(cfg)
    return {
        "world_size": world_size,
        **{key: OmegaConf.select(cfg, key) for key in FINGERPRINT_KEYS},
        **{key: value for key, value in recorded.items() if not may_change_on_resume(key)
           and (not key.startswith("objective.") or key in read)},
    }


def refuse_changes(path: Path, saved: dict, current: dict) -> None:
    """Refuse a checkpoint whose fingerprint differs. A key the checkpoint lacks (saved before
    trainloop checked it) is not compared, and said so: old checkpoints stay resumable."""
    changed = [f"{k}: {saved[k]!r} -> {v!r}" for k, v in current.items() if k in saved and saved[k] != v]
    if changed:
        raise ConfigError(f"checkpoint {path} was made with another config; changed: "
                          + "; ".join(changed) + ". Restore those settings to resume it, or "
                          "start a new run in a new hydra.run.dir")
    unknown = [k for k in current if k not in saved]
    if unknown:
        log.warning("checkpoint %s was saved before trainloop recorded %s: resuming it without "
                    "comparing those", path, ", ".join(unknown))


BATCH_KEYS = ("world_size", "data.batch_size", "trainer.gradient_accumulation_steps")
GLOBAL_BATCH = "global batch (world_size x data.batch_size x trainer.gradient_accumulation_steps)"


def global_batch(fingerprint: dict) -> int:
    world_size, batch_size, accumulation = (fingerprint[key] for key in BATCH_KEYS)
    return world_size * batch_size * accumulation


def describe_batch(fingerprint: dict) -> str:
    return (f"{fingerprint['world_size']} process(es) x data.batch_size={fingerprint['data.batch_size']} x "
            f"trainer.gradient_accumulation_steps={fingerprint['trainer.gradient_accumulation_steps']} = "
            f"{global_batch(fingerprint)} samples per step")


def how_to_keep_global_batch(saved: dict, current: dict) -> str:
    wanted, processes = global_batch(saved), current["world_size"]
    per_rank = current["trainer.gradient_accumulation_steps"] * processes
    if wanted % per_rank == 0:
        return f"resume with data.batch_size={wanted // per_rank} on {processes} process(es)"
    if wanted % processes == 0:
        return (f"resume on {processes} process(es) with data.batch_size x trainer.gradient_accumulation_steps "
                f"= {wanted // processes}")
    return f"resume on a number of processes that divides {wanted}"


def check_world_size_change(path: Path, saved: dict, current: dict, keeps_world_size: str | None) -> None:
    """A run resumes at another world size when the global batch is unchanged and its strategy's
    checkpoints reshard on load (DDP, FSDP2): the order of samples is global (trainloop.data.order),
    so it continues the same sequence. `keeps_world_size`: why they do not (the strategy's
    Strategy.keeps_world_size, under ZeRO), or None."""
    if not all(k in saved for k in BATCH_KEYS) or saved["world_size"] == current["world_size"]:
        return
    change = f"world_size: {saved['world_size']} -> {current['world_size']}"
    if keeps_world_size:
        raise ConfigError(
            f"checkpoint {path} was saved by {saved['world_size']} processes, this run has "
            f"{current['world_size']} ({change}): {keeps_world_size}, "
            f"so the checkpoint resumes only on {saved['world_size']} processes; launch that many")
    if global_batch(saved) != global_batch(current):
        raise ConfigError(
            f"checkpoint {path} was saved with {describe_batch(saved)}; this run has {describe_batch(current)} "
            f"({change}). A run resumes at another world size only with the same global batch: "
            + how_to_keep_global_batch(saved, current))
    log.info("resuming %s at another world size (%s): the global batch of %d samples is unchanged",
             path, change, global_batch(current))


def describe_format(fsdp_name: str) -> str:
    if fsdp_name == "none":
        return "without FSDP (fsdp=none: accelerate's save_state, whole tensors or DeepSpeed's partitions)"
    return (f"under FSDP2 (fsdp={fsdp_name}: model and optimizer in torch.distributed.checkpoint format, "
            "a shard per rank)")


def check_format(path: Path, saved: dict, current: dict) -> None:
    """A checkpoint saved under FSDP2 holds DCP shards, any other holds accelerate's files: neither
    loads into the other. A checkpoint from before FSDP2 (no fsdp.name recorded) was saved without it."""
    saved_fsdp, fsdp = saved.get("fsdp.name", "none"), current["fsdp.name"]
    if saved_fsdp != fsdp:
        raise ConfigError(
            f"checkpoint {path} was saved {describe_format(saved_fsdp)}; this run is {describe_format(fsdp)} "
            f"and cannot load it (fsdp.name: {saved_fsdp!r} -> {fsdp!r}). Resume it with fsdp={saved_fsdp}, "
            "or start a new run in a new hydra.run.dir")


def comparable(saved: dict, current: dict, reshards: bool, auto_batch_size: bool) -> tuple[dict, dict]:
    """The two fingerprints as a resume compares them. When checkpoints reshard (DDP, FSDP2) and
    the global batch agrees, its split into processes, micro-batch and accumulation may change
    (trainloop.data.order: the same samples per step); otherwise each part is compared, as under
    ZeRO (where check_world_size_change has refused another world size)."""
    if (reshards and all(k in f for f in (saved, current) for k in BATCH_KEYS)
            and global_batch(saved) == global_batch(current)):
        return tuple({k: v for k, v in f.items() if k not in BATCH_KEYS} | {GLOBAL_BATCH: global_batch(f)}
                     for f in (saved, current))
    return _per_device(saved, auto_batch_size), _per_device(current, auto_batch_size)


def _per_device(fingerprint: dict, auto_batch_size: bool) -> dict:
    """With trainer.auto_batch_size the run settles batch x accumulation itself (a resume takes the
    checkpoint's): only their product, the per-device batch, must agree."""
    batch_keys = ("data.batch_size", "trainer.gradient_accumulation_steps")
    if not auto_batch_size or not all(k in fingerprint for k in batch_keys):
        return fingerprint
    per_device = {k: v for k, v in fingerprint.items() if k not in batch_keys}
    per_device["data.batch_size x trainer.gradient_accumulation_steps"] = \
        fingerprint[batch_keys[0]] * fingerprint[batch_keys[1]]
    return per_device
