"""PyTorch FSDP2 (`fully_shard`), applied by trainloop itself: every transformer block, then the root.

accelerate 1.15's FSDP plugin engages only on GPU device types: on CPU under torchrun it reports
DistributedType.NO and each process trains its own replica (seen on this project's machine). So
trainloop shards the model here, the same way on CPU (gloo) and on GPUs, and never hands the
model to `accelerator.prepare` (which would wrap it in DDP as well). accelerate still prepares the
optimizer and the validation loader and does reduce and backward.

The parameters become DTensors sharded on dim 0 over a 1-D mesh of all processes (with
parallel.tp_size, over the dp_shard dimension of a 2-D mesh, after trainloop.parallel.tensor_parallel has
split the blocks' matrices over its tp dimension); each block is
gathered just before it runs (and freed after it with fsdp.reshard_after_forward). Precision comes
from the precision group: bf16 computes with bf16 parameters and reduces gradients in fp32, the
sharded parameters and the optimizer state stay fp32.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("trainloop")

# precision group -> the dtype FSDP2 gathers the parameters in for compute (None: as stored, fp32)
PARAM_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


def mixed_precision_policy(precision: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype = PARAM_DTYPES[precision]  # validate() refuses fp16 with FSDP2
    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def fsdp_options(cfg, mesh, device: torch.device) -> dict:
    """fully_shard's arguments for the fsdp.* and precision keys, over `mesh` (1-D: shard; 2-D: replicate, shard)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    return {
        "mesh": mesh,
        "reshard_after_forward": cfg.fsdp.reshard_after_forward,
        "mp_policy": mixed_precision_policy(cfg.precision.name),
        "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")
        if cfg.fsdp.offload == "cpu" else OffloadPolicy(),
    }


def shard_model(cfg, model: torch.nn.Module, device: torch.device, mesh, experts=None) -> torch.nn.Module:
    """Shard `model` in place with fully_shard over `mesh` (a process group must exist: a launcher's, or
    accelerator.single_process_group_env's for one process); returns it.
    A model built on the meta device (trainloop.parallel.fsdp2's builds_on_meta) gets its shards from
    the main process. `mesh` (trainloop.parallel.mesh.Mesh.sharding's): a 2-D (dp_shard, "tp") mesh
    (parallel.tp_size): the blocks' matrices are first split over "tp" (trainloop.parallel.tensor_parallel), then
    FSDP2 shards over the first dimension (dp_shard, or dp_shard_cp with the cp slices folded in); a mesh
    of data-parallel dimensions alone (HSDP's ("dp_replicate", "dp_shard")): FSDP2 over it, sharding over the
    last, replicating over the first; else a 1-D mesh FSDP2 shards over.

    An adapter is applied and torch.compile (regional: each block) set up before this, as
    torchtitan does: the blocks are compiled, then sharded.

    `experts` (expert parallelism, trainloop.parallel.ep): called with the model once the main process's
    whole weights are taken, before the blocks are sharded; it splits the mixture's experts and returns the
    parameters FSDP2 leaves to it.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    from trainloop.model.compile import transformer_blocks

    tensor_parallel = "tp" in (mesh.mesh_dim_names or ())
    options = fsdp_options(cfg, mesh[mesh.mesh_dim_names[0]] if tensor_parallel else mesh, device)
    # Not model.to(device): fully_shard moves each module's own parameters to the mesh's device as
    # it shards them, so a GPU holds one whole block at a time, never the whole model.
    # the main process's whole weights, taken before sharding, when the others hold none
    from_main = dist.get_world_size() > 1
    whole = model.state_dict() if from_main and dist.get_rank() == 0 else {}
    blocks = transformer_blocks(model, "fsdp=full_shard", "fsdp=none")
    if tensor_parallel:  # split before sharding: FSDP2 shards the tp shards over dp_shard (2-D DTensors)
        from trainloop.parallel.tensor_parallel import apply_tensor_parallel, tensor_parallel_plan

        apply_tensor_parallel(model, mesh["tp"], tensor_parallel_plan(model.config, mesh["tp"].size()),
                              cfg.parallel.sequence_parallel)
    ignored = experts(model) if experts is not None else None
    for block in blocks:
        fully_shard(block, **options, ignored_params=ignored)
    fully_shard(model, **options, ignored_params=ignored)  # the root: what no block holds (embeddings, final norm, output head)
    # Generation (eval.prompts, objective=grpo) calls the root's generate: a PEFT model's reaches the
    # inner model's forward, past the root's hooks, so its embeddings would stay sharded. Marked as a
    # forward, generate gathers the root's parameters around it. A score head (objective=reward) has none.
    if hasattr(model, "generate"):
        register_fsdp_forward_method(model, "generate")
    if from_main:
        _receive_from_main(model, whole, torch.device("cpu") if cfg.fsdp.offload == "cpu" else device)
    return model


def _receive_from_main(model: torch.nn.Module, whole: dict, device: torch.device) -> None:
    """Every process: the main process's weights (`whole`; empty elsewhere) scattered into the
    shards, its buffers copied, and its random number generator's state taken, so that every
    process continues as if it had drawn the same initial weights itself."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    persistent = set(model.state_dict())
    on_meta = [None] * dist.get_world_size()
    dist.all_gather_object(on_meta, any(p.is_meta for p in model.parameters()))
    if on_meta[dist.get_rank()]:
        model.to_empty(device=device)  # storage for the shards, filled below
    set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, buffer in model.named_buffers():  # not in a state dict: rotary frequencies and the like
        if name not in persistent:
            dist.broadcast(buffer, src=0)
    rng = [torch.get_rng_state()]  # the main process drew the weights: the others skipped those draws
    dist.broadcast_object_list(rng, src=0)
    torch.set_rng_state(rng[0])
    log.info("FSDP2: the main process built the weights; %d of %d processes built the model on the meta "
             "device and received their shards", sum(on_meta), len(on_meta))


def fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def sharding_settings(model: torch.nn.Module) -> dict:
    """The settings FSDP2 really applied, read back from its state on each sharded block (the
    root's reshard setting is FSDP2's own business once it runs): what fsdp.* configured."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    blocks = fsdp_modules(model)[:-1] or fsdp_modules(model)  # model.modules() lists the root first
    groups = [m._get_fsdp_state()._fsdp_param_group for m in blocks]  # noqa: SLF001 - FSDP2 keeps its policies there
    groups = [g for g in groups if g is not None]  # a module without parameters of its own has none
    if not groups:
        raise RuntimeError("fsdp=full_shard: FSDP2 holds no parameters of this model")
    found = {
        "reshard_after_forward": {g.post_forward_mesh_info is not None for g in groups},
        "offload": {"cpu" if isinstance(g.offload_policy, CPUOffloadPolicy) else "none" for g in groups},
        "param_dtype": {g.mp_policy.param_dtype for g in groups},
        "reduce_dtype": {g.mp_policy.reduce_dtype for g in groups},
        "reduce_grads": {g.reduce_grads for g in groups},  # set_requires_gradient_sync's switch, as it is now
    }
    mixed = {k: v for k, v in found.items() if len(v) > 1}
    if mixed:
        raise RuntimeError(f"fsdp=full_shard: the blocks were sharded with different settings {mixed}")
    return {k: v.pop() for k, v in found.items()}


def describe_sharding(model: torch.nn.Module) -> str:
    """What FSDP2 really does, read back from the model: its sharded modules, the DTensors'
    placements and mesh, the compute dtype and where the shards live."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if isinstance(p, DTensor)]
    if not params:
        raise RuntimeError("fsdp=full_shard but no parameter of the model is a DTensor: FSDP2 was not applied")
    plain = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise RuntimeError(f"fsdp=full_shard left {len(plain)} parameter(s) unsharded, e.g. {plain[:3]}")
    mesh = params[0].device_mesh
    placements = sorted({", ".join(map(repr, p.placements)) for p in params})
    modules = fsdp_modules(model)
    settings = sharding_settings(model)
    compute = str(settings["param_dtype"] or params[0].dtype).removeprefix("torch.")
    offload = " with CPU offload" if settings["offload"] == "cpu" else ""
    storage = {str(p.to_local().device.type) for p in params}
    return (f"FSDP2 full_shard{offload} over {mesh.size()} shard(s) (DTensor placements {' / '.join(placements)}, "
            f"mesh {mesh.device_type} {tuple(mesh.shape)}; {len(modules)} modules sharded: "
            f"{len(modules) - 1} blocks + root; compute in {compute}, shards on {'/'.join(sorted(storage))}"
            f"{'' if settings['reshard_after_forward'] else '; blocks stay gathered after forward'})")
