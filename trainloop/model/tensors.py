"""A parameter's full shape, element count and this rank's local shard, whatever sharded it.

Under ZeRO-3 DeepSpeed replaces each parameter's data by an empty placeholder: the real shape is
`ds_shape`, the element count `ds_numel`, this rank's flat partition `ds_tensor`; only this
module reads them. Under FSDP2 (trainloop/parallel/sharding.py) each parameter is a DTensor: its shape is the
full one and `to_local()` this rank's shard.
"""

from __future__ import annotations


def is_fsdp2(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def is_dtensor(tensor) -> bool:
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
    if is_dtensor(param):
        return param.to_local()
    return getattr(param, "ds_tensor", param)
