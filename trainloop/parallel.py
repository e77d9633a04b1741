"""Which parallelism runs, and every question that depends on it, answered in one place.

The strategy (none, ddp, zero1-3), a parameter's full shape and element count, this rank's
local shard, the full state dict for export, and the line the log states are asked here, never
by probing parameters elsewhere. Under ZeRO-3 DeepSpeed replaces each parameter's data by an
empty placeholder: the real shape is `ds_shape`, the element count `ds_numel`, this rank's flat
partition `ds_tensor`; only this module reads them. A new strategy (FSDP2: DTensor parameters)
is a new branch of each function here.
"""

from __future__ import annotations

def strategy(accelerator) -> str:
    """The strategy this run really uses, read back from accelerate: none, ddp, zero1, zero2 or zero3."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return f"zero{accelerator.state.deepspeed_plugin.zero_stage}"
    if accelerator.distributed_type == DistributedType.NO:
        return "none"
    return "ddp"  # MULTI_CPU, MULTI_GPU and the other multi-device types: DistributedDataParallel


def full_shape(param) -> tuple[int, ...]:
    """The parameter's shape as the model defines it, whatever this rank holds."""
    return tuple(getattr(param, "ds_shape", param.shape))


def full_numel(param) -> int:
    return getattr(param, "ds_numel", None) or param.numel()


def local_shard(param):
    """The part of the parameter this rank stores (all of it unless it is partitioned)."""
    return getattr(param, "ds_tensor", param)


def full_state_dict(accelerator, model) -> dict:
    """The full weights, on the main process ({} elsewhere). Every rank must call it.

    Under ZeRO-3 each rank holds a shard of every parameter, and accelerate's get_state_dict
    can return an empty dict on the main process (seen with accelerate 1.15 and DeepSpeed
    0.19 on 2 ranks) unless 16-bit gathering is on; so the parameters are gathered one at a
    time with DeepSpeed, which holds one whole tensor at once.
    """
    if strategy(accelerator) != "zero3":
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
    running = strategy(accelerator)
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
