"""Which parallelism runs, and every question that depends on it, answered in one place.

The strategy (none, ddp, zero1-3, fsdp2), a parameter's full shape and element count, this rank's
local shard, the full state dict for export, and the line the log states are asked here, never
by probing parameters elsewhere. Under ZeRO-3 DeepSpeed replaces each parameter's data by an
empty placeholder: the real shape is `ds_shape`, the element count `ds_numel`, this rank's flat
partition `ds_tensor`; only this module reads them. Under FSDP2 (trainloop/fsdp.py) each
parameter is a DTensor: its shape is the full one, `to_local()` this rank's shard, and gradients
are DTensors too, so the norm the guard reads is reduced over the shards here.
"""

from __future__ import annotations

from contextlib import contextmanager

def strategy(accelerator, model=None) -> str:
    """The strategy this run really uses, read back from accelerate and the model: none, ddp,
    zero1, zero2, zero3 or fsdp2. FSDP2 is applied by trainloop, not by accelerate (which reports
    MULTI_CPU/MULTI_GPU or NO for it), so only the model can tell it: pass it."""
    from accelerate.utils import DistributedType

    if model is not None and is_fsdp2(model):
        return "fsdp2"
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return f"zero{accelerator.state.deepspeed_plugin.zero_stage}"
    if accelerator.distributed_type == DistributedType.NO:
        return "none"
    return "ddp"  # MULTI_CPU, MULTI_GPU and the other multi-device types: DistributedDataParallel


def is_fsdp2(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _is_dtensor(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def full_shape(param) -> tuple[int, ...]:
    """The parameter's shape as the model defines it, whatever this rank holds (a DTensor's
    shape is the full one)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def full_numel(param) -> int:
    return getattr(param, "ds_numel", None) or param.numel()  # a DTensor's numel is the full one


def local_shard(param):
    """The part of the parameter this rank stores (all of it unless it is partitioned)."""
    if _is_dtensor(param):
        return param.to_local()
    return getattr(param, "ds_tensor", param)


def clip_grad_norm(accelerator, model, max_norm: float):
    """Clip the gradients to `max_norm` (inf: only measure) and return their global L2 norm.

    Under FSDP2 the gradients are DTensor shards: the norm is summed over every shard (the same
    on every rank) and returned as a plain tensor the guard can read; accelerate's clip would
    ask torch for a norm that is itself a DTensor.
    """
    if not is_fsdp2(model):
        return accelerator.clip_grad_norm_(model.parameters(), max_norm)
    import torch

    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    if _is_dtensor(norm):  # a partial norm per shard; offloaded shards sit on the CPU, the mesh on the device
        norm = norm.to(accelerator.device).full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


@contextmanager
def gradient_sync(accelerator, model, enabled: bool):
    """Reduce this micro-batch's gradients over the ranks, or only accumulate them locally (all
    micro-batches of a step but the last). accelerate's no_sync knows only the models it wrapped;
    FSDP2's switch is on the sharded model itself."""
    if is_fsdp2(model):
        model.set_requires_gradient_sync(enabled)
        yield
    elif enabled:
        yield
    else:
        with accelerator.no_sync(model):
            yield


def full_state_dict(accelerator, model) -> dict:
    """The full weights, on the main process ({} elsewhere). Every rank must call it.

    Under ZeRO-3 each rank holds a shard of every parameter, and accelerate's get_state_dict
    can return an empty dict on the main process (seen with accelerate 1.15 and DeepSpeed
    0.19 on 2 ranks) unless 16-bit gathering is on; so the parameters are gathered one at a
    time with DeepSpeed, which holds one whole tensor at once.
    """
    running = strategy(accelerator, model)
    if running == "fsdp2":  # rank 0 gathers every DTensor, one at a time, onto the CPU
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # a tied weight is gathered once per name, as two tensors: keep it under its first name,
        # as the other strategies do, or the export writes lm_head.weight beside the embedding
        aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        aliases -= {name for name, _ in model.named_parameters()}
        return {k: v for k, v in state.items() if k not in aliases} if accelerator.is_main_process else {}
    if running != "zero3":
        return accelerator.get_state_dict(model)
    import deepspeed

    unwrapped = accelerator.unwrap_model(model)
    state = {}
    for name, param in unwrapped.named_parameters():  # a tied weight comes once, under its first name
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            if accelerator.is_main_process:
                state[name] = param.detach().cpu().clone()
    if accelerator.is_main_process:  # buffers are not partitioned: take them as they are
        aliases = {name for name, _ in unwrapped.named_parameters(remove_duplicate=False)}
        state.update({k: v.detach().cpu().clone() for k, v in unwrapped.state_dict().items() if k not in aliases})
    return state


def describe(cfg, accelerator, model) -> str:
    """What really runs, read back from accelerate and the DeepSpeed engine, for the log.

    A DeepSpeed config that did not take (a launcher that started one process per replica, a
    plugin that was dropped) is an error here, not a quiet run without ZeRO.
    """
    kind = accelerator.distributed_type
    where = f"{accelerator.num_processes} process(es), {accelerator.device}, backend {accelerator.state.backend}"
    running = strategy(accelerator, model)
    if running == "fsdp2":
        import torch.distributed as dist

        from trainloop.fsdp import describe_sharding

        backend = dist.get_backend()  # accelerate names none for one process: the group FSDP2 uses
        return f"{describe_sharding(model)} ({accelerator.num_processes} process(es), {accelerator.device}, " \
               f"backend {backend})"
    if cfg.fsdp.name != "none":
        raise RuntimeError(f"fsdp={cfg.fsdp.name} but the model is not sharded ({kind}): FSDP2 was not applied")
    if running.startswith("zero"):
        stage = model.zero_optimization_stage()
        if stage != cfg.deepspeed.stage:
            raise RuntimeError(f"DeepSpeed runs ZeRO stage {stage} but deepspeed.stage={cfg.deepspeed.stage}")
        devices = {part: getattr(section, "device", "none") for part, section in
                   (("optimizer", model.zero_offload_optimizer()), ("parameter", model.zero_offload_param()))}
        devices = {part: str(getattr(device, "value", device)) for part, device in devices.items()}  # enum or str
        offload = [f"{part} offload to {device}" for part, device in devices.items() if device != "none"]
        return f"DeepSpeed ZeRO-{stage} engaged{' with ' + ' and '.join(offload) if offload else ''} " \
               f"({kind}, {where})"
    if cfg.deepspeed.stage:
        raise RuntimeError(f"deepspeed.stage={cfg.deepspeed.stage} but accelerate runs {kind}: DeepSpeed "
                           "was not engaged")
    return f"{kind} ({where})"
