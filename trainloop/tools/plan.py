"""`python -m trainloop.plan [options] [overrides]`: will this run fit, before it is started?

The model is built on the meta device (shapes, no weights). From the parameter shapes, the
optimizer, the precision, the ZeRO stage, the offload targets and the world size it predicts
the bytes each process needs on the GPU, in CPU RAM and on NVMe:

- parameters, gradients and optimizer states: exact for a plain run (counted from the shapes:
  AdamW 8 B/param plus a 4-byte step per tensor, 8-bit AdamW 2 B plus block scales, Adafactor
  its factored row/column statistics, SGD 4 B); under DeepSpeed the ZeRO paper's formulas:
  16-bit weights and gradients (2 + 2 B) and fp32 master weights plus optimizer states
  (K = 12 B for AdamW), stage 1 partitioning the optimizer states over the world size,
  stage 2 also the gradients, stage 3 also the parameters; offload moves them to CPU or NVMe;
  under FSDP2 (fsdp=full_shard) each process's fp32 shards of the parameters, their gradients and
  optimizer state (exact: rows split over the world size), the gathered block(s) and unsharded
  gradients of the block being computed, and with fsdp.offload=cpu the shards in CPU memory
  (each strategy states its own lines: memory_lines in trainloop/parallel/);
- activations for the micro-batch and sequence length, per layer of the transformer's shape,
  with and without gradient checkpointing (coefficients of Hugging Face's Llama and GPT-2
  code, checked against saved-tensor measurements in tests/test_plan.py);
- the loss: the full logits' two gradients at the start of the backward, or, with
  trainer.loss_chunk_tokens, one chunk's logits and the output layer's gradient made in the
  forward (trainloop/objectives/chunked_loss.py); a note gives the loss's memory both ways;
- the optimizer step's temporaries, DDP's gradient buckets, DeepSpeed's buffers (estimates).

Then it compares them with this machine (trainloop.hardware, as the doctor reads it) for the
config and for every preset in conf/preset/. `--measure N` also runs N real steps here and
prints what they used. Apart from memory, each strategy counts what one process sends per
optimizer step (traffic_lines: its collectives, offload's PCIe copies). `--suggest` (the same
command, trainloop/tools/suggest.py) plans every layout for described GPUs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass

from trainloop.config.compose import CONFIG_DIR, ConfigError, compose_config
from trainloop.memory.proc import reset_peak_rss, status_bytes
from trainloop.objectives import OBJECTIVES
from trainloop.optim.optimizers import hidden_matrices
from trainloop.parallel import context_size, row
from trainloop.parallel.memory import Line, MemoryPlan, activation_bytes, context_parallel_traffic
from trainloop.parallel.tp import layout_problem

GIB = 1024**3

def presets() -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / "preset").glob("*.yaml"))


# ---------------------------------------------------------------------------------------------
# The model's shape, from the meta device


@dataclass
class ModelShape:
    family: str  # llama (SwiGLU, RoPE, RMSNorm) or gpt2 (GELU MLP, LayerNorm, learned positions)
    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    shapes: list[tuple[int, ...]]  # every parameter, tied ones once
    layer_linear_params: int  # weights and biases of one layer's matmuls (autocast copies them)
    largest_layer_params: int
    trainable: list[tuple[int, ...]] | None = None  # with an adapter: the adapters' shapes (None: all train)
    quantized_params: int = 0  # elements of the linear weights model.quantization stores in 4 or 8 bits
    num_experts: int = 0  # a mixture of experts: expert MLPs per block (0: a dense MLP)
    experts_per_token: int = 0  # experts the router sends each token to
    expert_params: int = 0  # in all blocks' experts (the routers not counted)
    hidden_matrix: list[bool] | None = None  # for each trainable shape: a hidden layer's matrix? (optim.hidden_matrices)
    # for each shape: the dimension tensor parallelism splits (0 column-wise, 1 row-wise), as the split
    # itself answers it (trainloop.parallel.tensor_parallel.split_dimension), or None (whole on every tp rank)
    tp_split: list[int | None] | None = None
    # the same for each trainable shape (an adapter's: lora_B beside a column-wise weight, lora_A beside a row-wise one)
    trainable_tp_split: list[int | None] | None = None
    # why parallel.sequence_parallel cannot split these blocks (trainloop.parallel.tensor_parallel), or None
    sequence_parallel_problem: str | None = None
    # for each shape, where it lies along the blocks (what a pipeline stage holds): its block's index,
    # -1 before the first block (the embeddings), num_layers after the last (the final norm, the output layer)
    position: list[int] | None = None
    trainable_position: list[int] | None = None  # the same for each trainable shape

    @property
    def trainable_shapes(self) -> list[tuple[int, ...]]:
        return self.shapes if self.trainable is None else self.trainable

    @property
    def num_trainable(self) -> int:
        return sum(math.prod(s) for s in self.trainable_shapes)

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @property
    def active_params(self) -> int:
        """Parameters a token passes through: of the experts only the experts_per_token it is routed to."""
        if not self.num_experts:
            return self.num_params
        return self.num_params - self.expert_params * (self.num_experts - self.experts_per_token) // self.num_experts


def model_shape(cfg) -> ModelShape:
    """Build the configured model on the meta device and read its shape: no memory, no weights."""
    import torch

    from trainloop.data.loaders import build_tokenizer
    from trainloop.model.builder import build_model_config
    from trainloop.model.heads import as_scorer, auto_class
    from trainloop.parallel.tensor_parallel import sequence_parallel_problem

    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.model.name_or_path)
    config = build_model_config(cfg.model, len(tokenizer))
    head = OBJECTIVES[cfg.objective.name].head
    if head == "score":
        as_scorer(config)
    with torch.device("meta"):
        model = auto_class(head).from_config(config, attn_implementation="eager")
    if model.get_input_embeddings().num_embeddings < config.vocab_size:
        model.resize_token_embeddings(config.vocab_size)
    n_layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    layers = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n_layers)
    layer_sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    matmul = sum(p.numel() for m in layers[0].modules() if _is_matmul(m) for p in m.parameters(recurse=False))
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    inter = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    family = "gpt2" if config.model_type in ("gpt2", "gpt_neox", "gptj", "opt", "bloom", "gpt_bigcode") else "llama"
    shapes = [tuple(p.shape) for p in model.parameters()]
    tp_split = [_tp_split(model, name) for name, _ in model.named_parameters()]
    experts = [m for m in model.modules() if _is_experts(m)]  # e.g. Mixtral's, a 3-D weight per projection
    sp_problem = sequence_parallel_problem(model.base_model)
    position = _positions([name for name, _ in model.named_parameters()], n_layers)
    trainable, trainable_tp_split, quantized = _adapter_shapes(cfg, model)  # wraps the model: after its own shapes
    trainable_position = None if trainable is None else \
        _positions([name for name, p in model.named_parameters() if p.requires_grad], n_layers)
    return ModelShape(
        num_experts=getattr(config, "num_local_experts", 0) if experts else 0,
        experts_per_token=getattr(config, "num_experts_per_tok", 0) if experts else 0,
        expert_params=sum(p.numel() for m in experts for p in m.parameters()),
        trainable=trainable, quantized_params=quantized, family=family, num_layers=n_layers, hidden=hidden, intermediate=inter, heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads, vocab=config.vocab_size,
        shapes=shapes, layer_linear_params=matmul, hidden_matrix=hidden_matrices(model),  # after the adapter
        largest_layer_params=max(layer_sizes), tp_split=tp_split, trainable_tp_split=trainable_tp_split,
        sequence_parallel_problem=sp_problem, position=position, trainable_position=trainable_position,
    )


def _positions(names: list[str], num_layers: int) -> list[int]:
    """For each parameter name in the model's order: its block's index (`...layers.3.` or GPT-2's
    `...h.3.`), -1 before the first block's parameters, num_layers after the last's."""
    import re

    found = [re.search(r"\.(?:layers|h)\.(\d+)\.", name) for name in names]
    blocks = [i for i, m in enumerate(found) if m]
    first, last = (blocks[0], blocks[-1]) if blocks else (len(names), -1)
    return [int(m.group(1)) if m else -1 if i < first else num_layers for i, m in enumerate(found)]


def _tp_split(model, name: str) -> int | None:
    """The dimension of parameter `name` that tensor parallelism splits, or None: the split's own
    answer (trainloop.parallel.tensor_parallel.split_dimension), so a mixture's routed experts stay whole here too."""
    from trainloop.parallel.tensor_parallel import split_dimension

    module, _, kind = name.rpartition(".")
    prefix = model.base_model_prefix + "."
    return split_dimension(model.config, module[len(prefix):], kind) if module.startswith(prefix) else None


def _lora_tp_split(config, name: str) -> int | None:
    """The dimension of adapter parameter `name` (named inside the base model: "layers.0.self_attn.q_proj.
    lora_B.default.weight") that tensor parallelism splits, as trainloop.parallel.tensor_parallel splits it:
    lora_B's rows beside a column-wise weight, lora_A's columns beside a row-wise one; anything else
    (the other matrix, modules_to_save) whole."""
    from trainloop.parallel.tensor_parallel import split_dimension

    module, lora, part = name.partition(".lora_")
    if not lora or not part.endswith("weight"):
        return None
    dim = split_dimension(config, module, "weight")
    return dim if (dim, part[0]) in ((0, "B"), (1, "A")) else None


def _adapter_shapes(cfg, model) -> tuple[list[tuple[int, ...]] | None, list[int | None] | None, int]:
    """With adapter=lora: the shapes of what trains (peft wraps the meta model too), the dimension
    tensor parallelism splits of each, and how many base weights bitsandbytes quantizes (every
    linear layer's but the output head's)."""
    import torch

    if cfg.adapter.name == "none":
        return None, None, 0
    from trainloop.model.adapter import wrap_lora

    head = model.get_output_embeddings()
    quantized = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    with torch.device("meta"):
        peft_model = wrap_lora(model, cfg.adapter, OBJECTIVES[cfg.objective.name].head)
    inside = {id(p): name for name, p in peft_model.get_base_model().base_model.named_parameters()}  # the split's names
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    split = [_lora_tp_split(model.config, inside.get(id(p), "")) for p in trainable]
    return [tuple(p.shape) for p in trainable], split, quantized if cfg.model.quantization != "none" else 0


def _is_matmul(module) -> bool:
    import torch

    return (isinstance(module, torch.nn.Linear) or type(module).__name__ in ("Conv1D", "MixtralTopKRouter")
            or _is_experts(module))


def _is_experts(module) -> bool:
    """transformers' stacked experts of a mixture-of-experts block (MixtralExperts and its kin)."""
    return type(module).__name__.endswith("Experts") and any(p.dim() == 3 for p in module.parameters(recurse=False))


# ---------------------------------------------------------------------------------------------
# Model states: parameters, gradients, optimizer states (their sizes: trainloop/optim/optimizers.py's table)


def loss_lines(plan: MemoryPlan, cfg, shape: ModelShape, dev: str, autocast: bool, batch: int) -> None:
    """What the loss holds beyond the saved activations, at the start of the backward, when the
    activations are all still held (estimates, fp32 cross-entropy):
    - the full logits (trainer.loss_chunk_tokens=0): the gradient of the log-softmax output and
      the logits' own gradient, 4 B x vocabulary per token each;
    - chunked (trainloop/objectives/chunked_loss.py): the output layer's fp32 gradient, made in the forward and
      held until the backward (when the output layer trains), the hidden states' gradient, and
      one chunk's fp32 logits twice (the logits and the log-sum-exp's temporary), with the 16-bit
      copy of the output weight under autocast.
    The note gives the logits term both ways."""
    V, h, chunk = shape.vocab, shape.hidden, cfg.trainer.loss_chunk_tokens
    tokens = batch * cfg.data.seq_len // context_size(cfg)  # a forward's sequences (a preference pair is two)
    head_trains = shape.trainable is None  # an adapter freezes the output layer

    def chunked(c: int) -> int:
        return ((4 * V * h if head_trains else 0) + 4 * h * tokens + 8 * min(c, tokens) * V
                + (2 * V * h if autocast else 0))

    if chunk:
        plan.lines.append(Line("chunked loss", chunked(chunk), dev, "forward/backward", exact=False,
                               note=f"{min(chunk, tokens)} tokens x {V:,} fp32 logits at a time"
                               + (", the output layer's gradient" if head_trains else "")))
    else:
        plan.lines.append(Line("logits' gradients", 8 * V * tokens, dev, "forward/backward", exact=False,
                               note=f"{tokens} tokens x {V:,} fp32, twice, at the start of the backward"))
    example = chunk or 1024
    plan.notes.append(f"the loss: {_gib(12 * V * tokens)} through the full logits (the log-softmax kept, its "
                      f"gradients); {_gib(chunked(example))} with trainer.loss_chunk_tokens={example}")


def plan_memory(cfg, shape: ModelShape, world_size: int, device: str, procs_per_node: int | None = None,
                label: str = "config") -> MemoryPlan:
    """Per-process bytes on GPU, CPU and NVMe for this config, world size and device: the strategy's
    model states (trainloop.parallel's memory_lines), then the activations."""
    n, t = shape.num_params, shape.num_trainable  # all, and those with gradients and optimizer state
    dev = "gpu" if device == "cuda" else "cpu"
    plan = MemoryPlan(label, world_size, procs_per_node or world_size, device, n)
    half = cfg.precision.name in ("bf16", "fp16", "fp8")
    add = plan.lines.append
    if shape.trainable is not None:
        plan.notes.append(f"adapter={cfg.adapter.name}: {t / 1e6:,.2f}M parameters train, "
                          f"{(n - t) / 1e6:,.1f}M are frozen (no gradients, no optimizer state)")
    strategy = row(cfg)
    strategy.memory_lines(plan, cfg, shape, world_size, dev, half)  # parameters, gradients, optimizer states, buffers
    strategy.traffic_lines(plan, cfg, shape, world_size, half)  # what each process sends per step: not memory
    objective = OBJECTIVES[cfg.objective.name]
    objective.memory_lines(plan, cfg)  # what the objective holds itself: DPO's reference copy
    batch = cfg.data.batch_size * objective.sequences  # a forward's sequences: a preference pair is two

    autocast = half and strategy.autocast  # the others compute on 16-bit copies of the parameters
    fp8 = cfg.precision.name == "fp8"
    tp, sp = strategy.tensor_parallel(cfg)
    blocks, outputs = strategy.activations_held(cfg, shape)
    cp = context_size(cfg)
    if cp > 1:
        plan.traffic.append(context_parallel_traffic(shape, batch, cfg.data.seq_len, half, cp,
                                                     cfg.model.gradient_checkpointing,
                                                     cfg.trainer.gradient_accumulation_steps))

    def activations(checkpointing: bool) -> tuple[int, int]:  # this run's, with or without checkpointing
        return activation_bytes(shape, batch, cfg.data.seq_len, half, autocast=autocast, checkpointing=checkpointing,
                                attention=cfg.model.attn_implementation, chunked=cfg.trainer.loss_chunk_tokens > 0,
                                packed=cfg.data.packing == "documents", fp8=fp8, tp=tp, sequence_parallel=sp,
                                blocks=blocks, outputs=outputs, cp=cp)

    saved, recompute = activations(cfg.model.gradient_checkpointing)
    if fp8:
        plan.notes.append("precision=fp8: the blocks' linear weights are cast to float8 (1 B/param) for the matmuls "
                          "and kept for the backward; torchao's float8 inputs are counted at 16 bits (an overestimate)")
    offloaded = cfg.trainer.activation_offload and dev == "gpu"  # on the CPU they are in host memory already
    add(Line("activations", saved, "cpu" if offloaded else dev, "forward/backward", exact=False,
             note=f"micro-batch {batch} x {cfg.data.seq_len} tokens"
                  + (", gradient checkpointing" if cfg.model.gradient_checkpointing else "")
                  + (f", attention{'' if shape.num_experts else ' and MLP'} inner tensors 1/{tp} (tensor parallel)"
                     if tp > 1 else "")
                  + (f", norms and residual stream 1/{tp} (sequence parallel)" if sp else "")
                  + (f", 1/{cp} of every sequence (context parallel)" if cp > 1 else "")
                  + (", offloaded to pinned host memory (trainer.activation_offload)" if offloaded else "")))
    if offloaded:
        add(Line("activations in flight", saved // max(1, shape.num_layers), dev, "forward/backward", exact=False,
                 note="about a block's worth on the device while it is copied out or back"))
    if outputs:  # a pipeline stage without the output layer takes no loss
        loss_lines(plan, cfg, shape, dev, autocast, batch)
    if recompute:
        add(Line("recomputed layer", recompute, dev, "forward/backward", exact=False,
                 note="one layer's activations, rebuilt during the backward pass"))
    if not cfg.model.gradient_checkpointing:
        without = saved
        with_gc = sum(activations(True))
        plan.notes.append(f"activations {_gib(without)}; with model.gradient_checkpointing=true {_gib(with_gc)}")
    else:
        without = activations(False)[0]
        plan.notes.append(f"activations {_gib(saved + recompute)} with gradient checkpointing; "
                          f"{_gib(without)} without")
    return plan


# ---------------------------------------------------------------------------------------------
# Against this machine


@dataclass
class Machine:
    device: str  # cuda or cpu
    gpu_memory: int | None  # the smallest GPU's, bytes
    gpu_name: str | None
    ram_available: int
    ram_total: int
    nvme_free: int | None
    source: str


GPU_USABLE = 0.92  # the CUDA context, NCCL and allocator fragmentation take the rest
RUNTIME_RAM = 1 * GIB  # python, torch and the data of one process: what the lines above leave out


def read_machine(cfg, device: str = "auto", gpu_memory_gib: float | None = None,
                 cpu_memory_gib: float | None = None) -> Machine:
    from trainloop.observe import hardware

    report = hardware.read_gpus(with_topology=False) if gpu_memory_gib is None and device != "cpu" else None
    gpus = report.gpus if report else []
    host = hardware.host_facts()
    nvme_path = row(cfg).settings(cfg).get("deepspeed.nvme_path")
    nvme = hardware.disk_facts(nvme_path)["free"] if nvme_path else None
    if device == "auto":
        device = "cuda" if gpus or gpu_memory_gib else "cpu"
    if gpu_memory_gib is not None:
        memory, name, source = int(gpu_memory_gib * GIB), f"GPUs of {gpu_memory_gib:g} GiB", "--gpu-memory"
    elif gpus and all(g.memory_total for g in gpus):
        small = min(gpus, key=lambda g: g.memory_total)
        memory, name, source = small.memory_total, small.name, report.source
    else:
        memory, name, source = None, None, "no GPU found" if not gpus else report.source
    ram_available, ram_total = host["ram_available"], host["ram_total"]
    if cpu_memory_gib is not None:
        ram_available = ram_total = int(cpu_memory_gib * GIB)
        source += ", --cpu-memory"
    return Machine(device, memory, name, ram_available, ram_total, nvme, source)


def verdict(plan: MemoryPlan, machine: Machine) -> tuple[bool | None, list[str]]:
    """(fits, one line per resource with the numbers). None: cannot tell (no GPU size known)."""
    fits, lines, node = True, [], plan.procs_per_node
    if plan.device == "cuda":
        need = plan.peak("gpu")
        if machine.gpu_memory is None:
            fits = None
            lines.append(f"GPU: {_gib(need)} per process; GPU memory unknown (give --gpu-memory GiB)")
        else:
            usable = GPU_USABLE * machine.gpu_memory
            ok = need <= usable
            fits &= ok
            lines.append(f"GPU: {_gib(need)} per process of {_gib(usable)} usable on {machine.gpu_name} "
                         f"({'fits' if ok else 'does NOT fit'})")
    ram = node * (plan.peak("cpu") + RUNTIME_RAM)
    ok = ram <= machine.ram_available
    fits = fits and ok if fits is not None else None if ok else False
    lines.append(f"CPU RAM: {_gib(ram)} for {node} process(es) ({_gib(plan.peak('cpu'))} each + "
                 f"{_gib(RUNTIME_RAM)} runtime) of {_gib(machine.ram_available)} available "
                 f"({'fits' if ok else 'does NOT fit'})")
    if plan.peak("nvme"):
        disk = node * plan.peak("nvme")
        ok = machine.nvme_free is not None and disk <= machine.nvme_free
        fits = fits and ok if fits is not None else None if ok else False
        lines.append(f"NVMe: {_gib(disk)} for {node} process(es) of "
                     f"{_gib(machine.nvme_free) if machine.nvme_free is not None else '?'} free at "
                     f"deepspeed.nvme_path ({'fits' if ok else 'does NOT fit'})")
    return fits, lines


# ---------------------------------------------------------------------------------------------
# Measuring a real run here, to check the prediction


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def track_live_memory(on: bool) -> bool:
    """On: glibc gives every allocation of 64 KiB or more its own mapping, unmapped when freed, so
    the resident set follows the live tensors. Off: a 32 MiB threshold, glibc's steady state.
    With glibc's default heap a freed tensor stays resident and a later, differently sized one
    may not fit in its place: under FSDP2 (gather and free a block at a time) the resident set of
    a 17M-parameter model grew 380 -> 560 MB over 4 steps with the live tensors flat (seen here).
    False where there is no glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 64 * 2**10 if on else 32 * 2**20)
        if on:
            libc.malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


class SavedActivations:
    """Counts what autograd keeps for the backward of the forward run inside it: the storages of
    the tensors it saves, summed when the forward is over (FSDP2 has resized its gathered blocks to
    nothing by then), a DTensor by its local shard; parameters are not activations and are left
    out: `model`'s own storages (a matmul saves its weight as a transposed view of one) and any
    leaf that requires a gradient (FSDP2's gathered copies). What the plan's "activations" line
    predicts, without the allocator or the runtime in the way. Inside activation offload's own
    hooks it would see nothing: not used there."""

    def __init__(self, model):
        from trainloop.parallel import local_shard

        self.params = {local_shard(p).untyped_storage()._cdata for p in model.parameters()}
        self.storages: dict[int, object] = {}
        self.bytes: int | None = None

    def pack(self, tensor):
        from trainloop.parallel import local_shard

        if not (tensor.is_leaf and tensor.requires_grad):
            # keyed by the storage itself, not its address: FSDP2 frees a gathered block's memory during
            # the forward and a later activation may get the same address (nor has a wrapper's storage one)
            storage = local_shard(tensor).untyped_storage()
            if storage._cdata not in self.params:
                self.storages.setdefault(storage._cdata, storage)
        return tensor

    def __enter__(self):
        import torch

        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)
        self.bytes = sum(storage.nbytes() for storage in self.storages.values())
        self.storages.clear()  # held no longer than autograd holds them


def measure_training(cfg, steps: int, timed_steps: int = 0) -> dict:
    """Train `steps` optimizer steps with the run's own builders; the memory the training took.

    On CPU: peak RSS during those steps minus RSS just before the model is built (Linux: the
    peak is reset through /proc/self/clear_refs) and less the library pages the steps mapped in
    (memory_used), with glibc told to unmap freed tensors
    (track_live_memory) so that the resident set follows the live tensors. On a GPU: torch's peak
    allocated bytes. Then `timed_steps` more steps with glibc's usual heap, each timed
    (`step_seconds`); `peak_rss` is the whole process's peak resident set at the end.
    Under a launcher every process measures itself; everything is built by the run's own build
    (trainloop.build: adapter, compile, the strategy's sharding, the optimizer) and each step is the
    objective's. `shard_bytes`: the storage this process holds for parameters, gradients and
    optimizer state, counted on the live tensors. `saved_activation_bytes`: what autograd kept after
    the first forward (SavedActivations; None under activation offload and a pipeline).
    """
    import gc
    import time

    import torch

    from trainloop.build import build
    from trainloop.memory.offload import ActivationOffload
    from trainloop.parallel import build_strategy, local_shard
    from trainloop.parallel.accelerator import build_accelerator
    from trainloop.run import end_distributed
    from trainloop.step import every_update, train_step

    accelerator = build_accelerator(cfg)
    strategy = build_strategy(cfg, accelerator)
    on_cuda = accelerator.device.type == "cuda"
    marks = {}

    def start_measuring() -> None:  # after the data is built, before the model is
        gc.collect()
        marks["live"] = track_live_memory(True)
        if not reset_peak_rss():  # the peak RSS now starts from here
            raise RuntimeError("plan --measure needs /proc/self/clear_refs (Linux) to reset the peak resident set")
        marks["before"], marks["files_before"] = status_bytes("VmRSS"), status_bytes("RssFile")
        if on_cuda:
            torch.cuda.reset_peak_memory_stats()
            marks["gpu_before"] = torch.cuda.memory_allocated()

    built = build(cfg, strategy, before_model=start_measuring)  # the run's own build, in the run's order
    model, optimizer, objective = built.model, built.optimizer, built.objective
    before, gpu_before, live = marks["before"], marks.get("gpu_before"), marks["live"]

    def memory_used() -> dict:
        """The peak resident set since the mark, less the pages of library code and data the steps
        mapped in (RssFile's growth): those are the libraries', not the training's, and how many a
        first call maps depends on the page cache (the kernel maps the neighbours of a faulted page
        that are cached): 29 MiB apart between two venvs of the same packages, seen here. On a GPU,
        torch's peak allocated bytes beside it."""
        used = {"training_bytes": status_bytes("VmHWM") - before - (status_bytes("RssFile") - marks["files_before"])}
        if on_cuda:
            used["gpu_training_bytes"] = torch.cuda.max_memory_allocated() - gpu_before
        return used
    batch = {key: value.to(accelerator.device) for key, value in next(iter(built.train_loader)).items()}
    model.train()
    offload = ActivationOffload(cfg.trainer.activation_offload, accelerator.device)
    accumulation = built.accumulation
    shards, seconds, result = {}, [], {}
    # what autograd keeps in one forward; a pipeline's step interleaves its micro-batches' forwards and
    # backwards, and holding every saved tensor to the end of it would raise the very peak measured
    saved = None if offload.on or strategy.interleaved else SavedActivations(model)
    forwards = iter([saved] if saved else [])  # what autograd keeps in the first forward, then the run's context

    def forward_context():
        return next(forwards, None) or offload()

    def count_gradients(state, step_loss, grad_norm):  # after clipping, before the update: the step's gradients
        if step == steps - 1:
            shards["gradients"] = _storage_bytes(local_shard(p.grad) for p in model.parameters() if p.grad is not None)
        return every_update(state, step_loss, grad_norm)

    for step in range(steps + timed_steps):
        if step == steps:  # the memory steps are over: their peak, then glibc's usual heap for the timing
            result = memory_used()
            track_live_memory(False)
        start = time.perf_counter()
        # the run's step (trainloop.step) on the first batch, as many micro-batches as the run's
        stepped = train_step(strategy, objective, model, optimizer, [batch] * accumulation,
                             max_grad_norm=cfg.trainer.max_grad_norm, forward_context=forward_context,
                             check=count_gradients)
        stepped.loss.item()  # waits for the device
        seconds.append(time.perf_counter() - start)
    if not timed_steps:
        result = memory_used()
    shards["parameters"] = _storage_bytes(local_shard(p) for p in model.parameters())
    shards["optimizer states"] = _storage_bytes(local_shard(v) for state in optimizer.state.values()
                                                for v in state.values() if isinstance(v, torch.Tensor))
    result = {"steps": steps, "rank": accelerator.process_index, "rss_before": before, "peak_rss": status_bytes("VmHWM"),
              "cpu_training_bytes": result.pop("training_bytes"), **result, "glibc_live_tracking": live,
              "shard_bytes": shards, "saved_activation_bytes": saved and saved.bytes, "step_seconds": seconds[steps:],
              "tokens_per_step": accumulation * built.batch_size * cfg.data.seq_len * strategy.dp_size}
    if strategy.world_size > 1:  # every process's measurement, on every process
        gathered = [None] * strategy.world_size
        torch.distributed.all_gather_object(gathered, result)
        result = {"per_process": gathered}
    end_distributed(strategy)
    return result


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind these tensors (views of one buffer counted once)."""
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


# ---------------------------------------------------------------------------------------------
# The command


def _gib(n: float | None) -> str:
    if n is None:
        return "?"
    return f"{n / GIB:.2f} GiB" if n >= 0.01 * GIB else f"{n / 1024**2:.2f} MiB"


def without_preset(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.lstrip("+~").startswith("preset=")]


def build_report(overrides: list[str], world_size: int, procs_per_node: int | None, device: str,
                 gpu_memory_gib: float | None, cpu_memory_gib: float | None = None,
                 compare_presets: bool = True) -> dict:
    cfg = compose_config(overrides)
    machine = read_machine(cfg, device, gpu_memory_gib, cpu_memory_gib)
    cache: dict[str, ModelShape] = {}

    def shape_of(c) -> ModelShape:
        from omegaconf import OmegaConf

        key = OmegaConf.to_yaml(c.model) + str(c.data.tokenizer)
        if key not in cache:
            cache[key] = model_shape(c)
        return cache[key]

    def one(c, label: str) -> dict:
        tp = row(c).tensor_parallel(c)[0]
        if layout_problem(tp, world_size):  # a mesh these processes cannot form
            raise ConfigError(layout_problem(tp, world_size))
        plan = plan_memory(c, shape_of(c), world_size, machine.device, procs_per_node, label)
        fits, lines = verdict(plan, machine)
        if c.trainer.auto_batch_size and fits is False:
            lines = [*lines, f"trainer.auto_batch_size=true: the run tries micro-batch {c.data.batch_size} (this plan) "
                             "first and halves it until a step fits, keeping the effective batch"]
        return {"plan": plan, "fits": fits, "verdict": lines, "shape": shape_of(c)}

    report = {"machine": machine, "world_size": world_size, "config": one(cfg, "the config"), "presets": {}}
    if compare_presets:
        base = without_preset(overrides)
        for name in presets():
            try:
                c = compose_config(base + [f"+preset={name}"])
                report["presets"][name] = one(c, f"+preset={name}")
            except ConfigError as err:
                report["presets"][name] = {"error": str(err).replace("\n", " ")}
    return report


def render(report: dict) -> str:
    m, c = report["machine"], report["config"]
    plan: MemoryPlan = c["plan"]
    where_dev = "GPU" if plan.device == "cuda" else "device (CPU)"
    shape: ModelShape = c["shape"]
    experts = (f" ({shape.num_experts} experts per block, {shape.experts_per_token} per token: "
               f"{shape.active_params / 1e6:,.1f}M active)" if shape.num_experts else "")
    out = [f"trainloop plan: {plan.num_params / 1e6:,.1f}M parameters{experts}, {plan.world_size} process(es) "
           f"({plan.procs_per_node} per node), training on {plan.device}", ""]
    out.append(f"  {'per process':<28}{'bytes':>14}  {'where':<6} {'when':<18} note")
    for x in (x for x in plan.lines if x.bytes):
        where = {"gpu": "GPU", "cpu": "CPU", "nvme": "NVMe"}[x.where]
        out.append(f"  {x.what + ('' if x.exact else ' ~'):<28}{_gib(x.bytes):>14}  {where:<6} "
                   f"{x.phase or 'all along':<18} {x.note}")
    out.append("")
    for w, name in (("gpu", where_dev if plan.device == "cuda" else None), ("cpu", "CPU RAM"), ("nvme", "NVMe")):
        if name and (plan.peak(w) or w == "cpu"):
            out.append(f"  peak {name}: {_gib(plan.peak(w))} per process")
    out += [f"  {note}" for note in plan.notes]
    out.append("  (~: an estimate; the rest is exact for a plain run and FSDP2's shards, the ZeRO paper's formula "
               "under DeepSpeed)")
    out += render_traffic(plan)
    out += ["", f"this machine ({m.source}): " + (f"{m.gpu_name} ({_gib(m.gpu_memory)}); " if m.gpu_memory else "")
            + f"RAM {_gib(m.ram_available)} available of {_gib(m.ram_total)}"
            + (f"; NVMe {_gib(m.nvme_free)} free" if m.nvme_free is not None else "")]
    out.append(f"  the config: {_fits(c['fits'])}")
    out += [f"    {line}" for line in c["verdict"]]
    if report["presets"]:
        out += ["", "presets (your overrides + +preset=NAME):"]
        for name, p in report["presets"].items():
            if "error" in p:
                out.append(f"  {name}: does not apply: {p['error']}")
                continue
            out.append(f"  {name}: {_fits(p['fits'])} ({p['plan'].num_params / 1e6:,.1f}M parameters)")
            out += [f"    {line}" for line in p["verdict"]]
    return "\n".join(out)


LINKS = {"dp": "among the data-parallel ranks", "tp": "within each tensor-parallel group",
         "cp": "within each context-parallel group", "pp": "between pipeline stages",
         "pcie": "between host and device (PCIe)"}


def render_traffic(plan: MemoryPlan) -> list[str]:
    """The communication section: bytes one process sends per optimizer step (not memory)."""
    if not plan.traffic:
        return ["", "communication per optimizer step: none (one process, nothing offloaded)"]
    out = ["", "communication per optimizer step, bytes each process sends (ring collectives; not memory):",
           f"  {'what':<52}{'bytes':>12}  {'over':<5} note"]
    out += [f"  {x.what:<52}{_gib(x.bytes):>12}  {x.link:<5} {x.note}" for x in plan.traffic if x.bytes]
    out += [f"  total {LINKS[link]}: {_gib(plan.sent(link))}" for link in LINKS if plan.sent(link)]
    if plan.cpu_stepped_params:
        out.append(f"  the optimizer steps {plan.cpu_stepped_params / 1e6:,.1f}M parameters per process on the CPU")
    return out


def _fits(flag: bool | None) -> str:
    return {True: "fits", False: "does NOT fit", None: "cannot tell"}[flag]


def to_json(report: dict) -> dict:
    def part(p: dict) -> dict:
        return p if "error" in p else {"plan": p["plan"].to_dict(), "fits": p["fits"], "verdict": p["verdict"]}

    return {"machine": asdict(report["machine"]), "world_size": report["world_size"],
            "config": part(report["config"]), "presets": {k: part(v) for k, v in report["presets"].items()},
            **({"measured": report["measured"]} if "measured" in report else {})}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainloop.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=None,
                        help="processes in the run (default: $WORLD_SIZE, else 1)")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="processes sharing this machine's RAM and disk (default: the world size)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="plan for GPUs or for CPU training (auto: what this machine has)")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                        help="plan for GPUs of this size instead of this machine's")
    parser.add_argument("--cpu-memory", type=float, default=None, metavar="GIB",
                        help="plan for nodes with this much RAM instead of this machine's available RAM")
    parser.add_argument("--no-presets", action="store_true", help="do not compare the presets")
    parser.add_argument("--measure", type=int, default=0, metavar="STEPS",
                        help="also train STEPS steps here (in each process of a launcher: torchrun "
                             "--nproc_per_node N -m trainloop.plan ...) and print the memory they used")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("overrides", nargs="*", help="the run's config overrides")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    return run(parser, parser.parse_args(argv))


def run(parser: argparse.ArgumentParser, args) -> int:
    """The plan of the config (and the presets), and with --measure the measurement beside it."""
    world_size = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    if world_size < 1:
        parser.error("--world-size must be 1 or more")
    if args.measure and world_size != int(os.environ.get("WORLD_SIZE", "1")):
        parser.error("--measure trains here, in the processes launched: for N processes run "
                     "`torchrun --nproc_per_node N -m trainloop.plan --measure STEPS ...` (no --world-size)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        report = build_report(args.overrides, world_size, args.nproc_per_node, args.device, args.gpu_memory,
                              args.cpu_memory, compare_presets=not args.no_presets)
        if args.measure:
            measured = measure_training(compose_config(args.overrides), args.measure)
            report["measured"] = measured = compare(report["config"]["plan"], measured)
    except ConfigError as err:
        print(f"trainloop.plan: error: {err}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) != 0:  # under a launcher: one report, from rank 0
        return 0
    if args.json:
        print(json.dumps(to_json(report), indent=2, default=str))
    else:
        print(render(report))
        if args.measure:
            for m in report["measured"].get("per_process", [report["measured"]]):
                got = m.get("gpu_training_bytes", m["cpu_training_bytes"])
                print(f"\n{'measured here' if world_size == 1 else 'process %d measured' % m['rank']} over "
                      f"{m['steps']} steps: {_gib(got)} (predicted {_gib(m['predicted_bytes'])}, "
                      f"ratio {m['ratio']:.3f})")
    return 0


def compare(plan: MemoryPlan, measured: dict) -> dict:
    """The prediction beside each process's measurement, and their ratio."""
    for m in measured.get("per_process", [measured]):
        predicted = plan.peak("gpu" if "gpu_training_bytes" in m else "cpu")
        got = m.get("gpu_training_bytes", m["cpu_training_bytes"])
        m["predicted_bytes"], m["ratio"] = predicted, predicted / got
    return measured


if __name__ == "__main__":
    sys.exit(main())
