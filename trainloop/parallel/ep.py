"""FSDP2 x expert parallelism (parallel.ep_size > 1, with fsdp=full_shard): a mixture's experts split over
ep_size processes, the rest of the model sharded by FSDP2 over all of them, as torchtitan lays it out.

The ep ranks are data-parallel ranks: every process reads its own samples and runs the router, attention
and the rest on them; a mixture layer sends each token's copies to the ranks that hold their experts and
takes the outputs back (trainloop.parallel.experts). The processes form an (efsdp, ep) mesh of consecutive ep
groups: each group holds every expert once, experts/ep_size on each process (DTensors sharded on the expert
dimension over ep), and FSDP2 shards those over the efsdp ranks, which hold the same experts, on their
second dimension (where efsdp is 1, nothing shards them further and FSDP2 leaves them alone). The
gradients: an expert's weights are used by every rank's tokens of its ep group, so the all-to-all's
backward sums those; the efsdp reduce sums the groups; both are divided by the data-parallel size, as FSDP2
divides the dense weights'. The rest is FSDP2's: DCP checkpoints (which reshard: an ep=2 checkpoint resumes
on one process, and the other way), the full state dict gathered over both dimensions for the export.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainloop.errors import ConfigError
from trainloop.parallel.fsdp2 import FSDP2, clip_over_meshes


@dataclass
class ExpertParallelConfig:
    """The parallel.* key of expert parallelism."""

    # processes that split each mixture-of-experts layer's experts (expert parallelism, with fsdp=full_shard):
    # each holds num_experts / ep_size of them and tokens reach them by all-to-all; 1: none. Must divide the
    # experts and the processes
    ep_size: int = 1


def is_expert(size: tuple[int, ...], shape) -> bool:
    """Whether a parameter of the planner's ModelShape is a fused expert tensor (the experts stacked on dimension 0)."""
    return len(size) == 3 and size[0] == shape.num_experts


class ExpertParallel(FSDP2):
    name = "fsdp2_ep"
    off = {"parallel.ep_size": 1}
    keys = ExpertParallelConfig

    @staticmethod
    def chooses(cfg) -> bool:
        return cfg.parallel.ep_size > 1

    @staticmethod
    def forwards_together(cfg) -> str | None:
        return "expert parallelism (parallel.ep_size > 1)"

    @staticmethod
    def layouts(gpus_per_node: int) -> dict[str, dict]:
        """FSDP2 x EP for each ep > 1 dividing a node's GPUs (the all-to-alls stay on NVLink)."""
        return {f"FSDP2 x EP{n}": {"fsdp": "full_shard", "parallel.ep_size": n}
                for n in range(2, gpus_per_node + 1) if gpus_per_node % n == 0}

    @staticmethod
    def settings(cfg) -> dict:
        return {**FSDP2.settings(cfg), "parallel.ep_size": cfg.parallel.ep_size}

    def __init__(self, cfg, accelerator):
        self.ep_size, processes = cfg.parallel.ep_size, accelerator.num_processes
        if processes % self.ep_size:
            raise ConfigError(f"parallel.ep_size={self.ep_size} does not divide the {processes} process(es): "
                              "launch a multiple of ep_size processes, or change parallel.ep_size")
        super().__init__(cfg, accelerator)
        self.shards = {}
        self.expert_weights, self.gradient_scale = [], 1.0

    def shard(self, model):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        from trainloop.parallel import experts
        from trainloop.parallel.sharding import fsdp_options, mixed_precision_policy, shard_model

        if experts.per_expert_modules(model):
            raise ConfigError(f"parallel.ep_size={self.ep_size}: this model keeps its experts as one module per "
                              f"expert ({experts.per_expert_modules(model)}), which trainloop does not split; "
                              "expert parallelism splits transformers 5's fused experts. Set parallel.ep_size=1")
        efsdp = self.world_size // self.ep_size
        self.expert_mesh = init_device_mesh(self.device.type, (efsdp, self.ep_size), mesh_dim_names=("efsdp", "ep"))
        dp = self.dp_size

        def split(model):
            self.shards = experts.split(model, self.expert_mesh["ep"])
            if not self.shards:
                raise ConfigError(f"parallel.ep_size={self.ep_size} but the model has no mixture-of-experts layer "
                                  "(no fused experts module): expert parallelism splits a mixture's experts; use "
                                  "model.arch=mixtral or a mixture with model=hf, or parallel.ep_size=1")
            # an expert's gradient is divided by the data-parallel size, as FSDP2 divides the dense weights': FSDP2
            # averages over the efsdp ranks where it shards them; clip_grad_norm divides by the rest, in place, once a
            # step (gloo has no pre-multiplied reduce for set_gradient_divide_factor; a backward hook would copy)
            ignored = set()
            self.gradient_scale = 1.0 / (self.ep_size if efsdp > 1 else dp)
            for name, shard in self.shards.items():
                module = model.get_submodule(name)
                if efsdp > 1:  # the efsdp ranks hold the same experts: FSDP2 shards them on dimension 1
                    fully_shard(module, **fsdp_options(self.cfg, self.expert_mesh["efsdp"], self.device),
                                shard_placement_fn=lambda p: Shard(1))
                else:  # each process's own experts, whole: nothing to gather or reduce
                    shard.compute_dtype = mixed_precision_policy(self.cfg.precision.name).param_dtype
                    ignored |= set(module.parameters(recurse=False))
            return ignored or None

        model = shard_model(self.cfg, model, self.device, self.fsdp_mesh(), experts=split)
        experts.hook(self.shards, model)
        self.expert_weights = [p for name in self.shards for p in model.get_submodule(name).parameters(recurse=False)]
        return model

    def clip_grad_norm(self, model, max_norm: float):
        """The experts' gradients divided by what FSDP2 did not divide them by (shard); then the norm over every
        mesh's gradients (the dense weights' on FSDP2's, the experts' on the ep mesh, or on (efsdp, ep))."""
        for weight in self.expert_weights:
            if weight.grad is not None:
                weight.grad.mul_(self.gradient_scale)
        return clip_over_meshes(model, max_norm, self.device)

    def describe(self, model) -> str:
        first = next(iter(self.shards.values()))
        per_rank = sum(p.to_local().numel() for name in self.shards
                       for p in model.get_submodule(name).parameters(recurse=False))
        total = sum(p.numel() for name in self.shards for p in model.get_submodule(name).parameters(recurse=False))
        efsdp = self.expert_mesh["efsdp"].size()
        module = model.get_submodule(next(iter(self.shards)))
        implementation = getattr(getattr(module, "config", None), "_experts_implementation", None) or "eager"
        return (f"FSDP2 x EP: mesh {self.device.type} {efsdp} efsdp x {self.ep_size} ep, {len(self.shards)} mixture "
                f"layers, {first.local} of {first.total} experts on each process (experts {first.first}-"
                f"{first.first + first.local - 1} here; {per_rank / 1e6:.2f}M of {total / 1e6:.2f}M expert "
                f"parameters), tokens to their experts by all-to-all, the local experts by {implementation}"
                f"{' (torch._grouped_mm)' if implementation == 'grouped_mm' else ''}; " + super().describe(model))

    @staticmethod
    def memory_lines(plan, cfg, shape, world_size: int, dev: str, half: bool) -> None:
        """FSDP2's lines (FSDP2.memory_lines): an expert's weights, gradients and optimizer state are 1/world_size
        per process here too (1/ep_size of the experts, sharded over the efsdp ranks), and the dense ones are FSDP2's
        over every process. What differs is what is gathered: a block's dense weights, and of its experts only this
        rank's, from the efsdp ranks (none where efsdp is 1: they are whole here, and their gradients land in place);
        and the all-to-all's copies, one more (tokens x top_k x hidden) per mixture layer kept for the backward (the
        combine's weighting; the module's own, of weight 1, keeps its output too)."""
        from trainloop.parallel.memory import Line

        FSDP2.memory_lines(plan, cfg, shape, world_size, dev, half)
        ep, pb = cfg.parallel.ep_size, (2 if half else 4)
        efsdp = max(1, world_size // ep)
        block = shape.largest_layer_params
        experts = shape.expert_params // max(1, shape.num_layers)  # one block's
        local = experts // ep if efsdp > 1 else 0  # the experts this rank gathers from its efsdp ranks
        root = max(0, shape.num_params - shape.num_layers * block)
        dense = block - experts
        for line in plan.lines:
            if line.what == "gathered parameters" and cfg.fsdp.reshard_after_forward:
                line.bytes = pb * (root + min(2, shape.num_layers) * (dense + local))
                line.note = (f"{pb} B/param, the root + 2 blocks' dense weights (current, prefetched)" +
                             (f" + this rank's {shape.num_experts // ep} experts of each" if local else
                              ", no expert: each process's own are whole"))
            elif line.what == "gathered parameters":
                line.bytes = pb * (shape.num_params - shape.num_layers * (experts - local))
            elif line.what == "unsharded gradients":
                line.bytes = pb * (root + dense + local) + 4 * (dense + local)
                line.note = (f"the root's and one block's dense weights' ({pb} B/param) + their fp32 reduce-scatter "
                             "input" + (", this rank's experts of the block too" if local else
                                        "; the experts' land in their gradients whole"))
        tokens = cfg.data.batch_size * cfg.data.seq_len * max(1, shape.experts_per_token)
        plan.lines.append(Line("expert all-to-all copies", shape.num_layers * tokens * shape.hidden * pb, dev,
                               "forward/backward", exact=False,
                               note=f"{cfg.data.batch_size} x {cfg.data.seq_len} tokens x top {shape.experts_per_token}"
                                    f" x {shape.hidden}, per mixture layer, kept for the backward"))
        if not local:  # whole here, each process's experts' gradients fill in place through the backward (FSDP2
            # reduce-scatters the rest into shards as each block's backward ends)
            plan.lines.append(Line("expert gradients", 4 * shape.expert_params // ep, dev, "forward/backward",
                                   note=f"fp32, this process's {shape.num_experts // ep} experts of every layer, "
                                        "made through the backward, freed by zero_grad"))
        if half and efsdp == 1:
            plan.lines.append(Line("experts in the compute dtype", pb * experts // ep, dev, "forward/backward",
                                   exact=False, note="one block's local experts cast for its forward"))
        plan.notes.append(f"expert parallelism: parallel.ep_size={ep} ranks split each mixture layer's "
                          f"{shape.num_experts} experts ({shape.num_experts // ep} per process), FSDP2 shards them "
                          f"over {efsdp} efsdp rank(s) and the dense weights over all {world_size}")

    @staticmethod
    def traffic_lines(plan, cfg, shape, world_size: int, half: bool) -> None:
        """FSDP2's collectives of the dense weights over every process, of each rank's experts over its efsdp ranks
        (none where efsdp is 1); and per micro-batch, for each mixture layer, the tokens' copies to their experts and
        back in the forward, and their gradients both ways in the backward (a checkpointed block's recomputed
        forward once more): the (ep - 1) / ep of them that leave the rank, with tokens spread evenly."""
        import dataclasses

        from trainloop.parallel.memory import Transfer, ring_bytes

        ep, pb, micro = cfg.parallel.ep_size, (2 if half else 4), cfg.trainer.gradient_accumulation_steps
        efsdp = max(1, world_size // ep)
        dense = dataclasses.replace(shape, shapes=[s for s in shape.shapes if not is_expert(s, shape)])
        FSDP2.traffic_lines(plan, cfg, dense, world_size, half)
        local = shape.expert_params // ep
        if efsdp > 1:
            gathers = 2 if cfg.fsdp.reshard_after_forward else 1
            reduces = micro if cfg.fsdp.sync_each_batch else 1
            plan.traffic.append(Transfer("expert all-gather (efsdp)", micro * gathers * ring_bytes(
                "all-gather", pb * local, efsdp), "dp", note=f"this rank's experts, over {efsdp} efsdp ranks"))
            plan.traffic.append(Transfer("expert reduce-scatter (efsdp)", reduces * ring_bytes(
                "reduce-scatter", 4 * local, efsdp), "dp", note="fp32"))
        copies = cfg.data.batch_size * cfg.data.seq_len * max(1, shape.experts_per_token) * shape.hidden * pb
        passes = 4 + (2 if cfg.model.gradient_checkpointing else 0)
        plan.traffic.append(Transfer("token all-to-all", micro * shape.num_layers * passes * copies * (ep - 1) // ep,
                                     "ep", note=f"{passes // 2} dispatch + combine per mixture layer, every "
                                                "micro-batch, tokens spread evenly"))

    @staticmethod
    def problems(cfg) -> list[str]:
        """What parallel.ep_size > 1 cannot run, known from the config alone."""
        ep = cfg.parallel.ep_size
        if ep <= 1:
            return []
        key, m, found = f"parallel.ep_size={ep}", cfg.model, []
        if cfg.deepspeed.stage:
            found.append(f"{key} with deepspeed.stage={cfg.deepspeed.stage}: expert parallelism runs on FSDP2's "
                         "mesh, not under DeepSpeed; choose deepspeed=none fsdp=full_shard (+preset=ep)")
        elif cfg.fsdp.name == "none":
            found.append(f"{key} with fsdp=none: expert parallelism runs with FSDP2 over the data-parallel ranks; "
                         "add fsdp=full_shard (+preset=ep)")
        if m.name == "tiny" and m.arch != "mixtral":
            found.append(f"{key} with model.arch={m.arch}: a dense model has no experts to split; use "
                         "model.arch=mixtral, or parallel.ep_size=1")
        if m.name == "tiny" and m.arch == "mixtral" and m.num_experts % ep:
            found.append(f"{key} does not divide model.num_experts={m.num_experts}: each process holds an equal "
                         f"share of the experts; choose an ep_size that divides {m.num_experts}")
        for other in ("tp_size", "pp_size", "cp_size", "dp_replicate"):
            if getattr(cfg.parallel, other, 1) > 1:
                found.append(f"{key} with parallel.{other}={getattr(cfg.parallel, other)}: expert parallelism "
                             "splits the data-parallel ranks of one FSDP2 mesh here, not beside "
                             f"{other.removesuffix('_size')}; choose one of them")
        if m.quantization != "none" or cfg.adapter.name != "none":
            found.append(f"{key} with adapter={cfg.adapter.name} model.quantization={m.quantization}: the experts "
                         "are split as whole weights; train them whole (adapter=none model.quantization=none)")
        return found
