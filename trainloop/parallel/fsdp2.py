"""PyTorch FSDP2 (fsdp=full_shard), applied by trainloop (trainloop/parallel/sharding.py): parameters, gradients
and optimizer state are DTensors sharded over the ranks; checkpoints in DCP format (trainloop/parallel/dcp.py)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from trainloop.parallel.base import Strategy, running
from trainloop.parallel.process_group import single_process_group_env
from trainloop.model.tensors import is_dtensor


@dataclass
class FsdpConfig:
    """The fsdp.* keys: this row's (and FSDP2 x TP's)."""

    name: str = "none"  # none; full_shard: PyTorch FSDP2 (fully_shard) on every transformer block, then the root
    reshard_after_forward: bool = True  # full_shard only: free the gathered parameters after forward (less memory, one more all-gather)
    offload: str = "none"  # full_shard only: none, cpu (parameters, gradients and optimizer state in CPU memory)
    # full_shard with gradient accumulation: reduce-scatter every micro-batch's gradients into the shards
    # (true: accelerate's sync_each_batch; FSDP's memory) or only the last one's (false: fewer collectives,
    # but every block's unsharded fp32 gradients, 4 B x the whole model, held across the micro-batches)
    sync_each_batch: bool = True


def clip_over_meshes(model, max_norm: float, device):
    """The global L2 norm of the gradients of parameters that live on several meshes (tensor-parallel ones on a 2-D
    mesh beside the others on dp_shard; experts on the ep mesh beside FSDP2's): one norm per mesh, exact by its
    DTensor placements (a replicated shard counted once), combined; then every gradient clipped by it."""
    import torch

    by_mesh: dict = {}
    for p in model.parameters():
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if is_dtensor(p.grad) else None, []).append(p)
    norms = []
    for params in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        norms.append(norm.to(device).full_tensor() if is_dtensor(norm) else norm.to(device))
    norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), device=device)
    for params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


class FSDP2(Strategy):
    name = "fsdp2"
    saves_async = True
    autocast = False  # MixedPrecisionPolicy: blocks compute on bf16 copies of the fp32 shards
    off = {"fsdp": "none", "fsdp.offload": "none", "parallel.cp_size": 1}

    @staticmethod
    def chooses(cfg) -> bool:
        return cfg.fsdp.name != "none"

    @staticmethod
    def shards_weights(cfg) -> bool:
        return True

    @staticmethod
    def forwards_together(cfg) -> str | None:
        return "FSDP2 (fsdp=full_shard)"

    @staticmethod
    def layouts(gpus_per_node: int) -> dict[str, dict]:
        """FSDP2, with CPU offload, and with context parallelism over 2, 4 and 8 of a node's GPUs
        (long sequences: each holds a slice of every sequence; FSDP2 shards over all, cp folded in)."""
        return {"FSDP2": {"fsdp": "full_shard"}, "FSDP2 + CPU offload": {"fsdp": "full_shard", "fsdp.offload": "cpu"},
                **{f"FSDP2 x CP{n}": {"fsdp": "full_shard", "parallel.cp_size": n}
                   for n in (2, 4, 8) if gpus_per_node % n == 0}}

    @staticmethod
    def settings(cfg) -> dict:
        return {"fsdp.name": cfg.fsdp.name, "fsdp.offload": cfg.fsdp.offload,
                "fsdp.reshard_after_forward": cfg.fsdp.reshard_after_forward}

    @staticmethod
    def accelerator_arguments(cfg, on_cuda: bool) -> tuple[dict, dict]:
        single_process_group_env()  # FSDP2's device mesh needs a process group, even of one
        return Strategy.accelerator_arguments(cfg, on_cuda)

    def builds_on_meta(self) -> bool:
        """Several processes: only the main process draws the random weights (model=tiny) or loads
        the pretrained ones (model=hf); the others build the model's shapes on the meta device (no
        memory) and receive their shards from it in shard(). An N-process node holds one whole
        copy in host memory, not N."""
        return self.world_size > 1 and not self.accelerator.is_main_process

    def fsdp_mesh(self):
        """The mesh FSDP2 shards over: every process (dp_shard, the cp slices folded in)."""
        return self.mesh.sharding()

    def shard(self, model):
        from trainloop.parallel.sharding import shard_model

        return shard_model(self.cfg, model, self.device, self.fsdp_mesh())

    def prepare_frozen(self, model):
        """Sharded as the policy is (every block, then the root; shards from the main process),
        gathered block by block in its forward: no process holds a whole second copy."""
        from trainloop.parallel.sharding import shard_model

        return shard_model(self.cfg, model, self.device, self.fsdp_mesh()).eval()

    def prepare(self, model, optimizer):
        # sharded by trainloop: accelerate must not wrap the model in DDP too
        return model, self.accelerator.prepare(optimizer)

    def clip_grad_norm(self, model, max_norm: float):
        """The gradients are DTensor shards: the norm is summed over every shard (the same on every
        rank) and returned as a plain tensor the guard can read; accelerate's clip would ask torch
        for a norm that is itself a DTensor."""
        import torch

        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        if is_dtensor(norm):  # a partial norm per shard; offloaded shards sit on the CPU, the mesh on the device
            norm = norm.to(self.device).full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    @contextmanager
    def gradient_sync(self, model, enabled: bool):
        """Off until the step's last micro-batch only with fsdp.sync_each_batch=false: FSDP2 then sums
        every block's unsharded gradients over the micro-batches; by default each micro-batch's are
        reduce-scattered and summed into the shards (accelerate's no_sync knows only the models it
        wrapped; FSDP2's switch is on the model itself)."""
        model.set_requires_gradient_sync(enabled or self.cfg.fsdp.sync_each_batch)
        yield

    def save_state(self, directory, model, adapter_only: bool, record) -> None:
        from trainloop.parallel import dcp

        dcp.save(directory, model, self.accelerator._optimizers[0], adapter_only, record)
        dcp.save_rank_states(self.accelerator, directory)

    def load_state(self, path, model, adapter_only: bool) -> None:
        from trainloop.parallel import dcp

        # a pipeline's checkpoint (pp x dp_shard under fsdp=full_shard) keys its optimizer state by name
        dcp.load(path, model, self.accelerator._optimizers[0], adapter_only, flatten=dcp.flattened(path))
        dcp.load_rank_states(self.accelerator, path)

    def full_state_dict(self, model) -> dict:
        """Rank 0 gathers every DTensor, one at a time, onto the CPU."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # a tied weight is gathered once per name, as two tensors: keep it under its first name,
        # as the other strategies do, or the export writes lm_head.weight beside the embedding
        aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        aliases -= {name for name, _ in model.named_parameters()}
        return {k: v for k, v in state.items() if k not in aliases} if self.accelerator.is_main_process else {}

    def describe(self, model) -> str:
        import torch.distributed as dist

        from trainloop.parallel.sharding import describe_sharding

        acc = self.accelerator
        if running(acc, model) != "fsdp2":
            raise RuntimeError(f"fsdp={self.cfg.fsdp.name} but the model is not sharded ({acc.distributed_type}): "
                               "FSDP2 was not applied")
        backend = dist.get_backend()  # accelerate names none for one process: the group FSDP2 uses
        return (f"{describe_sharding(model)} ({acc.num_processes} process(es){self.splits()}, {acc.device}, "
                f"backend {backend})")

    @staticmethod
    def memory_lines(plan, cfg, shape, world_size: int, dev: str, half: bool) -> None:
        """FSDP2 (fully_shard on every block, then the root): every parameter is split along its first
        dimension, each process storing ceil(rows / N) rows in fp32 (the sharded parameters are the
        master weights; MixedPrecisionPolicy casts a block's parameters to bf16 when it is gathered);
        the gradient and the optimizer state of a shard are shaped like it. Those are exact; the
        transients of the block being computed are estimates:
        - forward/backward: the root's parameters (embeddings, final norm, output head) stay gathered
          from the forward to the end of the backward; each block's are gathered just before it runs
          (the current block and the next one prefetched: two at once), or, with
          reshard_after_forward=false, kept from its forward until its backward (the whole model at the
          start of the backward); in the backward a block's unsharded gradients and the flat fp32
          reduce-scatter input they are copied into, and the root's unsharded gradients; with gradient
          accumulation, the gradient shards from the first micro-batch's reduce-scatter on (each
          micro-batch's summed into them), or with fsdp.sync_each_batch=false every block's unsharded
          gradients, in fp32, summed over the micro-batches (gradient sync is off until the last one,
          so nothing is reduce-scattered before);
        - fsdp.offload=cpu: the shards, their gradients and optimizer state live in CPU memory and
          the optimizer steps there; the device holds the gathered working set only.
        """
        import math

        from trainloop.optim.optimizers import planned_state_bytes, planned_step_temporaries
        from trainloop.parallel.memory import Line

        opt, n = cfg.optimizer, world_size
        pb = 2 if half else 4  # the gathered (compute) copies: MixedPrecisionPolicy's param_dtype
        local = lambda shapes: [(math.ceil(s[0] / n), *s[1:]) if s else s for s in shapes]  # noqa: E731
        sharded, trainable = local(shape.shapes), local(shape.trainable_shapes)
        home = "cpu" if cfg.fsdp.offload == "cpu" else dev
        shard_note = f"1/{n} per process (FSDP2)" if n > 1 else "one process: the shard is everything"
        add = plan.lines.append
        accumulating = cfg.trainer.gradient_accumulation_steps > 1
        summed_in_shards = accumulating and cfg.fsdp.sync_each_batch  # each micro-batch reduce-scattered into them
        held_unsharded = accumulating and not cfg.fsdp.sync_each_batch
        adapters = trainable if shape.trainable is not None else []  # an adapter's matrices come on top of the base
        add(Line("parameters", 4 * sum(math.prod(s) for s in sharded + adapters), home,
                 note=f"fp32 shards, {shard_note}"))
        # made by a micro-batch's reduce-scatter (the first one's when each is synced: held through the
        # later ones' forward and backward), freed by zero_grad
        add(Line("gradients", 4 * sum(math.prod(s) for s in trainable), home,
                 None if summed_in_shards else "optimizer step",
                 note=f"fp32 shards (reduce-scattered), {shard_note}, freed by zero_grad"
                      + (", summed over the micro-batches" if summed_in_shards else "")))
        states = planned_state_bytes(opt, trainable, shape.hidden_matrix)
        t = max(1, sum(math.prod(s) for s in trainable))
        add(Line("optimizer states", states, home, note=f"{opt.name} on the shards, {states / t:.2f} B per local param"))
        add(Line("optimizer step temporaries", planned_step_temporaries(opt, plan.device == "cuda", trainable,
                                                                      shape.hidden_matrix),
                 home, "optimizer step", exact=False))
        block = shape.largest_layer_params
        root = max(0, shape.num_params - shape.num_layers * block)  # embeddings, final norm, output head
        if cfg.fsdp.reshard_after_forward:
            gathered, note = root + min(2, shape.num_layers) * block, "the root + 2 blocks (current, prefetched)"
        else:
            gathered = shape.num_params
            note = "fsdp.reshard_after_forward=false: every block stays gathered until its backward"
        add(Line("gathered parameters", pb * gathered, dev, "forward/backward", exact=False,
                 note=f"{pb} B/param, " + note))
        if shape.trainable is not None:  # an adapter: only its own small weights have gradients
            root, block = 0, shape.num_trainable // max(1, shape.num_layers)
        add(Line("unsharded gradients", pb * (root + block) + 4 * block, dev, "forward/backward", exact=False,
                 note=f"the root's and one block's ({pb} B/param) + its fp32 reduce-scatter input"))
        if held_unsharded:  # set_requires_gradient_sync(False) until the last micro-batch: nothing is reduce-scattered
            add(Line("accumulated gradients", 4 * shape.num_trainable, dev, "forward/backward", exact=False,
                     note="unsharded, fp32, every block's, summed over the micro-batches until the last one's "
                          "reduce-scatter (fsdp.sync_each_batch=false)"))
        if half:
            plan.notes.append("FSDP2 mixed precision: fp32 shards, bf16 gathered parameters and activations, "
                              "gradients reduced in fp32")
        if cfg.fsdp.offload == "cpu":  # the optimizer steps the shards where they live
            plan.cpu_stepped_params = sum(math.prod(s) for s in trainable)

    @staticmethod
    def traffic_lines(plan, cfg, shape, world_size: int, half: bool) -> None:
        """Each micro-batch all-gathers every block's parameters in the compute dtype for its
        forward and again for its backward (once, with reshard_after_forward=false); the fp32
        gradients are reduce-scattered after every micro-batch's backward (once per step with
        fsdp.sync_each_batch=false). With fsdp.offload=cpu the fp32 shards are copied to the device
        before each all-gather and the gradient shards back to the host after each reduce-scatter."""
        import math

        from trainloop.parallel.memory import Transfer, ring_bytes

        n, micro, add = world_size, cfg.trainer.gradient_accumulation_steps, plan.traffic.append
        pb, N, t = (2 if half else 4), shape.num_params, shape.num_trainable
        gathers = 2 if cfg.fsdp.reshard_after_forward else 1
        reduces = micro if cfg.fsdp.sync_each_batch else 1
        each = "fp32, " + ("every micro-batch" if reduces > 1 else "once per step")
        if n > 1:
            add(Transfer("parameter all-gather", micro * gathers * ring_bytes("all-gather", pb * N, n), "dp",
                         note=f"{pb} B/param, {'forward and backward' if gathers == 2 else 'forward'} "
                              "of every micro-batch"))
            add(Transfer("gradient reduce-scatter", reduces * ring_bytes("reduce-scatter", 4 * t, n), "dp", note=each))
        if cfg.fsdp.offload == "cpu":
            add(Transfer("shards to the device", micro * gathers * 4 * math.ceil(N / n), "pcie",
                         note="fp32, before each all-gather"))
            add(Transfer("gradient shards to the host", reduces * 4 * math.ceil(t / n), "pcie", note=each))

    @staticmethod
    def problems(cfg) -> list[str]:
        """Combinations FSDP2 cannot run, each with what to choose instead."""
        from trainloop.optim.optimizers import OPTIMIZERS

        if cfg.fsdp.name == "none":
            return []
        problems = []
        name = cfg.fsdp.name
        if cfg.precision.name == "fp16":
            problems.append(f"fsdp={name} with precision=fp16: trainloop's FSDP2 computes in bf16 or fp32 (fp16 "
                            "would need a loss scaler that unscales sharded gradients); use precision=bf16")
        if cfg.model.quantization != "none":
            problems.append(f"fsdp={name} with model.quantization={cfg.model.quantization}: FSDP2 shards each "
                            "parameter on dim 0 as a DTensor, and bitsandbytes' packed 4/8-bit weights are not "
                            "tensors it can split and gather; use model.quantization=none (LoRA on the full base "
                            "works under FSDP2), or QLoRA with fsdp=none")
        opt = OPTIMIZERS.get(cfg.optimizer.name)
        if opt and not opt.fsdp2:
            library = f" ({opt.library})" if opt.library else ""
            problems.append(f"optimizer={cfg.optimizer.name}{library} cannot run under fsdp={name}: "
                            f"{opt.not_fsdp2_because}; use optimizer=adamw or sgd, or fsdp=none")
        if cfg.trainer.auto_batch_size:
            problems.append(f"trainer.auto_batch_size with fsdp={name}: the search measures trial steps of the "
                            "whole model on one process, before it is sharded, so it would not measure what a "
                            "sharded step needs; set data.batch_size yourself, or fsdp=none")
        return problems
