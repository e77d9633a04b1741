"""Model FLOPs per token and the device's peak: what `tflops` and `mfu` in metrics.jsonl are made of.

Model FLOPs count the matmuls training needs, as PaLM's appendix B does (Chowdhery et al. 2022):
per token, 6 x N (N: the weights of the matmuls; forward 2N, backward 4N: gradients of the
activations and of the weights) + 12 x n_layers x H x T for attention (H: heads x head dim, T:
seq_len; the scores Q K^T and their product with V, forward and backward). Like PaLM (and
torch.utils.flop_counter) the causal mask is NOT halved: every T x T score is counted.
Embedding lookups are not matmuls; the output head is. Recomputation by gradient
checkpointing is not counted (that would be hardware FLOPs, not model FLOPs).

What is really computed:
- a mixture of experts (mixtral): per token only its `experts_per_token` experts and the router;
- LoRA / QLoRA: the frozen base runs forward (2N) and backward through the activations (2N)
  but computes no weight gradients, so 4 x N_base; the trained parameters (the adapters and
  adapter.modules_to_save) cost the full 6 x. Attention is unchanged (12 L H T).
"""

from __future__ import annotations

import logging

log = logging.getLogger("trainloop")

GATED_MLP = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo", "olmo2",
             "mixtral"}  # gate, up and down projections
PLAIN_MLP = {"gpt2"}  # up and down


def _get(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def attention_width(config) -> tuple[int, int]:
    """(n_layers, heads x head_dim): the shape the attention term of the formula reads (a vision-language
    model's language model's; its vision tower's matmuls are counted per token with the rest, an upper bound)."""
    config = config.get_text_config()
    hidden = _get(config, "hidden_size", "n_embd")
    heads = _get(config, "num_attention_heads", "n_head")
    head_dim = _get(config, "head_dim", default=hidden // heads)
    return _get(config, "num_hidden_layers", "n_layer"), heads * head_dim


def matmul_params(config, model=None) -> int:
    """Weights of the matmuls one token passes through (output head included, embeddings not).

    From the config for the architectures above; any other model is counted from its live
    parameters (every >= 2-d parameter but the input embeddings), which counts every expert of a
    mixture the table does not know."""
    kind = getattr(config, "model_type", None)
    if kind not in GATED_MLP | PLAIN_MLP:
        if model is None:
            raise ValueError(f"model_type {kind!r}: give the live model to count its matmul weights")
        return _live_matmul_params(model)
    layers, width = attention_width(config)
    hidden = _get(config, "hidden_size", "n_embd")
    heads = _get(config, "num_attention_heads", "n_head")
    head_dim = width // heads
    kv_heads = _get(config, "num_key_value_heads", default=heads)
    attention = 2 * hidden * width + 2 * hidden * kv_heads * head_dim  # q, o; k, v
    intermediate = _get(config, "intermediate_size", "n_inner", default=4 * hidden)
    if kind in PLAIN_MLP:
        mlp = 2 * hidden * intermediate
    elif kind == "mixtral":  # the experts a token is routed to, and the router
        mlp = config.num_experts_per_tok * 3 * hidden * intermediate + hidden * config.num_local_experts
    else:
        mlp = 3 * hidden * intermediate
    return layers * (attention + mlp) + hidden * config.vocab_size


def _live_matmul_params(model) -> int:
    from trainloop.model.tensors import full_numel

    embeddings = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    count = sum(full_numel(p) for p in model.parameters() if p.dim() >= 2 and p is not embeddings)
    if head is not None and head.weight is embeddings:  # tied: the head's matmul still runs
        count += full_numel(embeddings)
    return count


def flops_per_token(config, seq_len: int, trained_matmul_params: int | None = None, model=None) -> float:
    """Training FLOPs (forward + backward) per token at `seq_len`.

    `trained_matmul_params`: None when every weight trains; with an adapter, the matmul weights
    that train (the frozen rest costs 4 x, not 6 x)."""
    layers, width = attention_width(config)
    n = matmul_params(config, model)
    attention = 12 * layers * width * seq_len
    if trained_matmul_params is None:
        return 6 * n + attention
    return 4 * n + 6 * trained_matmul_params + attention


def forward_flops_per_token(config, seq_len: int, model=None) -> float:
    """A forward's FLOPs per token at `seq_len`, without gradients: a third of flops_per_token's."""
    layers, width = attention_width(config)
    return 2 * matmul_params(config, model) + 4 * layers * width * seq_len


def trained_matmul_params(model) -> int:
    """The >= 2-d parameters that train (LoRA's A and B, modules_to_save), counted whole under sharding."""
    from trainloop.model.tensors import full_numel

    return sum(full_numel(p) for p in model.parameters() if p.requires_grad and p.dim() >= 2)


# NVIDIA's published dense (no sparsity) tensor-core peaks in TFLOPS per GPU, by the precision
# the matmuls run in. Sources: A100 datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/
# a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf); H100 datasheet (SXM / PCIe / NVL);
# H200 datasheet (SXM / NVL); HGX/DGX B200 datasheet (per GPU = 1/8 of HGX B200, sparse figures
# halved); L4, L40S, A10 datasheets; V100 datasheet (no bf16 or tf32 tensor cores); RTX 4090: Ada
# Lovelace architecture whitepaper appendix (FP16/BF16 with FP32 accumulate, 165.2 dense).
# A10G has no NVIDIA datasheet: the figures are AWS G5's (about half an A10's tensor rate).
# Matched against torch.cuda.get_device_name() in order: the first key found in the name wins.
PEAK_TFLOPS = {
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0},  # SXM ("H100 80GB HBM3")
    "H200 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0},  # SXM
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1125.0, "fp32": 75.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    "L40": {"bf16": 181.05, "fp16": 181.05, "tf32": 90.5, "fp32": 90.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},
    "V100-PCIE": {"fp16": 112.0, "fp32": 14.0},
    "V100": {"fp16": 125.0, "fp32": 15.7},  # SXM2
}


def table_peak(gpu_name: str, kind: str) -> float | None:
    """PEAK_TFLOPS' dense `kind` (bf16, tf32...) figure of the first key found in `gpu_name` (as
    torch.cuda.get_device_name() or `plan --suggest --gpu` names it), or None."""
    for key, peaks in PEAK_TFLOPS.items():
        if key.lower() in gpu_name.lower():
            return peaks.get(kind)
    return None


def matmul_precision(precision: str) -> str:
    """What the matmuls run in: fp32 runs on tf32 tensor cores when torch allows it."""
    import torch

    if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    if precision == "fp8":  # MFU against the bf16 peak: the layers left in bf16 and the attention run at it
        return "bf16"
    return precision


def peak_tflops(device, precision: str, override: float | None) -> float | None:
    """The device's peak for the run's precision: logging.peak_tflops if given; else the table's
    figure for a known GPU; else None (a CPU, or an unknown GPU: said once, here)."""
    if override is not None:
        return float(override)
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    kind = matmul_precision(precision)
    peak = table_peak(name, kind)
    if peak is not None:
        return peak
    log.warning("no peak TFLOPS known for %s in %s: mfu is null; set logging.peak_tflops=N (the GPU's "
                "dense %s peak) to report it", name, kind, kind)
    return None
