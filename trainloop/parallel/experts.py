"""Expert parallelism (parallel.ep_size): each mixture-of-experts layer's experts split over the `ep` ranks, and
its tokens sent to their experts' ranks and back by all-to-all.

A transformers 5 mixture keeps its experts fused: one module (`experts`, its class marked by transformers'
`use_experts_implementation`) holds every expert's weights stacked on dimension 0 (`gate_up_proj`,
`down_proj`, their biases where the model has them), and is called as experts(tokens, top_k_index,
top_k_weights) after the router chose. `split` keeps this rank's contiguous num_experts / ep_size of them
(rank r: experts r * local ... (r + 1) * local - 1) as DTensors of the whole shapes, sharded over the ep
mesh, and `hook` wraps the module's call in two hooks:

- dispatch (before the call): each token is copied once per chosen expert, sorted by expert, and the copies
  sent to the ranks that hold their experts (all-to-all, the counts first: one host read of them per layer
  and forward, which the split sizes need); the module then runs on what this rank received, each copy
  routed to its local expert with weight 1. The module computes as the model defines it
  (config._experts_implementation: transformers' loop, or its grouped matmul, torch._grouped_mm);
- combine (after it): the outputs go back by the reverse all-to-all, and each token's are weighted by its
  router weights and summed, as the module would have: dropless, nothing capped.

Both all-to-alls are differentiable (torch's functional collectives): the backward sends the gradients the
same ways reversed. Everything else (the router, its top-k and load-balancing loss, shared experts, attention)
is the model's own and runs on each rank's own tokens, as data parallelism runs it: the ep ranks are
data-parallel ranks, which read different samples (torchtitan's and Megatron's layout).

A mixture whose experts are per-expert modules (a ModuleList of MLPs, older layouts) is not split:
`per_expert_modules` names it, for the strategy's refusal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FUSED = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


def find(model) -> list[tuple[str, torch.nn.Module]]:
    """Every fused experts module of `model` (name, module): a module with `num_experts` whose fused weights
    are stacked on dimension 0 by expert."""
    found = []
    for name, module in model.named_modules():
        weights = [getattr(module, w, None) for w in FUSED]
        weights = [w for w in weights if isinstance(w, torch.Tensor)]
        if weights and isinstance(getattr(module, "num_experts", None), int) and all(
                w.shape[0] == module.num_experts for w in weights):
            found.append((name, module))
    return found


def per_expert_modules(model) -> str | None:
    """The name of a mixture's experts held as one module per expert (which `split` does not split), or None."""
    for name, module in model.named_modules():
        if name.endswith("experts") and isinstance(module, torch.nn.ModuleList):
            return name
    return None


@dataclass
class Routed:
    """One forward's dispatch, kept for its combine: how the copies were sorted and sent."""

    order: torch.Tensor  # the (token, slot) copies, sorted by expert
    sent: list[int]  # copies sent to each ep rank
    received: list[int]  # copies received from each
    weights: torch.Tensor  # (tokens, top_k) router weights
    tokens: int
    copies: torch.Tensor  # what this rank received: the module's input


class ExpertShard:
    """The dispatch and combine hooks of one experts module split over the ep mesh: this rank holds experts
    [first, first + local). Its weights are DTensors sharded on dimension 0 over the ep mesh (the whole
    model's shapes: checkpoints and the exported model see every expert); for the module's own forward the
    hooks shadow each with this rank's plain tensor (`compute`), as FSDP2 gathered it where it shards them."""

    def __init__(self, module: torch.nn.Module, mesh, weights: list[str]):
        self.mesh, self.group, self.size = mesh, mesh.get_group(), mesh.size()
        self.total = module.num_experts
        self.local = self.total // self.size
        self.first = mesh.get_local_rank() * self.local
        self.weights = weights
        self.compute_dtype = None  # where FSDP2 does not cast them: its mixed-precision dtype
        self.pending: list[Routed] = []  # a forward's dispatch, until its combine

    def compute(self, weight):
        local = weight.to_local()
        return local if self.compute_dtype is None else local.to(self.compute_dtype)

    def dispatch(self, module, args):
        import torch.distributed as dist
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        for w in self.weights:  # read by the module's forward before its parameters (module.__dict__ first)
            module.__dict__[w] = self.compute(module._parameters[w])
        hidden, index, weights = args
        k = index.shape[-1]
        flat = index.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.total)  # copies per expert, global numbering
        incoming = torch.empty_like(counts)  # from each rank, for each of mine: (size, local) flattened
        dist.all_to_all_single(incoming, counts, group=self.group)
        per_rank = torch.stack([counts.view(self.size, self.local).sum(1), incoming.view(self.size, self.local).sum(1)])
        sent, received = per_rank.tolist()  # the split sizes: the one host read
        copies = all_to_all_single_autograd(hidden[order // k], received, sent, self.group)
        local_index = torch.arange(self.local, device=index.device).repeat(self.size).repeat_interleave(
            incoming, output_size=copies.shape[0]).unsqueeze(-1)
        self.pending.append(Routed(order, sent, received, weights, hidden.shape[0], copies))
        return copies, local_index, torch.ones_like(local_index, dtype=weights.dtype)

    def combine(self, module, args, output):
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        routed = self.pending.pop()
        if output.shape[0] == 0:  # no token came: the module's output of nothing may hang from nothing. Keep what
            # came and the local weights in the graph: the backward's all-to-all of the dispatch runs on every rank
            # (the others wait for it), and the weights get a gradient of zeros, as one process's stacked weights
            # always get one (the reductions need them all)
            kept = [routed.copies] + [module.__dict__[w] for w in self.weights]
            output = output + sum(t.reshape(-1)[:1].sum() * 0 for t in kept)
        for w in self.weights:
            del module.__dict__[w]
        back = all_to_all_single_autograd(output, routed.sent, routed.received, self.group)
        k = routed.weights.shape[-1]
        copies = back.new_zeros(routed.tokens * k, back.shape[-1]).index_copy(0, routed.order, back)
        weighted = copies.view(routed.tokens, k, -1) * routed.weights.unsqueeze(-1)
        return weighted.sum(1).to(output.dtype)


def split(model, mesh) -> dict[str, ExpertShard]:
    """Keep this rank's share of every fused experts module's experts, as DTensors over `mesh` (the 1-D ep
    mesh), and hook its calls (module docstring); returns the shards by module name. A rank that built the
    model on the meta device keeps meta tensors, filled when the weights arrive from the main process."""
    from torch.distributed.tensor import DTensor, Shard

    from trainloop.errors import ConfigError

    shards = {}
    for name, module in find(model):
        if module.num_experts % mesh.size():
            raise ConfigError(f"parallel.ep_size={mesh.size()} must divide the {module.num_experts} experts of "
                              f"{name}: each process holds an equal share of them; choose an ep_size that divides them")
        weights = [w for w in FUSED if isinstance(getattr(module, w, None), torch.nn.Parameter)]
        shard = shards[name] = ExpertShard(module, mesh, weights)
        for w in weights:
            whole = getattr(module, w)
            kept = whole.detach()[shard.first:shard.first + shard.local].clone()
            split_weight = DTensor.from_local(kept, mesh, [Shard(0)], run_check=False, shape=whole.shape,
                                              stride=whole.stride())
            setattr(module, w, torch.nn.Parameter(split_weight, requires_grad=whole.requires_grad))
        module.num_experts = shard.local  # what the module's forward routes over: the copies it receives
    return shards


def hook(shards: dict[str, ExpertShard], model) -> None:
    """Register each shard's dispatch and combine on its module: after FSDP2's own hooks, which gather the
    weights the dispatch reads."""
    for name, shard in shards.items():
        module = model.get_submodule(name)
        module.register_forward_pre_hook(shard.dispatch)
        module.register_forward_hook(shard.combine)
