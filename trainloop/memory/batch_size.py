"""Batch size: advice on tensor-core friendly shapes, and the search for the largest batch that fits.

`settle_batch_size` (trainer.auto_batch_size=true) runs real training steps at candidate
per-device batches, largest first, halving on out-of-memory as accelerate's
find_executable_batch_size does, and keeps the effective batch (data.batch_size x
trainer.gradient_accumulation_steps) by raising accumulation. The out-of-memory errors are the
allocator's own: on a GPU the caching allocator is capped to the budget; on CPU the process's
data segment (RLIMIT_DATA) is, so an allocation past it fails inside torch instead of the kernel
swapping or killing the process.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from dataclasses import dataclass, field
from functools import partial

import torch

from trainloop.errors import ConfigError
from trainloop.memory.offload import ActivationOffload
from trainloop.memory.proc import mem_available, status_bytes
from trainloop.step import every_update, train_step

log = logging.getLogger("trainloop")

TRIAL_STEPS = 2  # the second step runs with the optimizer state of the first in memory


def tensor_core_multiple(precision: str, device: torch.device) -> int | None:
    """The multiple the guide recommends: 64 on A100-class GPUs in fp16/bf16, otherwise 8;
    None off a GPU, which has no tensor cores to feed."""
    if device.type != "cuda":
        return None
    if precision in ("fp16", "bf16", "fp8"):
        major, minor = torch.cuda.get_device_capability(device)
        if major >= 8 and minor == 0:  # data-centre parts: A100 (8.0), H100 (9.0), B200 (10.0)
            return 64
    return 8


def batch_size_advice(sizes: dict[str, int], multiple: int | None) -> str | None:
    """One warning naming every size that is not a multiple of `multiple`, or None."""
    off = [f"{name}={value}" for name, value in sizes.items() if multiple and value % multiple]
    if not off:
        return None
    return (f"{', '.join(off)} not a multiple of {multiple}: GPU matrix multiplies (tensor cores) "
            f"run fastest when batch, sequence, hidden and vocabulary sizes are multiples of {multiple}")


@dataclass
class BatchSearch:
    """What the search tried and where it settled."""

    per_device_effective: int  # data.batch_size x gradient_accumulation_steps, kept fixed
    batch_size: int = 0
    tried: list[dict] = field(default_factory=list)  # {"batch_size", "fits", "error"}

    @property
    def accumulation(self) -> int:
        return self.per_device_effective // self.batch_size

    def record(self, world_size: int) -> dict:
        """The metrics.jsonl line that states the decision."""
        return {"event": "auto_batch_size", "batch_size": self.batch_size,
                "gradient_accumulation_steps": self.accumulation,
                "effective_batch_size": self.per_device_effective * world_size, "tried": self.tried}


def candidates(effective: int, limit: int):
    """Divisors of `effective` from the largest <= limit, each at most half the one before."""
    size = max(d for d in range(1, min(effective, limit) + 1) if effective % d == 0)
    while True:
        yield size
        if size == 1:
            return
        size = max(d for d in range(1, size // 2 + 1) if effective % d == 0)


@contextlib.contextmanager
def memory_budget(device: torch.device, budget: int | None):
    """Allocations past `budget` bytes beyond what the process holds now fail with a real OOM.

    budget None: on a GPU its own capacity; on CPU the memory the system has available.
    """
    if device.type == "cuda":
        if budget is None:
            yield
            return
        total = torch.cuda.get_device_properties(device).total_memory
        held = torch.cuda.memory_reserved(device)
        torch.cuda.set_per_process_memory_fraction(min(1.0, (held + budget) / total), device)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        return
    import resource

    budget = budget if budget is not None else mem_available()
    try:
        held = status_bytes("VmData")
    except (OSError, KeyError):
        held = None
    if budget is None or held is None:  # not Linux: no way to cap the process here
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = held + budget
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def is_out_of_memory(err: BaseException) -> bool:
    from accelerate.utils.memory import should_reduce_batch_size

    return isinstance(err, (torch.cuda.OutOfMemoryError, MemoryError)) or should_reduce_batch_size(err)


def stacked(samples, size: int, device: torch.device) -> dict:
    """The first `size` samples as one batch: training blocks (dicts), or plain rows of token ids."""
    first = [samples[i] for i in range(size)]
    if not isinstance(first[0], dict):
        first = [{"input_ids": ids, "labels": ids} for ids in first]
    return {key: torch.stack([s[key] for s in first]).to(device) for key in first[0]}


@contextlib.contextmanager
def forward_context(autocast, offload):
    """The run's forward context: its autocast, and activation offloading where it is on."""
    with autocast(), offload():
        yield


def trial_steps(strategy, model, objective, make_optimizer, batch: dict, context, max_grad_norm=None) -> None:
    """TRIAL_STEPS steps of the run (trainloop.step: its loss scale, penalty, clipping and optimizer
    step) on one micro-batch, this process alone, that leave the model's weights unchanged.

    A throwaway optimizer (learning rate 0, gradients zeroed before its step) allocates its real
    state; with zero gradients and a zero rate every update is exactly zero.
    """

    def zero_gradients(state, step_loss, grad_norm):  # after clipping, as the run's guard is asked
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        return every_update(state, step_loss, grad_norm)

    optimizer = make_optimizer()
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    try:
        for _ in range(TRIAL_STEPS):
            train_step(strategy, objective, model, optimizer, [batch], max_grad_norm=max_grad_norm,
                       forward_context=context, check=zero_gradients, alone=True)
    finally:
        model.zero_grad(set_to_none=True)
        del optimizer


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def search_batch_size(strategy, model, objective, make_optimizer, samples, effective: int, context,
                      budget: int | None, limit: int | None = None, max_grad_norm=None) -> BatchSearch:
    """Try per-device batches (divisors of `effective`, at most `limit`), largest first, until one fits.
    `context`: the run's forward context (forward_context: its autocast and activation offloading);
    each trial is the run's step (trainloop.step) on `strategy`'s device, this process alone."""
    search = BatchSearch(per_device_effective=effective)
    device = strategy.device
    trial = partial(trial_steps, strategy, model, objective, make_optimizer, context=context,
                    max_grad_norm=max_grad_norm)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # dropout in the trials must not shift training's RNG
        # One-time allocations (OpenMP's thread pool, whose creation aborts the process when it
        # fails, kernel workspaces) happen in a batch-1 warm-up outside the budget.
        try:
            trial(stacked(samples, 1, device))
        except (RuntimeError, MemoryError) as err:
            if not is_out_of_memory(err):
                raise
            search.tried.append({"batch_size": 1, "fits": False, "error": str(err).splitlines()[0][:200]})
            return search
        for size in candidates(effective, min(limit or len(samples), len(samples))):
            batch = stacked(samples, size, device)
            error = None
            try:
                with memory_budget(device, budget):
                    trial(batch)
            except (RuntimeError, MemoryError) as err:
                if not is_out_of_memory(err):
                    raise
                error = str(err).splitlines()[0][:200]
            del batch
            _release(device)
            search.tried.append({"batch_size": size, "fits": error is None, "error": error})
            if error is None:
                search.batch_size = size
                return search
    return search


def with_batch(cfg, batch_size: int, accumulation: int):
    """A copy of `cfg` stating the batch the run takes (a settled one), for what records the run: its
    checkpoints' config.yaml and fingerprint, the trackers' hyperparameters. The run itself takes
    the batch from the build (trainloop.build.Built), never back from a config."""
    from omegaconf import OmegaConf

    return OmegaConf.merge(cfg, {"data": {"batch_size": batch_size},
                                 "trainer": {"gradient_accumulation_steps": accumulation}})


def settle_batch_size(cfg, strategy, objective, model, train_set, make_optimizer, resume_from=None) -> BatchSearch:
    """trainer.auto_batch_size: find the batch and agree on it across ranks; the caller applies it.

    The settled data.batch_size and trainer.gradient_accumulation_steps keep their product, the
    per-device effective batch, unchanged. Runs before torch.compile and
    outside DDP, so each rank searches alone (DDP's gradient buckets are not in the trial); the
    ranks then take the smallest batch any of them found. A resumed run takes the batch its
    checkpoint was trained with, since the data order depends on it.
    """
    effective = cfg.data.batch_size * cfg.trainer.gradient_accumulation_steps
    if resume_from is not None:
        from omegaconf import OmegaConf

        saved = OmegaConf.load(os.path.join(resume_from, "config.yaml")).data.batch_size
        if effective % saved:
            raise ConfigError(f"checkpoint {resume_from} ran at per-device batch {saved}, which does not "
                              f"divide data.batch_size x trainer.gradient_accumulation_steps = {effective}")
        search = BatchSearch(effective, saved)  # tried stays empty: nothing was searched
    else:
        budget_mb = cfg.trainer.auto_batch_size_budget_mb
        model.to(strategy.device)
        search = search_batch_size(strategy, model, objective, make_optimizer, train_set, effective,
                                   partial(forward_context, strategy.accelerator.autocast,
                                           ActivationOffload(cfg.trainer.activation_offload, strategy.device)),
                                   None if budget_mb is None else int(budget_mb * 2**20),
                                   limit=len(train_set) // strategy.dp_size,  # each data-parallel rank's share
                                   max_grad_norm=cfg.trainer.max_grad_norm)
        if strategy.world_size > 1:
            found = torch.tensor([search.batch_size], device=strategy.device)
            search.batch_size = int(strategy.accelerator.gather(found).min().item())
        if search.batch_size == 0:
            tried = ", ".join(f"{t['batch_size']} ({t['error']})" for t in search.tried)
            raise ConfigError(f"trainer.auto_batch_size: not even a batch of 1 fits (tried {tried}); turn on "
                              "model.gradient_checkpointing, lower data.seq_len, choose a smaller optimizer "
                              "state (optimizer=adamw8bit or adafactor), or raise trainer.auto_batch_size_budget_mb")
    tried = ", ".join(f"{t['batch_size']} ({'fits' if t['fits'] else 'out of memory'})"
                      for t in search.tried) or f"none, resumed from {resume_from}"
    log.info("auto batch size: per-device batch %d x %d accumulation steps = %d per device, effective batch "
             "%d over %d process(es); tried %s", search.batch_size, search.accumulation, effective,
             effective * strategy.dp_size, strategy.dp_size, tried)
    return search
