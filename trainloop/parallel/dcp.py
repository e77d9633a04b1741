"""Checkpoints of an FSDP2 run in torch.distributed.checkpoint (DCP) format; trainloop.checkpoint.checkpointer commits them.

The model and the optimizer (`get_state_dict`: DTensor shards) go to `MODEL_DIR` inside the
checkpoint folder, one `__<rank>_0.distcp` file per rank and a `.metadata` written by rank 0.
DCP loads them at any world size (the planner reshards). Everything else is saved as accelerate's
save_state lays it out, so the rest of trainloop.checkpoint.checkpointer reads it as usual: the scheduler as
`custom_checkpoint_0.pkl`, the RNG states as `random_states_<rank>.pkl` (with accelerate's
micro-step counter), the scaler as `scaler.pt`.

An asynchronous save (checkpoint.async_save) copies the state to CPU memory in the training
thread, then writes in a background thread over a gloo process group of its own: on the training
group the save's collectives collide with the next step's (gloo aborts with a collective mismatch,
seen on CPU). Rank 0's future completes only after it gathered every rank's write results and
wrote `.metadata` (DCP's `all_reduce("write", ...)`), so when it is done every rank's shard is on
disk and the main process may commit the folder.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

MODEL_DIR = "model_optimizer"  # DCP: __<rank>_0.distcp per rank and .metadata
METADATA = ".metadata"

def _options(adapter_only: bool, flatten: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # with an adapter the frozen base is rebuilt from its source at every start, as without FSDP.
    # flatten: the optimizer's state and param groups keyed by parameter name, for ranks that hold
    # different parameters (pipeline stages), whose param-group lists would otherwise collide
    return StateDictOptions(ignore_frozen_params=adapter_only, strict=not adapter_only,
                            flatten_optimizer_state_dict=flatten)


def _state(model, optimizer, adapter_only: bool, flatten: bool = False) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer, options=_options(adapter_only, flatten))
    return {"model": model_state, "optimizer": optimizer_state}


def _unwrap(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it


def save_rank_states(accelerator, directory: Path) -> None:
    """Every rank: its RNG states and accelerate's micro-step; the main process: the registered
    objects (the scheduler) and the scaler. accelerate's own file names and formats."""
    from accelerate.checkpointing import save_accelerator_state, save_custom_state

    save_accelerator_state(str(directory), [], [], [], [], accelerator.process_index, accelerator.step,
                           scaler=accelerator.scaler if accelerator.is_main_process else None)
    for index, obj in enumerate(accelerator._custom_objects):
        save_custom_state(obj, str(directory), index)  # main process only


def load_rank_states(accelerator, path: Path) -> None:
    from accelerate.checkpointing import load_accelerator_state, load_custom_state

    restored = load_accelerator_state(str(path), [], [], [], [], accelerator.process_index,
                                      scaler=accelerator.scaler)
    accelerator.step = restored.get("step", accelerator.step)
    for index, obj in enumerate(accelerator._custom_objects):
        load_custom_state(obj, str(path), index)


def _writer(directory: Path, record):
    """DCP's file writer, which also hashes the shards this rank wrote (`record(directory, files, who)`: the
    checkpointer's, trainloop.checkpoint.integrity.record) before DCP's closing collective: once rank 0's save
    is done, every rank's checksums are on disk."""
    from torch.distributed.checkpoint import FileSystemWriter

    class HashingWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            written = super().write_data(plan, planner)
            files = sorted({f"{MODEL_DIR}/{result.storage_data.relative_path}" for result in written.wait()})
            record(directory, files, f"dcp_rank_{self.rank}")
            return written

    return HashingWriter(directory / MODEL_DIR)


def save(directory: Path, model, optimizer, adapter_only: bool, record, flatten: bool = False) -> None:
    """Every rank, together: the model and optimizer shards, written and hashed (`record`) before this returns."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, _unwrap(optimizer), adapter_only, flatten), storage_writer=_writer(directory, record))


def flattened(path: Path) -> bool:
    """Whether the checkpoint's optimizer state is keyed by parameter name (a pipeline's, saved with
    flatten_optimizer_state_dict: `optimizer.param_groups.<name>.lr`) rather than by group
    (`optimizer.param_groups.0.lr`), read from DCP's metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(path / MODEL_DIR)).read_metadata().state_dict_metadata
    return any(k.startswith("optimizer.param_groups.") and not k.split(".")[2].isdigit() for k in keys)


def load(path: Path, model, optimizer, adapter_only: bool, flatten: bool = False) -> None:
    """Every rank, together: the shards this rank holds now, whatever world size saved them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    optimizer = _unwrap(optimizer)
    state = _state(model, optimizer, adapter_only, flatten)  # the layout to fill (an empty optimizer's is made)
    import warnings

    with warnings.catch_warnings():  # one process (a pipeline's checkpoint resumed alone): DCP says it loads alone
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=str(path / MODEL_DIR))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_options(adapter_only, flatten))


def checkpoint_group(timeout_s: float):
    """A process group for asynchronous saves (gloo: it runs on CPU tensors). Every rank must make
    it at the same point of training (new_group is collective): the run's first asynchronous save."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


@dataclass
class InFlight:
    """An asynchronous save: what its commit records, and when its writing finished."""

    future: Future
    tmp: Path
    final: Path
    state: dict  # the trainer state at the moment of the save
    fingerprint: dict
    started: float  # time.monotonic() when the save was called
    blocked_s: float  # how long the training thread was held (the copy to CPU memory)
    written_by_step: list = field(default_factory=list)  # the optimizer steps taken when it was written
    written_at: list = field(default_factory=list)

    @property
    def step(self) -> int:
        return self.state["step"]


def start_async(directory: Path, final: Path, model, optimizer, adapter_only: bool, state: dict,
                fingerprint: dict, group, steps_done, record) -> InFlight:
    """Every rank, together: copy the shards to CPU memory and write them in the background.
    `steps_done()` tells the background thread how far training has got when its writing ends."""
    import torch.distributed.checkpoint as dcp

    started = time.monotonic()
    future = dcp.async_save(_state(model, _unwrap(optimizer), adapter_only), storage_writer=_writer(directory, record),
                            process_group=group)
    save = InFlight(future, directory, final, state, fingerprint, started, time.monotonic() - started)

    def written(_):
        save.written_by_step.append(steps_done())
        save.written_at.append(time.monotonic())

    future.add_done_callback(written)
    return save
