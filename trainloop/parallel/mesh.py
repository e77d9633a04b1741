"""The run's one device mesh, from the parallel section's degrees (torchtitan's ParallelDims): pipeline stages
outermost, then the data-parallel replicas and shards, the context-parallel slices of a sequence, and tensor
parallelism innermost, so that a tp group's ranks are neighbours (a node's fastest links), then a cp group's.

Every dimension is in the mesh, those of size 1 too, so each strategy slices what it works on by name; the
flattened ones are those more than one strategy reads:
- `dp`: the ranks that read different samples (dp_replicate x dp_shard): what the loss, its units and the
  metrics are summed over;
- `dp_shard_cp`: what FSDP2 shards over, the context-parallel slices folded in (as torchtitan folds them):
  a cp group's ranks hold the same parameters and gradients, each its slices' share of them.

DeepSpeed's engine keeps its own groups: a ZeRO run builds a mesh only for context parallelism.
"""

from __future__ import annotations

import math

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def degrees(cfg, world_size: int) -> dict[str, int]:
    """Each dimension's size for `world_size` processes: dp_shard takes what the others leave. The strategy has
    refused a layout whose degrees do not divide the processes before this is asked."""
    p = cfg.parallel
    fixed = {"pp": p.pp_size, "dp_replicate": p.dp_replicate, "cp": p.cp_size, "tp": p.tp_size}
    return {**fixed, "dp_shard": world_size // math.prod(fixed.values())}


class Mesh:
    """The DeviceMesh of every dimension (DIMS, in that order, `root`), and the flattened ones (`dp`, and
    `dp_shard_cp` where context parallelism folds into the sharding): held as _flatten returned them, as torch
    asks (a flattened dimension sliced from the root is deprecated)."""

    def __init__(self, cfg, device_type: str, world_size: int):
        from torch.distributed.device_mesh import init_device_mesh

        self.sizes = degrees(cfg, world_size)
        if math.prod(self.sizes.values()) != world_size:
            raise ValueError(f"the degrees {self.sizes} do not make {world_size} processes")
        self.root = init_device_mesh(device_type, tuple(self.sizes[d] for d in DIMS), mesh_dim_names=DIMS)
        self.dp = self.root["dp_replicate", "dp_shard"]._flatten("dp")
        self.dp_shard_cp = self.root["dp_shard", "cp"]._flatten("dp_shard_cp") if self.sizes["cp"] > 1 else None
        self._sharding = {}  # (tp, replicate) -> its mesh: the policy and a frozen copy shard over the same one

    def __getitem__(self, names):
        return self.root[names]

    def group(self, name: str):
        return self.root.get_group(name)

    def local_rank(self, name: str) -> int:
        return self.root.get_local_rank(name)

    def sharding(self, tp: bool = False, replicate: bool = False):
        """The mesh FSDP2 shards over: dp_shard, with the cp slices folded in; (dp_replicate, dp_shard) for hybrid
        sharding; (that, tp) under tensor parallelism, whose matrices are split over tp first."""
        key = (tp, replicate)
        if key not in self._sharding:
            if replicate:
                self._sharding[key] = self.root["dp_replicate", "dp_shard"]
            elif tp:
                self._sharding[key] = self.root["dp_shard_cp" if self.dp_shard_cp is not None else "dp_shard", "tp"]
            else:
                self._sharding[key] = self.dp_shard_cp if self.dp_shard_cp is not None else self.root["dp_shard"]
        return self._sharding[key]
