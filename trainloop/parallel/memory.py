"""The planner's line items: bytes a process holds, where and when. Each strategy states its own
model-state lines (trainloop.parallel: parameters, gradients, optimizer states and its buffers)
and the bytes each process sends per optimizer step (Transfer: collectives and host copies, not
memory); trainloop.tools.plan adds the activations (activation_bytes, here: a pipeline's stages
weigh theirs when the planner picks the process it plans) and compares the sum with the machine."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# bitsandbytes' storage per quantized weight: NF4 with double-quantized block scales (64-blocks,
# fp8 absmax, fp32 per 256 blocks), LLM.int8 with one fp32 scale per row (counted as per weight here)
QUANTIZED_BYTES = {"4bit": 0.5 + 1 / 64 + 4 / (64 * 256), "8bit": 1.0}


@dataclass
class Line:
    what: str
    bytes: int
    where: str  # gpu, cpu or nvme
    phase: str | None = None  # None: held all along; else counted only in that phase of a step
    exact: bool = True
    note: str = ""


@dataclass
class Transfer:
    what: str
    bytes: int  # sent by one process per optimizer step (a ring collective's share: ring_bytes)
    # dp: among the data-parallel ranks; tp: within a tensor-parallel group; cp: within a context-parallel
    # group; ep: within an expert-parallel group; pp: between pipeline stages; pcie: host <-> device
    link: str
    note: str = ""


def ring_bytes(collective: str, nbytes: int, ranks: int) -> int:
    """Bytes one rank sends in a ring collective over `ranks` of a tensor of `nbytes` (whole, not
    a shard): all-gather and reduce-scatter (ranks - 1) / ranks of it, all-reduce twice that
    (a reduce-scatter, then an all-gather), as NCCL's ring algorithm does."""
    share = (ranks - 1) * nbytes // ranks
    return {"all-gather": share, "reduce-scatter": share, "all-reduce": 2 * share}[collective]


@dataclass
class MemoryPlan:
    label: str
    world_size: int
    procs_per_node: int
    device: str  # cuda or cpu: where "the device" is for this run
    num_params: int
    lines: list[Line] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    traffic: list[Transfer] = field(default_factory=list)  # per optimizer step; not memory: peak() ignores it
    cpu_stepped_params: int = 0  # parameters this process's optimizer updates on the CPU (an offloaded optimizer)

    def held(self, where: str) -> int:
        return sum(x.bytes for x in self.lines if x.where == where and x.phase is None)

    def phase(self, where: str, phase: str) -> int:
        return sum(x.bytes for x in self.lines if x.where == where and x.phase == phase)

    def peak(self, where: str) -> int:
        """Per process: what is held all along plus the larger of the two phases of a step."""
        return self.held(where) + max(self.phase(where, "forward/backward"), self.phase(where, "optimizer step"))

    def get(self, what: str) -> int:
        return sum(x.bytes for x in self.lines if x.what == what)

    def sent(self, link: str) -> int:
        """Bytes this process sends over `link` per optimizer step."""
        return sum(x.bytes for x in self.traffic if x.link == link)

    def to_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "lines"},
                "lines": [asdict(x) for x in self.lines],
                "peak": {w: self.peak(w) for w in ("gpu", "cpu", "nvme")}}


def activation_bytes(shape, batch: int, seq: int, half: bool, autocast: bool,
                     checkpointing: bool, attention: str, chunked: bool = False, fp8: bool = False, tp: int = 1,
                     sequence_parallel: bool = False, blocks: float | None = None,
                     outputs: int = 1, cp: int = 1) -> tuple[int, int]:
    """(saved for backward at the end of the forward, extra while a checkpointed layer is recomputed).

    Bytes per token per layer of Hugging Face's Llama, GPT-2 and Mixtral layers, counted from the
    tensors autograd saves (tests/test_plan.py measures them): the h terms are the norms,
    projections and residual, i the MLP, heads the attention's log-sum-exp. `half`: 16-bit
    compute, by autocast over fp32 parameters (`autocast`) or on a 16-bit model (FSDP2's
    MixedPrecisionPolicy, DeepSpeed), whose norms keep less (Llama's: an fp32 copy of the input
    and a 16-bit output, where autocast keeps fp32 input and output) and whose projections share one
    16-bit input where autocast casts one for each. Under autocast, every layer also keeps the 16-bit
    copy of its weights that the matmuls used. `chunked` (trainer.loss_chunk_tokens): the full
    logits' log-softmax (4 B x vocabulary per token) and the output layer's 16-bit copy are not
    kept: loss_lines counts what the chunked loss holds instead. Packed documents (data.packing=documents)
    keep what one sequence a row keeps: their attention (trainloop.model.attention.document_attention) makes
    no (seq x seq) mask and keeps the same tensors sdpa does. `fp8` (precision=fp8): the blocks' linear weights are
    cast to float8 for the matmuls, 1 B/param kept for the backward instead of the 16-bit copy;
    the float8 inputs torchao keeps are counted at 16 bits (an overestimate: half that). `tp`
    (parallel.tp_size, Llama and Mixtral only): what lies between a column-wise projection and its
    row-wise partner (the queries, keys, values, attention output and log-sum-exp; a dense MLP's
    four inner tensors) and the blocks' 16-bit weight copies are 1/tp on each rank; the norms, the
    projections' replicated inputs, a mixture's experts and router, the logits and the RoPE tables
    are whole. `sequence_parallel` (parallel.sequence_parallel): the norms' kept tensors and, with
    checkpointing, each block's kept input (the residual stream) are 1/tp of the sequence too; the
    projections' inputs, gathered before q/k/v and gate/up, stay whole, and so does the final norm
    (it gathers first). tests/test_tensor_parallel.py measures both on 2 tp ranks. `blocks`: the
    blocks' activations a process keeps at its peak, in one micro-batch's blocks (a pipeline stage's
    blocks times its micro-batches in flight; default every block, once); `outputs`: the micro-batches
    whose output layer and logits it keeps (0 on a pipeline stage without them). `cp`
    (parallel.cp_size): each rank holds 1/cp of every sequence's tokens through the blocks and the
    loss; attention's own tensors are the whole sequence on 1/cp of the heads, as many bytes.
    """
    h, i, heads, V = shape.hidden, shape.intermediate, shape.heads, shape.vocab
    kv = shape.kv_heads * h // heads  # the width of the key and value projections
    seq = seq // cp  # this rank's slice of each sequence
    tokens = batch * seq
    logits = 0 if chunked else 4 * V  # the fp32 log-softmax cross-entropy keeps
    cast = half and autocast  # 16-bit copies made for each matmul; norms and residual stream in fp32
    model16 = half and not autocast  # a 16-bit model: its norms and residual stream in 16 bits too
    b = 2 if half else 4  # bytes of an element the matmuls compute in
    if shape.family == "llama":
        # the two norms: each keeps its input, its fp32 output and rsqrt (a 16-bit model: an fp32 copy of
        # its input, the rsqrt and its 16-bit output); 1/tp under sequence parallelism
        norms = 12 * h + 8 if model16 else 16 * h + 8
        # the projections' inputs, the norms' outputs (under autocast q, k, v, gate and up each cast their
        # own 16-bit copy): whole on every tp rank, gathered there under sequence parallelism
        whole = 10 * h if cast else 2 * b * h
        # split: q (RoPE'd), k, v, the attention output and its fp32 log-sum-exp; the MLP's gate, its
        # activation, up and down's input
        split, mlp = b * (2 * h + 2 * kv) + 4 * heads, 4 * b * i
        final = 8 * h if model16 else 10 * h if cast else 12 * h  # the final norm's and the output layer's input
        rope = 2 * (2 if model16 else 4) * seq * (h // heads)  # the cos and sin tables
        rest = tokens * (logits + final + 20) + rope
    else:  # not split by tensor parallelism (refused for these: trainloop.parallel.tp); a 16-bit model's
        # LayerNorms keep their input and statistics in 16 bits, autocast's in fp32
        whole = 16 * h + 10 * i + 4 * heads + 8 if model16 else \
            (20 * h + 10 * i + 4 * heads + 16) if half else (32 * h + 20 * i + 4 * heads + 16)
        norms, mlp, split, tp = 0, 0, 0, 1
        rest = tokens * (logits + (4 * h + 22 if model16 else (6 if half else 8) * h + 26)) + 8 * seq
    if attention == "eager":  # the softmax probabilities instead of the log-sum-exp
        split += heads * (seq - 1) * (2 if half else 4)
    if shape.num_experts:  # each token through k experts' MLPs (tokens sorted by expert) instead of one MLP
        k, E = shape.experts_per_token, shape.num_experts
        # measured (CPU, transformers 5.23): under autocast the expert matmuls keep fp32 activations and
        # make no 16-bit copies of the expert weights, and the router casts one input where a dense MLP's
        # gate and up cast two; the experts and the router are whole on every tp rank
        mlp = 0
        whole += k * ((4 if cast else b) * (2 * h + 4 * i) + 48) - (2 * h + 12 if cast else 0)
        whole += 8 * E + 4  # the router's logits and probabilities
    weight_copies = (1 if fp8 else 2) * (shape.layer_linear_params - shape.expert_params // shape.num_layers) \
        // tp if autocast else 0
    rest += 2 * V * h if autocast and not chunked else 0  # the output projection's 16-bit copy
    sp = tp if sequence_parallel else 1  # the sequence's share of a tp rank, between the split matrices
    layer = tokens * norms // sp + tokens * whole + tokens * (split + mlp) // tp + weight_copies
    blocks = shape.num_layers if blocks is None else blocks
    if not checkpointing:
        return round(blocks * layer) + outputs * rest, 0
    residual = tokens * h * (2 if half and not autocast else 4) // sp  # each layer's input, kept
    return round(blocks * residual) + outputs * rest, layer


def all_to_all_bytes(nbytes: int, ranks: int) -> int:
    """Bytes one rank sends in an all-to-all of a tensor of `nbytes` (its own): all but its own share."""
    return (ranks - 1) * nbytes // ranks


def context_parallel_traffic(shape, batch: int, seq: int, half: bool, cp: int, checkpointing: bool,
                             micro_batches: int) -> Transfer:
    """Context parallelism's all-to-alls per optimizer step (trainloop.parallel.context): each
    block's forward swaps this rank's slice of the queries, keys and values for the whole sequence
    on its heads and the attention output back; the backward swaps their gradients the same way,
    and a checkpointed block's recomputed forward swaps again."""
    kv = shape.kv_heads * shape.hidden // shape.heads
    kv = kv if shape.kv_heads % cp == 0 else shape.hidden  # too few to split: repeated per query head first
    tokens = batch * seq // cp
    forward = all_to_all_bytes(tokens * (2 * shape.hidden + 2 * kv) * (2 if half else 4), cp)
    passes = 3 if checkpointing else 2
    return Transfer("attention all-to-all (sequence <-> heads)", forward * passes * shape.num_layers * micro_batches,
                    "cp", note=f"{shape.num_layers} blocks x {micro_batches} micro-batch(es), forward and backward"
                               + (" and the recomputed forward" if checkpointing else ""))
