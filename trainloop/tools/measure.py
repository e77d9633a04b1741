"""`plan --measure`: the memory a few real training steps take here, with the run's own build, to check
the planner's prediction (trainloop.tools.plan) against; scripts/bench_parallel.py and bench_dpo.py measure
through it too."""

from __future__ import annotations

from trainloop.memory.proc import host_allocator, reset_peak_rss, status_bytes


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def track_live_memory(on: bool) -> bool:
    """On: glibc gives every allocation of 64 KiB or more its own mapping, unmapped when freed, so
    the resident set follows the live tensors. Off: a 32 MiB threshold, glibc's steady state.
    With glibc's default heap a freed tensor stays resident and a later, differently sized one
    may not fit in its place: under FSDP2 (gather and free a block at a time) the resident set of
    a 17M-parameter model grew 380 -> 560 MB over 4 steps with the live tensors flat (seen here).
    False where there is no glibc, or its malloc is not the one in use (a preloaded jemalloc)."""
    import ctypes

    if host_allocator() != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 64 * 2**10 if on else 32 * 2**20)
        if on:
            libc.malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


class SavedActivations:
    """Counts what autograd keeps for the backward of the forward run inside it: the storages of
    the tensors it saves, summed when the forward is over (FSDP2 has resized its gathered blocks to
    nothing by then), a DTensor by its local shard; parameters are not activations and are left
    out: `model`'s own storages (a matmul saves its weight as a transposed view of one) and any
    leaf that requires a gradient (FSDP2's gathered copies). What the plan's "activations" line
    predicts, without the allocator or the runtime in the way. Inside activation offload's own
    hooks it would see nothing: not used there."""

    def __init__(self, model):
        from trainloop.parallel import local_shard

        self.params = {local_shard(p).untyped_storage()._cdata for p in model.parameters()}
        self.storages: dict[int, object] = {}
        self.bytes: int | None = None

    def pack(self, tensor):
        from trainloop.parallel import local_shard

        if not (tensor.is_leaf and tensor.requires_grad):
            # keyed by the storage itself, not its address: FSDP2 frees a gathered block's memory during
            # the forward and a later activation may get the same address (nor has a wrapper's storage one)
            storage = local_shard(tensor).untyped_storage()
            if storage._cdata not in self.params:
                self.storages.setdefault(storage._cdata, storage)
        return tensor

    def __enter__(self):
        import torch

        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)
        self.bytes = sum(storage.nbytes() for storage in self.storages.values())
        self.storages.clear()  # held no longer than autograd holds them


def measure_training(cfg, steps: int, timed_steps: int = 0) -> dict:
    """Train `steps` optimizer steps with the run's own builders; the memory the training took.

    On CPU: peak RSS during those steps minus RSS just before the model is built (Linux: the
    peak is reset through /proc/self/clear_refs) and less the library pages the steps mapped in
    (memory_used), with glibc told to unmap freed tensors
    (track_live_memory) so that the resident set follows the live tensors. On a GPU: torch's peak
    allocated bytes. Then `timed_steps` more steps with glibc's usual heap, each timed
    (`step_seconds`); `peak_rss` is the whole process's peak resident set at the end.
    Under a launcher every process measures itself; everything is built by the run's own build
    (trainloop.build: adapter, compile, the strategy's sharding, the optimizer) and each step is the
    objective's. `shard_bytes`: the storage this process holds for parameters, gradients and
    optimizer state, counted on the live tensors. `saved_activation_bytes`: what autograd kept after
    the first forward (SavedActivations; None under activation offload and a pipeline).
    """
    import gc
    import time

    import torch

    from trainloop.build import build
    from trainloop.memory.offload import ActivationOffload
    from trainloop.parallel import build_strategy, local_shard
    from trainloop.parallel.accelerator import build_accelerator
    from trainloop.run import end_distributed
    from trainloop.step import every_update, train_step

    accelerator = build_accelerator(cfg)
    strategy = build_strategy(cfg, accelerator)
    on_cuda = accelerator.device.type == "cuda"
    marks = {}

    def start_measuring() -> None:  # after the data is built, before the model is
        gc.collect()
        marks["live"] = track_live_memory(True)
        if not reset_peak_rss():  # the peak RSS now starts from here
            raise RuntimeError("plan --measure needs /proc/self/clear_refs (Linux) to reset the peak resident set")
        marks["before"], marks["files_before"] = status_bytes("VmRSS"), status_bytes("RssFile")
        if on_cuda:
            torch.cuda.reset_peak_memory_stats()
            marks["gpu_before"] = torch.cuda.memory_allocated()

    built = build(cfg, strategy, before_model=start_measuring)  # the run's own build, in the run's order
    model, optimizer, objective = built.model, built.optimizer, built.objective
    before, gpu_before, live = marks["before"], marks.get("gpu_before"), marks["live"]

    def memory_used() -> dict:
        """The peak resident set since the mark, less the pages of library code and data the steps
        mapped in (RssFile's growth): those are the libraries', not the training's, and how many a
        first call maps depends on the page cache (the kernel maps the neighbours of a faulted page
        that are cached): 29 MiB apart between two venvs of the same packages, seen here. On a GPU,
        torch's peak allocated bytes beside it."""
        used = {"training_bytes": status_bytes("VmHWM") - before - (status_bytes("RssFile") - marks["files_before"])}
        if on_cuda:
            used["gpu_training_bytes"] = torch.cuda.max_memory_allocated() - gpu_before
        return used
    batch = {key: value.to(accelerator.device) for key, value in next(iter(built.train_loader)).items()}
    model.train()
    offload = ActivationOffload(cfg.trainer.activation_offload, accelerator.device)
    accumulation = built.accumulation
    shards, seconds, result = {}, [], {}
    # what autograd keeps in one forward; a pipeline's step interleaves its micro-batches' forwards and
    # backwards, and holding every saved tensor to the end of it would raise the very peak measured
    saved = None if offload.on or strategy.interleaved else SavedActivations(model)
    forwards = iter([saved] if saved else [])  # what autograd keeps in the first forward, then the run's context

    def forward_context():
        return next(forwards, None) or offload()

    def count_gradients(state, step_loss, grad_norm):  # after clipping, before the update: the step's gradients
        if step == steps - 1:
            shards["gradients"] = _storage_bytes(local_shard(p.grad) for p in model.parameters() if p.grad is not None)
        return every_update(state, step_loss, grad_norm)

    for step in range(steps + timed_steps):
        if step == steps:  # the memory steps are over: their peak, then glibc's usual heap for the timing
            result = memory_used()
            track_live_memory(False)
        start = time.perf_counter()
        # the run's step (trainloop.step) on the first batch, as many micro-batches as the run's
        stepped = train_step(strategy, objective, model, optimizer, [batch] * accumulation,
                             max_grad_norm=cfg.trainer.max_grad_norm, forward_context=forward_context,
                             check=count_gradients)
        stepped.loss.item()  # waits for the device
        seconds.append(time.perf_counter() - start)
    if not timed_steps:
        result = memory_used()
    shards["parameters"] = _storage_bytes(local_shard(p) for p in model.parameters())
    shards["optimizer states"] = _storage_bytes(local_shard(v) for state in optimizer.state.values()
                                                for v in state.values() if isinstance(v, torch.Tensor))
    result = {"steps": steps, "rank": accelerator.process_index, "rss_before": before, "peak_rss": status_bytes("VmHWM"),
              "cpu_training_bytes": result.pop("training_bytes"), **result, "glibc_live_tracking": live,
              "shard_bytes": shards, "saved_activation_bytes": saved and saved.bytes, "step_seconds": seconds[steps:],
              "tokens_per_step": accumulation * built.batch_size * cfg.data.seq_len * strategy.dp_size}
    if strategy.world_size > 1:  # every process's measurement, on every process
        gathered = [None] * strategy.world_size
        torch.distributed.all_gather_object(gathered, result)
        result = {"per_process": gathered}
    end_distributed(strategy)
    return result


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind these tensors (views of one buffer counted once)."""
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())
