"""The model's shape for the planner (trainloop.tools.plan): built on the meta device (no weights), read as
the family, the sizes of each block, the trainable parameters' shapes (a LoRA adapter's included) and how a
tensor-parallel split cuts each, a mixture's experts apart."""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainloop.objectives import OBJECTIVES
from trainloop.optim.optimizers import hidden_matrices


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
    # a vision-language model: its vision tower's shape (a GPT-2-like encoder: LayerNorm, GELU MLP; its sequence an
    # image's patches), the parameters of the tower and projector, and the tokens one image takes in a row (0: as
    # the processor decides per image, e.g. Qwen2-VL's)
    vision: ModelShape | None = None
    vision_params: int = 0
    image_tokens: int = 0
    image_patches: int = 0  # the vision tower's sequence for one image (its patches and class token)

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

    from trainloop.data.loaders import run_tokenizer
    from trainloop.model.builder import build_model_config
    from trainloop.model.heads import as_scorer, auto_class
    from trainloop.model.vision import is_vision
    from trainloop.parallel.tensor_parallel import sequence_parallel_problem

    tokenizer = run_tokenizer(cfg)  # as the build takes it (a vision-language model's: the image token added)
    whole = build_model_config(cfg.model, len(tokenizer))
    vision = is_vision(whole)
    config = whole.get_text_config()  # the language model's shape: a vision-language model's text config
    head = OBJECTIVES[cfg.objective.name].head
    if head == "score":
        as_scorer(whole)
    with torch.device("meta"):
        model = auto_class(head, vision).from_config(whole, attn_implementation="eager")
    if model.get_input_embeddings().num_embeddings < config.vocab_size:
        model.resize_token_embeddings(config.vocab_size)
    n_layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    decoder = model.get_decoder() if vision else model  # not the vision tower's blocks
    layers = next(m for m in decoder.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n_layers)
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
        **(vision_shape(whole, model) if vision else {}),
    )


def vision_shape(config, model) -> dict:
    """A vision-language model's ModelShape fields: its vision tower as a shape of its own, the tower's and
    projector's parameters, and an image's tokens in a row and patches in the tower (a CLIP/SigLIP-like tower
    of one fixed image size; 0 where the processor decides per image)."""
    from trainloop.model.vision import part

    vc = config.vision_config
    side, patch = getattr(vc, "image_size", None), getattr(vc, "patch_size", None)
    patches = (side // patch) ** 2 if isinstance(side, int) and isinstance(patch, int) else 0
    dropped = getattr(config, "vision_feature_select_strategy", "default") == "default"  # LLaVA drops the class token
    hidden = vc.hidden_size
    tower = ModelShape(family="gpt2", num_layers=vc.num_hidden_layers, hidden=hidden,
                       intermediate=getattr(vc, "intermediate_size", 4 * hidden), heads=vc.num_attention_heads,
                       kv_heads=vc.num_attention_heads, vocab=0, shapes=[], layer_linear_params=0,
                       largest_layer_params=0)
    parts = [part(model, name) for name in ("vision", "projector")]
    params = sum(p.numel() for module in parts if module is not None for p in module.parameters())
    return {"vision": tower, "vision_params": params, "image_patches": patches + 1 if patches else 0,
            "image_tokens": patches if dropped else patches + 1 if patches else 0}


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
