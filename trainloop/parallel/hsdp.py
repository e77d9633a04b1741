"""Hybrid sharding (HSDP: parallel.dp_replicate > 1, with fsdp=full_shard): FSDP2 over a 2-D data-parallel mesh,
(dp_replicate, dp_shard). Each group of dp_shard consecutive ranks (a node's fast links, as torchtitan lays it
out) holds one copy of the parameters, gradients and optimizer state sharded among them, gathering and
reduce-scattering within the group as FSDP2 does; the dp_replicate groups hold the same shards and all-reduce
their gradient shards, so the slower links between them carry 1/dp_shard of the gradients. Every process is
a data-parallel rank, as under FSDP2; checkpoints are DCP's, which load at any layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainloop.errors import ConfigError
from trainloop.parallel.degrees import splits
from trainloop.parallel.fsdp2 import FSDP2


@dataclass
class HybridShardConfig:
    """The parallel.* key of hybrid sharding."""

    # FSDP2 replicas (hybrid sharding, with fsdp=full_shard): the processes form a dp_replicate x dp_shard mesh,
    # each group of processes / dp_replicate consecutive ranks shards the model and the groups replicate it;
    # 1: none (fsdp=full_shard shards over every process)
    dp_replicate: int = 1


class HybridShard(FSDP2):
    name = "hsdp"
    keys = HybridShardConfig
    off = {"parallel.dp_replicate": 1}

    @staticmethod
    def chooses(cfg) -> bool:
        return cfg.parallel.dp_replicate > 1

    @staticmethod
    def layouts(gpus_per_node: int) -> dict[str, dict]:
        return {}  # its replicas are nodes: `plan --suggest` weighs one node's layouts

    @staticmethod
    def forwards_together(cfg) -> str | None:
        return "hybrid sharding (parallel.dp_replicate > 1)"

    def __init__(self, cfg, accelerator):
        replicas, processes = cfg.parallel.dp_replicate, accelerator.num_processes
        if processes % replicas or processes == replicas:
            raise ConfigError(f"parallel.dp_replicate={replicas} must divide the {processes} process(es) into groups "
                              "of 2 or more that shard the model: launch a multiple of it, or change it")
        super().__init__(cfg, accelerator)

    def fsdp_mesh(self):
        return self.mesh.sharding(replicate=True)

    @staticmethod
    def shard_group(cfg, world_size: int) -> int:
        """The processes that shard one replica (dp_shard) when `world_size` are planned; at least 1: the planner
        also weighs a world size this layout cannot launch on (its presets beside a one-process config)."""
        return max(world_size // cfg.parallel.dp_replicate, 1)

    @staticmethod
    def memory_lines(plan, cfg, shape, world_size: int, dev: str, half: bool) -> None:
        """FSDP2's, over one group of the shards: each holds 1/dp_shard of the model state."""
        FSDP2.memory_lines(plan, cfg, shape, HybridShard.shard_group(cfg, world_size), dev, half)

    @staticmethod
    def traffic_lines(plan, cfg, shape, world_size: int, half: bool) -> None:
        """FSDP2's within a group, and the gradient shards all-reduced over the replicas once they are reduced."""
        from trainloop.parallel.memory import Transfer, ring_bytes

        shards = HybridShard.shard_group(cfg, world_size)
        replicas = world_size // shards
        FSDP2.traffic_lines(plan, cfg, shape, shards, half)
        if replicas < 2:
            return
        reduces = cfg.trainer.gradient_accumulation_steps if cfg.fsdp.sync_each_batch else 1
        plan.traffic.append(Transfer("gradient shard all-reduce over the replicas",
                                     reduces * ring_bytes("all-reduce", 4 * shape.num_trainable // shards, replicas),
                                     "dp", note=f"fp32, 1/{shards} of the gradients, {replicas} replicas"))

    @staticmethod
    def problems(cfg) -> list[str]:
        replicas = cfg.parallel.dp_replicate
        if replicas == 1:
            return []
        key = f"parallel.dp_replicate={replicas}"
        if replicas < 1:
            return [f"{key} must be 1 or more"]
        found = []
        if cfg.fsdp.name == "none":
            found.append(f"{key} replicates FSDP2's shards, and fsdp=none shards nothing: set fsdp=full_shard "
                         "(or +preset=fsdp), or parallel.dp_replicate=1")
        for split in splits(cfg):  # parallel.tp_size=2, ...
            found.append(f"{key} with {split}: hybrid sharding runs on a data-parallel mesh alone for now; set "
                         f"{split.split('=')[0]}=1 or parallel.dp_replicate=1")
        return found
