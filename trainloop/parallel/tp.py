"""FSDP2 x tensor parallelism (parallel.tp_size > 1, with fsdp=full_shard): the processes form a
2-D mesh (dp_shard x tp); each block's matrices are split over tp (trainloop/parallel/tensor_parallel.py),
then FSDP2 shards everything over dp_shard, as torchtitan's parallelize_llama does.

The ranks of one tp group compute one replica together: they read the same batch, hold the same
loss, and count as one data-parallel rank. So dp_size is processes / tp_size, dp_rank the position
on the dp_shard dimension, and reduce_sum sums over dp_shard only. The rest is FSDP2's: DCP
checkpoints (which reshard to any layout), the gathered full state dict (full_tensor over both
dimensions), the gradient-sync switch; only the gradient norm differs (the parameters live on two
meshes: tp-split ones on the 2-D mesh, the others on dp_shard alone).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainloop.errors import ConfigError
from trainloop.parallel.fsdp2 import FSDP2, clip_over_meshes
from trainloop.parallel.tensor_parallel import NO_PLAN


@dataclass
class TensorParallelConfig:
    """The parallel.* keys of tensor parallelism: the mesh's tensor-parallel dimension."""

    # processes that split each transformer block's matrices (tensor parallelism, on a 2-D mesh with
    # fsdp=full_shard on the other dimension); 1: none. Must divide the process count; data-parallel
    # ranks are processes / tp_size
    tp_size: int = 1
    # with tp_size > 1: the norms and the residual stream between the split matrices hold 1/tp_size of
    # the sequence on each tp rank (less activation memory; an all-gather and a reduce-scatter per split pair)
    sequence_parallel: bool = False


def layout_problem(tp_size: int, processes: int) -> str | None:
    """Why `processes` cannot form a dp_shard x tp mesh with `tp_size`, or None."""
    if processes % tp_size == 0:
        return None
    return (f"parallel.tp_size={tp_size} does not divide the {processes} process(es): "
            "launch a multiple of tp_size processes, or change parallel.tp_size")


def rank_shape(shape, tp: int):
    """What one tp rank holds of the planner's ModelShape: the planned matrices split tp ways on
    their tp_split dimension, an adapter's trainable ones on theirs; the rest whole."""
    import dataclasses
    import math

    def on_rank(shapes, dims):
        dims = dims or [None] * len(shapes)
        return [s if d is None else tuple(n // tp if i == d else n for i, n in enumerate(s)) for s, d in zip(shapes, dims)]

    local = on_rank(shape.shapes, shape.tp_split)
    removed = (sum(math.prod(s) for s in shape.shapes) - sum(math.prod(s) for s in local)) // max(1, shape.num_layers)
    trainable = None if shape.trainable is None else on_rank(shape.trainable, shape.trainable_tp_split)
    return dataclasses.replace(shape, shapes=local, trainable=trainable,
                               largest_layer_params=shape.largest_layer_params - removed)


SEQUENCE_PARALLEL = " + SP"  # a tp layout's name with parallel.sequence_parallel=true


class FSDP2xTP(FSDP2):
    """FSDP2's answers on the dp_shard dimension (subclassed: every one of them holds there), with
    the tensor-parallel split before the sharding and the data-parallel questions answered per tp group."""

    name = "fsdp2_tp"
    saves_async = True
    off = {"parallel.tp_size": 1, "parallel.sequence_parallel": "false"}
    keys = TensorParallelConfig

    @staticmethod
    def chooses(cfg) -> bool:
        return cfg.parallel.tp_size > 1

    @staticmethod
    def forwards_together(cfg) -> str | None:
        return "tensor parallelism (parallel.tp_size > 1)"

    @staticmethod
    def layouts(gpus_per_node: int) -> dict[str, dict]:
        """FSDP2 x TP for each tp > 1 dividing a node's GPUs (tp groups stay on NVLink), without and with
        sequence parallelism (the norms and the residual stream on 1/tp of the sequence)."""
        found = {}
        for n in (n for n in range(2, gpus_per_node + 1) if gpus_per_node % n == 0):
            found[f"FSDP2 x TP{n}"] = {"fsdp": "full_shard", "parallel.tp_size": n}
            found[f"FSDP2 x TP{n}{SEQUENCE_PARALLEL}"] = {**found[f"FSDP2 x TP{n}"], "parallel.sequence_parallel": "true"}
        return found

    @staticmethod
    def tensor_parallel(cfg) -> tuple[int, bool]:
        tp = cfg.parallel.tp_size
        return tp, bool(cfg.parallel.sequence_parallel and tp > 1)

    @staticmethod
    def model_parallel(cfg) -> int:
        return cfg.parallel.tp_size * cfg.parallel.cp_size

    @staticmethod
    def settings(cfg) -> dict:
        return {**FSDP2.settings(cfg), "parallel.tp_size": cfg.parallel.tp_size,
                "parallel.sequence_parallel": cfg.parallel.sequence_parallel}

    def __init__(self, cfg, accelerator):
        self.tp_size, processes = cfg.parallel.tp_size, accelerator.num_processes
        if layout_problem(self.tp_size * cfg.parallel.cp_size, processes):
            raise ConfigError(layout_problem(self.tp_size, processes) or
                              f"parallel.tp_size={self.tp_size} x parallel.cp_size={cfg.parallel.cp_size} does not "
                              f"divide the {processes} process(es): launch a multiple of their product")
        super().__init__(cfg, accelerator)

    def fsdp_mesh(self):
        """(dp_shard, tp), with the cp slices folded into dp_shard as torchtitan folds them: the tp split stays
        within a group of consecutive ranks."""
        return self.mesh.sharding(tp=True)

    def clip_grad_norm(self, model, max_norm: float):
        """The parameters live on two meshes: tp-split ones on the 2-D mesh, the others on dp_shard alone."""
        return clip_over_meshes(model, max_norm, self.device)

    def describe(self, model) -> str:
        import torch.distributed as dist

        from trainloop.parallel.sharding import describe_sharding
        from trainloop.parallel.tensor_parallel import is_tp, planned_styles, sequence_parallel_norms

        split = sum(1 for m in model.modules() if any(is_tp(p) for p in m.parameters(recurse=False)))
        if not split:
            raise RuntimeError(f"parallel.tp_size={self.tp_size} but no parameter is split over a tp mesh")
        experts = planned_styles(model.config)[1]
        whole = (f" (attention only: the routed experts {', '.join(experts)} and the router whole on each tp rank)"
                 if experts else "")
        dp, tp = self.fsdp_mesh().shape
        norms = sequence_parallel_norms(model)
        if self.cfg.parallel.sequence_parallel and not norms:
            raise RuntimeError("parallel.sequence_parallel=true but no norm computes on a sequence shard")
        if norms:
            whole += f"; sequence parallelism: {norms} norms and the residual stream on 1/{tp} of the sequence"
        folded = f" ({dp // self.cp_size} dp x {self.cp_size} cp)" if self.cp is not None else ""
        return (f"FSDP2 x TP: mesh {self.device.type} {dp} dp_shard{folded} x {tp} tp, {split} linear layers "
                f"split column-/row-wise over tp{whole}; {describe_sharding(model)} ({self.world_size} process(es), "
                f"{self.device}, backend {dist.get_backend()})")

    @staticmethod
    def memory_lines(plan, cfg, shape, world_size: int, dev: str, half: bool) -> None:
        """A tp rank holds the model with its planned matrices split tp ways (shape.tp_split: q/k/v,
        gate/up on their rows, o/down on their columns; norms, embeddings and the output head
        whole), and an adapter's trainable matrices split beside them (shape.trainable_tp_split:
        lora_B beside a column-wise weight, lora_A beside a row-wise one); FSDP2 shards that over
        the world_size / tp_size dp_shard ranks: its lines (FSDP2.memory_lines) for that smaller
        model and dp_shard size. The activations split by tp (and by sequence parallelism) are the
        planner's (activation_bytes)."""
        tp = cfg.parallel.tp_size
        dp = max(1, world_size // tp)
        first = len(plan.lines)
        FSDP2.memory_lines(plan, cfg, rank_shape(shape, tp), dp, dev, half)
        for line in plan.lines[first:]:  # FSDP2 speaks of its processes: here they are dp_shard ranks of tp ranks
            line.note = line.note.replace("one process: the shard is everything", "no dp sharding (1 dp_shard rank)")
            line.note = line.note.replace(" per process (FSDP2)", f" over dp_shard (FSDP2) of each tp rank's 1/{tp}")
        split = sum(d is not None for d in shape.tp_split or [])
        adapters = sum(d is not None for d in shape.trainable_tp_split or [])
        kept = ("the norms and the residual stream 1/tp_size of the sequence too (parallel.sequence_parallel), "
                "the projections' gathered inputs and the logits whole" if cfg.parallel.sequence_parallel else
                "the residual stream, norms and logits whole")
        plan.notes.append(f"tensor parallelism: parallel.tp_size={tp} ranks split each block's planned matrices "
                          f"({split} tensors" + (f", {adapters} adapter matrices beside them" if adapters else "")
                          + f"), FSDP2 shards over {dp} dp_shard rank(s); the attention's"
                          + (" (a mixture's experts whole)" if shape.num_experts else " and the MLP's")
                          + f" inner activations are 1/tp_size on each rank, {kept}")

    @staticmethod
    def traffic_lines(plan, cfg, shape, world_size: int, half: bool) -> None:
        """FSDP2's collectives over the dp_shard ranks, of each tp rank's share of the model; and
        within each tp group the micro-batch's hidden states (batch x seq x hidden, compute dtype),
        collected as torch's styles collect them (counted with torch's CommDebugMode on 2 gloo ranks,
        Llama and Mixtral, 3 blocks):
        - without sequence parallelism, an all-reduce of each row-wise projection's output (o, down)
          in the forward, and of each column-wise projection's input gradient in the backward, one
          per projection (ColwiseParallel wraps each one's input on its own, where Megatron-LM's f
          operator sums q/k/v's first): Llama 2 forward and 5 backward a block, Mixtral (its
          experts whole) 1 and 3;
        - with it, an all-gather + reduce-scatter pair where there was an all-reduce, the same bytes
          in a ring: per block, an all-gather before the attention and one before the MLP, a
          reduce-scatter after each row-wise projection, and the backward the same (the projections'
          input gradients, summed on the one gathered input, are one reduce-scatter), plus per
          micro-batch one more all-gather each way (the final norm's input; the first block's input
          gradient);
        and a checkpointed block's recomputed forward repeats its forward's. A LoRA adapter's
        rank-wide collectives and the norms' weight gradients are left out (small)."""
        from trainloop.parallel.memory import Transfer, ring_bytes

        tp, layers = cfg.parallel.tp_size, shape.num_layers
        FSDP2.traffic_lines(plan, cfg, rank_shape(shape, tp), max(1, world_size // tp), half)
        micro, checkpointed = cfg.trainer.gradient_accumulation_steps, cfg.model.gradient_checkpointing
        hidden = cfg.data.batch_size * cfg.data.seq_len * shape.hidden * (2 if half else 4)
        share = ring_bytes("all-gather", hidden, tp)  # a reduce-scatter's too; an all-reduce sends two
        split = [d for s, d in zip(shape.shapes, shape.tp_split or []) if len(s) == 2]  # weights, not biases
        col, row = split.count(0) // layers, split.count(1) // layers  # per block
        if cfg.parallel.sequence_parallel:  # in shares, per block: the same both ways
            what, ends = "activation all-gather + reduce-scatter", 1
            shares = {"forward": 2 + row, "backward": 2 + row}
            said = {d: f"2 all-gathers + {row} reduce-scatters per block" for d in shares}
        else:
            what, ends = "activation all-reduce", 0
            shares = {"forward": 2 * row, "backward": 2 * col}
            said = {d: f"{n // 2} per block" for d, n in shares.items()}
        passes = [(d, shares[d], said[d], ends) for d in ("forward", "backward")]
        passes += [("recomputed", shares["forward"], said["forward"], 0)] if checkpointed else []  # the forward's
        for name, n, note, extra in passes:
            plan.traffic.append(Transfer(f"{what} ({name})", micro * (layers * n + extra) * share, "tp",
                                         note=note + (f" + {extra} all-gather" if extra else "")
                                         + f", {cfg.data.batch_size} x {cfg.data.seq_len} x {shape.hidden}, "
                                         "every micro-batch"))

    @staticmethod
    def problems(cfg) -> list[str]:
        """What parallel.tp_size > 1 cannot run, known from the config alone (a pretrained model's
        heads and widths are checked when it is built: trainloop.parallel.tensor_parallel)."""
        tp = cfg.parallel.tp_size
        if tp <= 1:
            return (["parallel.sequence_parallel=true needs parallel.tp_size > 1: it shards the sequence over the "
                     "tp ranks; add parallel.tp_size=2 (+preset=tp), or drop parallel.sequence_parallel"]
                    if cfg.parallel.sequence_parallel else [])
        key, m = f"parallel.tp_size={tp}", cfg.model
        found = []
        if cfg.deepspeed.stage:
            found.append(f"{key} with deepspeed.stage={cfg.deepspeed.stage}: tensor parallelism runs on FSDP2's "
                         "2-D mesh, not under DeepSpeed; choose deepspeed=none fsdp=full_shard (+preset=tp)")
        elif cfg.fsdp.name == "none":
            found.append(f"{key} with fsdp=none: tensor parallelism runs with FSDP2 on the data-parallel dimension; "
                         "add fsdp=full_shard (+preset=tp)")
        if m.name == "tiny" and m.arch == "gpt2":
            found.append(f"{key} with model.arch=gpt2: {NO_PLAN['gpt2']}; use model.arch=llama (or mixtral), or "
                         "parallel.tp_size=1 with fsdp=full_shard")
        if cfg.trainer.loss_chunk_tokens:
            found.append(f"{key} with trainer.loss_chunk_tokens={cfg.trainer.loss_chunk_tokens}: the chunked loss "
                         "needs the output layer whole, not split over tp; set trainer.loss_chunk_tokens=0")
        if cfg.precision.name == "fp8":
            found.append(f"{key} with precision=fp8: torchao's float8 layers need their own tensor-parallel styles, "
                         "not applied here; use precision=bf16")
        if m.name == "tiny" and m.arch != "gpt2":
            widths = {"model.num_heads": m.num_heads, "model.num_kv_heads": m.num_kv_heads or m.num_heads}
            if m.arch == "llama":  # mixtral's expert MLPs stay whole on each tp rank
                widths["model.intermediate_size"] = m.intermediate_size or 4 * m.hidden_size
            found += [f"{key} does not divide {name}={n}: each tp rank takes an equal share of the heads and the "
                      f"MLP width; choose a tp_size that divides it" for name, n in widths.items() if n % tp]
        return found
