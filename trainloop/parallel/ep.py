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
from trainloop.parallel.fsdp2 import FSDP2
from trainloop.model.tensors import is_dtensor


@dataclass
class ExpertParallelConfig:
    """The parallel.* key of expert parallelism."""

    # processes that split each mixture-of-experts layer's experts (expert parallelism, with fsdp=full_shard):
    # each holds num_experts / ep_size of them and tokens reach them by all-to-all; 1: none. Must divide the
    # experts and the processes
    ep_size: int = 1


class ExpertParallel(FSDP2):
    name = "fsdp2_ep"
    saves_async = True
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
            # averages over the efsdp ranks where it shards them, the rest is the shard's own (gloo has no
            # pre-multiplied reduce for set_gradient_divide_factor)
            ignored = set()
            for name, shard in self.shards.items():
                module = model.get_submodule(name)
                if efsdp > 1:  # the efsdp ranks hold the same experts: FSDP2 shards them on dimension 1
                    fully_shard(module, **fsdp_options(self.cfg, self.expert_mesh["efsdp"], self.device),
                                shard_placement_fn=lambda p: Shard(1))
                    shard.gradient_scale = 1.0 / self.ep_size
                else:  # each process's own experts, whole: nothing to gather or reduce
                    shard.gradient_scale = 1.0 / dp
                    shard.compute_dtype = mixed_precision_policy(self.cfg.precision.name).param_dtype
                    ignored |= set(module.parameters(recurse=False))
            return ignored or None

        model = shard_model(self.cfg, model, self.device, self.fsdp_mesh(), experts=split)
        experts.hook(self.shards, model)
        return model

    def clip_grad_norm(self, model, max_norm: float):
        """The global L2 norm over every mesh's gradients (the dense weights' on FSDP2's, the experts' on the
        ep mesh, or on (efsdp, ep)): one exact norm per mesh, combined; then every gradient clipped."""
        import torch

        by_mesh: dict = {}
        for p in model.parameters():
            if p.grad is not None:
                by_mesh.setdefault(p.grad.device_mesh if is_dtensor(p.grad) else None, []).append(p)
        norms = []
        for params in by_mesh.values():
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
            norms.append(norm.to(self.device).full_tensor() if is_dtensor(norm) else norm.to(self.device))
        norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), device=self.device)
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

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
